"""What each model family's test module checks the same way, on its random-weight checkpoints (the module's
VARIANTS, {name: (factory, config_edits)}): the checkpoints saved once per module, logits and greedy tokens on the
C decode loop and on the torch path against transformers', a compressed copy's logits, and engines at tp/ep > 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import cpu_attention
from engine.compression.compress import compress_checkpoint
from engine.engine import EngineConfig, LLMEngine
from tests.engine.conftest import _randomize, save_random_checkpoint
from tests.engine.test_compression_checkpoint import to_bf16
from tests.engine.test_moe import check_against_transformers, random_prompts
from tests.engine.test_parallel import PROMPT, Engines

DECODE_PATHS = pytest.mark.parametrize("decode_in_c", [True, False], ids=["c-decode", "torch-decode"])
BOTH_WEIGHT_MODES = ("decompress_on_load", "compressed_in_memory")


def variant_fixture(variants: dict, randomize=_randomize, prefix: str = ""):
    """The module's `variant` fixture: (name, directory, transformers' model) for each of variants, its checkpoint
    saved once per module (in a directory named prefix + name, its weights `randomize`d)."""

    @pytest.fixture(scope="module", params=sorted(variants))
    def variant(request, tmp_path_factory):
        directory = tmp_path_factory.mktemp(prefix + request.param)
        factory, edits = variants[request.param]
        return request.param, directory, save_random_checkpoint(directory, factory, edits, randomize)

    return variant


def check_decode_path(variant, decode_in_c: bool, monkeypatch, torch_variant: str, why_one: str,
                      needs_c_attention: bool = True) -> None:
    """Batched chunked prefill and decode rows equal transformers' logits and greedy tokens, on the C decode loop or
    (torch_variant alone, the others skipped for why_one) with the C attention declined. needs_c_attention: the C
    path skips where the C attention is not built (False where the C loop declines the model anyway)."""
    name, directory, reference = variant
    if not decode_in_c:
        if name != torch_variant:
            pytest.skip(why_one)
        monkeypatch.setattr(cpu_attention, "supports", lambda *args: False)
    elif needs_c_attention and not cpu_attention.available():
        pytest.skip("the C decode attention is not built")
    check_against_transformers(directory, reference, random_prompts([3, 9, 20, 41], seed=11), max_tokens=6)


def check_compressed_copy(original: Path, compressed: Path, weight_modes=BOTH_WEIGHT_MODES,
                          prompt: list[int] = PROMPT) -> None:
    """original's checkpoint (saved in float32) rounded to bfloat16 and compressed into compressed: in each weight
    mode the copy's logits for prompt are transformers' on the bfloat16 original."""
    import transformers

    to_bf16(original)
    reference = transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    compress_checkpoint(original, compressed, chunk_size=64, show_progress=False, say=lambda *_: None)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    for mode in weight_modes:
        engine = LLMEngine(compressed, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, dtype="float32",
                                                    block_size=8, weight_mode=mode))
        torch.testing.assert_close(engine.prompt_logits(prompt), theirs, rtol=1e-4, atol=1e-4, msg=mode)


class VariantEngines(Engines):
    """Engines on a module's VARIANTS, each checkpoint saved as its `variant` fixture saves it, on first use."""

    def checkpoint(self, name: str) -> Path:
        directory = self.root / name
        if name not in self.references:
            factory, edits = self.checkpoints[name]
            self.references[name] = save_random_checkpoint(directory, factory, edits)
        return directory


def parallel_engines_fixture(root: str, checkpoints: dict, engines: type[Engines] = VariantEngines):
    """The module's `parallel_engines` fixture: `engines` on checkpoints, under a directory named root, stopped with
    the module."""

    @pytest.fixture(scope="module")
    def parallel_engines(tmp_path_factory):
        made = engines(tmp_path_factory.mktemp(root), checkpoints)
        yield made
        made.close()

    return parallel_engines


def save_per_expert(directory: Path, published: Path) -> None:
    """directory's checkpoint as mixture-of-experts checkpoints are published, into `published`: one tensor per expert
    projection (`experts.{e}.gate_proj/up_proj/down_proj.weight`) where transformers saves them stacked."""
    published.mkdir()
    tensors = {}
    for key, tensor in load_file(directory / "model.safetensors").items():
        prefix, _, kind = key.rpartition("experts.")
        if kind == "gate_up_proj":
            for e, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                tensors[f"{prefix}experts.{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"{prefix}experts.{e}.up_proj.weight"] = up.contiguous()
        elif kind == "down_proj":
            tensors.update({f"{prefix}experts.{e}.down_proj.weight": t.contiguous() for e, t in enumerate(tensor)})
        else:
            tensors[key] = tensor
    save_file(tensors, str(published / "model.safetensors"), metadata={"format": "pt"})
    (published / "config.json").write_text((directory / "config.json").read_text())


def sharp_logits_check(variant, threshold: float, after=None):
    """An engine on the variant's checkpoint, its prompt logits checked equal to transformers' (PROMPT), and
    far_after(change): whether they land farther than `threshold` from transformers' while change(patch) holds (patch: a
    MonkeyPatch, undone after it; `after()`, if given, then rebuilds what a change left behind). A family's test that
    its distinguishing features are what matches transformers asserts far_after of each feature dropped."""
    _name, directory, reference = variant
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=4 << 20, show_progress=False, block_size=8))
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(engine.prompt_logits(PROMPT), theirs, rtol=1e-4, atol=1e-4)

    def far_after(change) -> bool:
        with pytest.MonkeyPatch.context() as patch:
            change(patch)
            distance = (engine.prompt_logits(PROMPT) - theirs).abs().max()
        if after is not None:
            after()
        return bool(distance > threshold)

    return engine, far_after


def assert_shape_as_transformers(cfg, their, head_dim: int) -> None:
    """The engine's config (cfg) has the shape transformers' config (their) gives the model, with heads of head_dim."""
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == (their.vocab_size, their.hidden_size, their.intermediate_size, their.num_hidden_layers,
                              their.num_attention_heads, their.num_key_value_heads, head_dim)
