"""A small random-weight checkpoint (Llama, or the mixture-of-experts Mixtral, Qwen3-MoE or DeepSeek-V3)
with a trained byte-level BPE tokenizer.

It lets everything run with no download. Its weights are random, so its output is meaningless
text: it exercises the machinery (loading, batching, caching, transfer, expert routing), not language.

Importing this module does not import torch (it loads when weights are made), so the command line can
offer SIZES and read a demo model's record (`demo_record`) without it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BOS, EOS, START_HEADER, END_HEADER = "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [BOS, EOS, START_HEADER, END_HEADER, "<|pad|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Training text for the tokenizer: varied English so merges look like real subwords.
CORPUS = """
The edge network serves requests from the site nearest to each user. A router picks where the
prompt is processed and where the answer is generated, and moves the key-value cache between them
when they differ. When a site fails in the middle of an answer, another site resumes the stream.
Large language models predict the next token from the tokens before it. Attention reads the keys
and values of every earlier token; a paged cache stores them in fixed-size blocks so memory is not
wasted, and a prefix cache lets requests that share a system prompt reuse its blocks.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Weather today: sunny in Lisbon, rain in London, snow in Oslo, fog in San Francisco, heat in Singapore.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828; dates 2026-11-21; times 18:38:00.
def add(a, b): return a + b  # code appears in prompts too { "json": [1, 2, 3], "ok": true }
"""


@dataclass(slots=True)
class DemoSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


SIZES = {
    "tiny": DemoSize(64, 2, 4, 2, 128, 512, 2048),    # tests
    "small": DemoSize(256, 4, 8, 4, 688, 2048, 4096),  # `make run` and demos
    # Benchmarks where a decode step's cost should be mostly weights, as in production models: in
    # `small` a 1,500-token prompt's KV is 47% of the weights' bytes (one such prompt decoding beside
    # four chats makes a CPU step ~50% longer); here 13% (~15%); in an 8B model on a GPU, ~1%.
    "medium": DemoSize(512, 4, 8, 2, 1408, 2048, 4096),
}

ARCHITECTURES = ("llama", "mixtral", "qwen3-moe", "deepseek-v3")
# Written last into a demo model's directory: what it was made as, so `edgefire up` can tell a demo
# model of another size (or one whose writing was cut short) from the one asked for.
DEMO_RECORD = "edgefire-demo.json"


@dataclass(slots=True)
class DemoExperts:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int      # of one expert
    num_groups: int             # DeepSeek-V3: experts routed in this many groups, a token using topk_groups of them
    topk_groups: int


# The MoE demos have the dense demo's attention and several narrower experts per layer.
EXPERTS = {"tiny": DemoExperts(4, 2, 64, 2, 1), "small": DemoExperts(8, 2, 256, 4, 2),
           "medium": DemoExperts(8, 2, 512, 4, 2)}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines * 20, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def make_demo_model(out_dir: str | Path, size: str = "small", seed: int = 0, arch: str = "llama") -> Path:
    """Write a complete checkpoint directory (config, weights, tokenizer, chat template)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    shape, experts = SIZES[size], EXPERTS[size] if arch != "llama" else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_RECORD).unlink(missing_ok=True)   # until the new weights are whole, it records nothing
    tokenizer = train_tokenizer(shape.vocab_size)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.save(str(out / "tokenizer.json"))
    bos_id, eos_id = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    head_dim = shape.hidden_size // shape.num_heads
    config: dict = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "torch_dtype": "float32",
    } | _moe_config(arch, experts, shape)
    if arch == "deepseek-v3":
        del config["head_dim"]   # its per-head dims are the latent attention's own
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos_id, "eos_token_id": [eos_id]}, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": shape.max_position_embeddings,
    }, indent=2))
    from safetensors.torch import save_file

    weights = random_weights(shape, vocab_size, head_dim, seed, arch, experts)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / DEMO_RECORD).write_text(json.dumps({"size": size, "arch": arch, "seed": seed}, indent=2))
    log.info("wrote demo model (%s %s, random weights) to %s", size, arch, out)
    return out


def demo_record(directory: str | Path) -> dict | None:
    """{"size", "arch", "seed"} of the demo model make_demo_model wrote in `directory`; None where there
    is none (no demo model, one cut short, one written before models were recorded, an unreadable record)."""
    try:
        record = json.loads((Path(directory) / DEMO_RECORD).read_bytes())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _moe_config(arch: str, experts: DemoExperts | None, shape: DemoSize) -> dict:
    if arch == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts.num_experts,
                "num_experts_per_tok": experts.num_experts_per_tok, "intermediate_size": experts.intermediate_size}
    if arch == "qwen3-moe":
        # Layer 0 keeps a dense MLP (mlp_only_layers), as some Qwen3-MoE checkpoints do.
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": experts.num_experts,
                "num_experts_per_tok": experts.num_experts_per_tok, "moe_intermediate_size": experts.intermediate_size,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    if arch == "deepseek-v3":
        # Layer 0 dense (first_k_dense_replace), one shared expert beside the routed ones, latent attention.
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                "num_key_value_heads": shape.num_heads, "n_routed_experts": experts.num_experts,
                "num_experts_per_tok": experts.num_experts_per_tok, "moe_intermediate_size": experts.intermediate_size,
                "n_group": experts.num_groups, "topk_group": experts.topk_groups, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                "rope_interleave": True} | _mla_dims(shape)
    return {}


def _mla_dims(shape: DemoSize) -> dict:
    head_dim = shape.hidden_size // shape.num_heads
    return {"kv_lora_rank": shape.hidden_size // 2, "q_lora_rank": shape.hidden_size // 2,
            "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim}


def random_weights(shape: DemoSize, vocab_size: int, head_dim: int, seed: int, arch: str = "llama",
                   experts: DemoExperts | None = None) -> dict[str, torch.Tensor]:
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*dims: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*dims, generator=generator) * std

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": normal(inter, h, std=0.1), prefix + "up_proj.weight": normal(inter, h, std=0.1),
                prefix + "down_proj.weight": normal(h, inter, std=0.05)}

    h, inter = shape.hidden_size, shape.intermediate_size
    q_rows, kv_rows = shape.num_heads * head_dim, shape.num_kv_heads * head_dim
    weights = {"model.embed_tokens.weight": normal(vocab_size, h, std=1.0), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(vocab_size, h, std=0.5)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        if arch == "deepseek-v3":
            weights |= _deepseek_layer(p, shape, experts, i, normal, mlp)
            continue
        weights |= {
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(q_rows, h, std=0.2),
            p + "self_attn.k_proj.weight": normal(kv_rows, h, std=0.2),
            p + "self_attn.v_proj.weight": normal(kv_rows, h, std=0.2),
            p + "self_attn.o_proj.weight": normal(h, q_rows, std=0.05),
        }
        if arch == "qwen3-moe":
            weights |= {p + "self_attn.q_norm.weight": torch.ones(head_dim), p + "self_attn.k_norm.weight": torch.ones(head_dim)}
        if arch == "llama" or (arch == "qwen3-moe" and i == 0):
            weights |= mlp(p + "mlp.", inter)
            continue
        # A router with spread-out logits, so tokens really do go to different experts.
        block = p + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        weights[block + "gate.weight"] = normal(experts.num_experts, h, std=0.5)
        for e in range(experts.num_experts):
            expert = mlp(f"{block}experts.{e}.", experts.intermediate_size)
            if arch == "mixtral":  # Mixtral names an expert's gate, down and up projections w1, w2, w3
                expert = {k.replace("gate_proj", "w1").replace("down_proj", "w2").replace("up_proj", "w3"): v
                          for k, v in expert.items()}
            weights |= expert
    return weights


def _deepseek_layer(p: str, shape: DemoSize, experts: DemoExperts, i: int, normal, mlp) -> dict[str, torch.Tensor]:
    import torch

    h, heads, dims = shape.hidden_size, shape.num_heads, _mla_dims(shape)
    rank, q_rank, rope = dims["kv_lora_rank"], dims["q_lora_rank"], dims["qk_rope_head_dim"]
    a = p + "self_attn."
    weights = {
        p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
        a + "q_a_proj.weight": normal(q_rank, h, std=0.2), a + "q_a_layernorm.weight": torch.ones(q_rank),
        a + "q_b_proj.weight": normal(heads * (dims["qk_nope_head_dim"] + rope), q_rank, std=0.2),
        a + "kv_a_proj_with_mqa.weight": normal(rank + rope, h, std=0.2), a + "kv_a_layernorm.weight": torch.ones(rank),
        a + "kv_b_proj.weight": normal(heads * (dims["qk_nope_head_dim"] + dims["v_head_dim"]), rank, std=0.2),
        a + "o_proj.weight": normal(h, heads * dims["v_head_dim"], std=0.05),
    }
    if i == 0:
        return weights | mlp(p + "mlp.", shape.intermediate_size)
    # A router with spread-out logits and a correction bias, so tokens really do go to different experts.
    weights[p + "mlp.gate.weight"] = normal(experts.num_experts, h, std=0.5)
    weights[p + "mlp.gate.e_score_correction_bias"] = normal(experts.num_experts, std=0.1)
    weights |= mlp(p + "mlp.shared_experts.", experts.intermediate_size)
    for e in range(experts.num_experts):
        weights |= mlp(f"{p}mlp.experts.{e}.", experts.intermediate_size)
    return weights
