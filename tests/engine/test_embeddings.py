"""Embedding requests against transformers: the final hidden states (AutoModel's last_hidden_state) pooled as
sentence-transformers pools them, for Llama and Qwen3 checkpoints saved bare (AutoModel) and as causal LMs."""

from __future__ import annotations

import json

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.errors import CheckpointError, InvalidRequestError
from engine.pooling import load_pooling
from tests.engine.conftest import SMALL, _randomize

pytestmark = pytest.mark.usefixtures("one_thread")

# different lengths; chunked at 16 tokens a step, a batch of 12 blocks reaching past one block
PROMPTS = [list(range(3, 40)), [5, 9, 11], [7], list(range(100, 150)), list(range(60, 80))]


def _model(arch: str, bare: bool):
    import transformers
    if arch == "llama":
        config = transformers.LlamaConfig(**SMALL)
        cls = transformers.LlamaModel if bare else transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3Config(**{**SMALL, "head_dim": 16})
        cls = transformers.Qwen3Model if bare else transformers.Qwen3ForCausalLM
    torch.manual_seed(1234)
    model = cls(config).eval()
    _randomize(model)
    return model


def _sentence_transformers_files(directory, mode: str | None, normalize: bool, **pooling_extra) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them (mode None: neither)."""
    if mode is None:
        return
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    keys = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    config = {"word_embedding_dimension": SMALL["hidden_size"],
              **{f"pooling_mode_{key}": key == mode for key in keys}, "include_prompt": True, **pooling_extra}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config))


def _reference(model, prompt: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """transformers' AutoModel last hidden state, pooled as sentence-transformers pools it."""
    base = getattr(model, "model", model)   # a causal LM's backbone, as AutoModel loads it
    with torch.no_grad():
        hidden = base(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"mean_tokens": hidden.mean(0), "cls_token": hidden[0], "lasttoken": hidden[-1]}[mode]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def _embed(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, object]:
    for i, prompt in enumerate(prompts):
        engine.add_embedding_request(f"e{i}", prompt)
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # KV freed at once
    return {request_id: outputs[request_id] for request_id in sorted(outputs)}


CASES = {
    # (arch, saved bare, sentence-transformers pooling mode or None, Normalize module)
    "llama-bare-default": ("llama", True, None, True),
    "qwen3-bare-default": ("qwen3", True, None, True),
    "qwen3-bare-mean-normalized": ("qwen3", True, "mean_tokens", True),
    "llama-causal-mean": ("llama", False, "mean_tokens", False),
    "qwen3-causal-lasttoken": ("qwen3", False, "lasttoken", False),
    "llama-bare-cls-normalized": ("llama", True, "cls_token", True),
}


@pytest.mark.parametrize("case", CASES)
def test_embeddings_match_transformers(tmp_path, case):
    arch, bare, mode, normalize = CASES[case]
    model = _model(arch, bare)
    model.save_pretrained(tmp_path)
    _sentence_transformers_files(tmp_path, mode, normalize)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", max_num_batched_tokens=16, show_progress=False))
    outputs = _embed(engine, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        out = outputs[f"e{i}"]
        expected = _reference(model, prompt, mode or "lasttoken", normalize)
        assert out.embedding.dtype == torch.float32 and out.embedding.shape == (SMALL["hidden_size"],)
        torch.testing.assert_close(out.embedding, expected, atol=2e-5, rtol=1e-4)
        assert out.num_prompt_tokens == len(prompt) and out.token is None
        if normalize:
            assert abs(float(out.embedding.norm()) - 1) < 1e-5


def test_last_token_pooling_reads_the_prefix_cache_and_mean_pooling_does_not(tmp_path):
    model = _model("qwen3", True)
    model.save_pretrained(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", show_progress=False))
    prompt = list(range(3, 60))
    first, again = _embed(engine, [prompt])["e0"], _embed(engine, [prompt])["e0"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48   # the full blocks before the last token
    torch.testing.assert_close(again.embedding, first.embedding, atol=2e-5, rtol=1e-4)

    _sentence_transformers_files(tmp_path, "mean_tokens", False)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", show_progress=False))
    first, again = _embed(engine, [prompt])["e0"], _embed(engine, [prompt])["e0"]
    assert again.num_cached_tokens == 0   # every position's hidden state is pooled: none may be skipped
    torch.testing.assert_close(again.embedding, _reference(model, prompt, "mean_tokens", False), atol=2e-5, rtol=1e-4)


def test_embeddings_batch_with_generation_and_fill_the_context(tmp_path):
    model = _model("llama", False)
    model.save_pretrained(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", max_model_len=64, max_num_batched_tokens=32,
                                              show_progress=False))
    from engine.sampling import SamplingParams
    engine.add_request("gen", list(range(10, 30)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    whole = list(range(1, 65))   # the whole context: an embedding generates nothing, so it may fill it
    engine.add_embedding_request("emb", whole)
    tokens, embedding = [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "gen":
                tokens.append(out.token.token_id)
            else:
                embedding = out.embedding
    assert len(tokens) == 5
    torch.testing.assert_close(embedding, _reference(model, whole, "lasttoken", True), atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="input has 65 tokens; this model's context holds 64"):
        engine.add_embedding_request("long", list(range(1, 66)))


def test_bare_backbone_without_lm_head_serves_embeddings_only(tmp_path):
    _model("llama", True).save_pretrained(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", show_progress=False))
    from engine.sampling import SamplingParams
    with pytest.raises(InvalidRequestError, match="no LM head .* serves embeddings only"):
        engine.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("files, message", [
    ({"1_Pooling/config.json": {"pooling_mode_max_tokens": True}},
     r"1_Pooling/config.json: pooling_mode_max_tokens is not supported"),
    ({"1_Pooling/config.json": {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}},
     r"1_Pooling/config.json: set exactly one of .* \(found pooling_mode_cls_token, pooling_mode_mean_tokens\)"),
    ({"1_Pooling/config.json": {"pooling_mode_lasttoken": True, "include_prompt": False}},
     r"1_Pooling/config.json: include_prompt false is not supported"),
    ({"1_Pooling/config.json": {"pooling_mode_lasttoken": True, "word_embedding_dimension": 32}},
     r"1_Pooling/config.json: word_embedding_dimension 32 is not the model's hidden_size 64"),
    ({"modules.json": [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]},
     r"modules.json: entry 2 has type 'sentence_transformers.models.Dense'"),
])
def test_unsupported_pooling_configs_name_the_file_and_key(tmp_path, files, message):
    _sentence_transformers_files(tmp_path, "lasttoken", False)
    for name, content in files.items():
        path = tmp_path / name
        if name.endswith("config.json"):
            content = {**json.loads(path.read_text()), **{k: False for k in json.loads(path.read_text())
                                                          if k.startswith("pooling_mode")}, **content}
        path.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=message):
        load_pooling(tmp_path, SMALL["hidden_size"])


def test_a_model_with_unusable_pooling_still_generates_and_refuses_embeddings(tmp_path):
    _model("qwen3", False).save_pretrained(tmp_path)
    _sentence_transformers_files(tmp_path, "max_tokens", False)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", show_progress=False))
    with pytest.raises(InvalidRequestError, match="cannot serve embeddings: .*pooling_mode_max_tokens"):
        engine.add_embedding_request("e", [1, 2, 3])
    from engine.sampling import SamplingParams
    engine.add_request("gen", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_engines_embed_as_one_rank_does(tmp_path, tp, pp):
    model = _model("llama", True)
    model.save_pretrained(tmp_path)
    _sentence_transformers_files(tmp_path, "mean_tokens", True)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", max_num_batched_tokens=16, show_progress=False,
                                              tensor_parallel_size=tp, pipeline_parallel_size=pp))
    try:
        outputs = _embed(engine, PROMPTS[:3])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(PROMPTS[:3]):
        torch.testing.assert_close(outputs[f"e{i}"].embedding, _reference(model, prompt, "mean_tokens", True),
                                   atol=2e-5, rtol=1e-4)
