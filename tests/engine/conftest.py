"""Random-weight checkpoints of each supported architecture, saved with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=320, max_position_embeddings=512)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**{**SMALL, **kw}))


def _llama31(**kw):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    return _llama(rope_scaling=rope, **kw)


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**{**SMALL, "sliding_window": 24, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**{**SMALL, **kw}))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(**{**SMALL, "head_dim": 16, **kw}))


def _mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(**{**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2, **kw}))


def _qwen3_moe(**kw):
    # Three layers, the middle one dense (mlp_only_layers): the engine must tell them apart.
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{
        **SMALL, "num_hidden_layers": 3, "head_dim": 16, "num_experts": 6, "num_experts_per_tok": 3,
        "moe_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1], **kw}))


def _deepseek_v3(**kw):
    # Three layers, the first dense (first_k_dense_replace); 8 routed experts in 4 groups, 2 groups and
    # 2 experts per token, one shared expert; latent attention with values wider than the nope keys.
    # Weights 5x the default scale: at 0.02 the attention barely moves the logits (a 1% error in its
    # softmax scale changed them by 5e-5), at 0.1 that error shows as 3e-2.
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{
        **SMALL, "initializer_range": 0.1, "num_hidden_layers": 3, "num_key_value_heads": 4, "first_k_dense_replace": 1,
        "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24, **kw}))


# DeepSeek-V3's long-context rope: yarn with an mscale that scales cos/sin and the softmax
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}


ARCHITECTURES = {
    "llama": _llama,
    "llama3.1-rope": _llama31,
    "llama-tied": lambda: _llama(tie_word_embeddings=True),
    "mistral-sliding": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3-tied": lambda: _qwen3(tie_word_embeddings=True),
    "mixtral": _mixtral,
    "qwen3-moe": _qwen3_moe,
    # Every other layer sparse (decoder_sparse_step), top-k probabilities not renormalized.
    "qwen3-moe-step2": lambda: _qwen3_moe(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False,
                                          num_hidden_layers=2),
    "deepseek-v3": _deepseek_v3,
    # A compressed query (q_lora_rank), yarn rope, rotary dims not interleaved, weights not renormalized.
    "deepseek-v3-qlora": lambda: _deepseek_v3(q_lora_rank=24, rope_parameters=YARN, rope_interleave=False,
                                              norm_topk_prob=False),
}


def _randomize(model) -> None:
    # transformers initializes norms to 1 and biases to 0; random values make the test see them.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith((".gate.weight", ".router.weight")):
                # An MoE router: logits far apart, so float rounding never flips a token's top-k.
                param.copy_(0.5 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's routing bias (zero as built)
                buffer.copy_(0.1 * torch.randn_like(buffer))


def save_random_checkpoint(directory: Path, factory, config_edits: dict, randomize=_randomize):
    """The checkpoint of factory()'s model, its weights `randomize`d (config_edits replace keys of its
    config.json, None removes one; a rope_scaling edit drops the newer rope_parameters), and transformers'
    model loaded back from it."""
    torch.manual_seed(1234)
    model = factory().eval()
    randomize(model)
    model.save_pretrained(directory)
    if config_edits:
        path = directory / "config.json"
        raw = json.loads(path.read_text())
        raw.pop("rope_parameters", None) if "rope_scaling" in config_edits else None
        for key, value in config_edits.items():
            raw.pop(key, None) if value is None else raw.__setitem__(key, value)
        path.write_text(json.dumps(raw))
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def save_and_read_back(directory: Path, factory, rewrite=None, same_weights: bool = False):
    """factory()'s model with random weights (norms and biases too) saved to directory, `rewrite(directory)` applied
    to the saved files, and transformers' model of the same class read back from them, which must find every
    tensor by its name (and, with same_weights, the very weights saved: the rewrite moved, never changed, them)."""
    torch.manual_seed(1234)
    model = factory().eval()
    _randomize(model)
    model.save_pretrained(directory)
    if rewrite:
        rewrite(directory)
    reference, info = type(model).from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if same_weights:
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(ours, theirs)
    return reference.eval()


def build_checkpoint(directory, arch: str, max_shard_size: str | None = None):
    torch.manual_seed(1234)
    model = ARCHITECTURES[arch]().eval()
    _randomize(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one torch thread is faster than a pool that waits on busy cores, and steadier under load.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory):
    """(directory, transformers model) of a small random Llama, for reference comparisons."""
    directory = tmp_path_factory.mktemp("llama")
    return directory, build_checkpoint(directory, "llama")
