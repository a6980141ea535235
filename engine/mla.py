"""Multi-head latent attention (DeepSeek-V2 and V3, GLM-4.7-Flash, Youtu-LLM) over a paged cache of compressed latents.

Per token the cache holds one vector: the RMS-normed latent c (kv_lora_rank dims) followed by the
rotated key part k_pe shared by every head (qk_rope_head_dim dims); nothing per head. Per head h,
the reference decompresses k_h = [W_uk_h c, k_pe] and v_h = W_uv_h c with kv_b_proj. Here the
decompression is absorbed into the query and the output instead (same math, reassociated):

    q_h . k_h = (W_uk_h^T q_nope_h) . c + q_pe_h . k_pe      scores against the latent itself
    sum_j a_j v_hj = W_uv_h (sum_j a_j c_j)                  attention output in latent space

so attention is multi-query attention with keys = the cached vector (kv_lora_rank + rope dims),
values = its first kv_lora_rank dims (a view of the same cache, engine.ops.paged_attention), and
each head's W_uv applied once to the result. A step reads kv_lora_rank + rope values per cached
token, never num_heads x (key + value) dims.

The attention op is the torch one (engine.ops) on every device: the Triton kernels take values
as wide as keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import ops as reference_ops
from engine.config import MLAConfig

# the eps of the latent norms (q_a_layernorm, kv_a_layernorm): the reference builds them with its default,
# not with the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(slots=True)
class MLAWeights:
    q_proj: torch.Tensor | None      # [H * qk_head_dim, hidden] when q_lora_rank is None
    q_a_proj: torch.Tensor | None    # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None    # [q_lora_rank]
    q_b_proj: torch.Tensor | None    # [H * qk_head_dim, q_lora_rank]
    kv_a_proj: torch.Tensor          # [kv_lora_rank + rope, hidden]: the latent and the shared rotary key
    kv_a_norm: torch.Tensor          # [kv_lora_rank]
    k_up: torch.Tensor               # [H, qk_nope_head_dim, kv_lora_rank]: kv_b_proj's key rows, per head
    v_up: torch.Tensor               # [H, v_head_dim, kv_lora_rank]: kv_b_proj's value rows, per head
    o_proj: torch.Tensor             # [hidden, H * v_head_dim]


def split_kv_b(kv_b: torch.Tensor, mla: MLAConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H * (nope + v), kv_lora_rank] as (k_up [H, nope, rank], v_up [H, v, rank]), contiguous."""
    per_head = kv_b.view(-1, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    k_up, v_up = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    return k_up.contiguous(), v_up.contiguous()


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rotary dims stored as pairs (x0, x1), (x2, x3), ... reordered to (x0, x2, ..., x1, x3, ...), the
    rotate-half layout: rotating that is rotating each pair, and the reference's output is in it too."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_attention(weights: MLAWeights, mla: MLAConfig, x: torch.Tensor, positions: torch.Tensor,
                  batch: reference_ops.AttentionBatch, layer_cache: torch.Tensor, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, scale: float, ops, query_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's attention output [T, hidden] for normed x [T, hidden]; layer_cache is
    [1, blocks, block_size, 1, kv_lora_rank + rope] and gets the new tokens' latents. query_scales [T] (Mistral 4's
    scaling by position, float32) multiply each token's query, rounded to its dtype first."""
    num_tokens, rank, rope = x.shape[0], mla.kv_lora_rank, mla.qk_rope_head_dim
    if weights.q_proj is not None:
        q = ops.linear(x, weights.q_proj)
    else:
        q_latent = ops.rms_norm(ops.linear(x, weights.q_a_proj), weights.q_a_norm, LATENT_NORM_EPS)
        q = ops.linear(q_latent, weights.q_b_proj)
    q = q.view(num_tokens, -1, mla.qk_head_dim)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, rope], dim=-1)
    kv = ops.linear(x, weights.kv_a_proj)
    latent = ops.rms_norm(kv[:, :rank], weights.kv_a_norm, LATENT_NORM_EPS)
    k_pe = kv[:, None, rank:]
    if mla.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = reference_ops.apply_rotary(q_pe.contiguous(), k_pe.contiguous(), positions, cos_table, sin_table)

    cache = layer_cache[0]
    cache.view(-1, rank + rope).index_copy_(0, batch.slot_mapping, torch.cat((latent, k_pe[:, 0]), dim=-1))
    # absorbed: each head's query in latent space, [H, T, nope] @ [H, nope, rank]
    q_latent = torch.bmm(q_nope.transpose(0, 1), weights.k_up).transpose(0, 1)
    query = torch.cat((q_latent, q_pe), dim=-1)
    if query_scales is not None:   # the whole query's scaling, applied to its absorbed form (linear in q)
        query = query * query_scales.to(query.dtype)[:, None, None]
    out_latent = reference_ops.paged_attention(query, cache, cache[..., :rank], batch, scale, None)
    out = torch.bmm(out_latent.transpose(0, 1), weights.v_up.transpose(1, 2)).transpose(0, 1)
    return ops.linear(out.reshape(num_tokens, -1), weights.o_proj)
