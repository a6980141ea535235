"""The model's hot ops in plain torch: RMSNorm, rotary embedding, KV-cache write, paged attention.

Each op is one function with a fixed signature so a faster kernel (engine/kernels) can replace it
on CUDA while this version stays the reference and the CPU path.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype (as the reference implementations do)."""
    orig_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(orig_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type != "llama3":
        return inv_freq
    old_ctx = rope.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rope.low_freq_factor
    high_freq_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(head_dim: int, rope: RopeConfig, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim] in float32 (halves duplicated, rotate-half layout)."""
    inv_freq = rope_inv_freq(head_dim, rope)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by their token positions [T]."""
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)

    return rotate(q), rotate(k)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at flat cache slots [T] (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


@dataclass(slots=True)
class AttentionBatch:
    """Where each sequence's queries sit in the flat token batch and where its keys sit in the cache.

    Decode sequences (one query each) come first and are attended in one batched call; each
    prefill chunk after them is attended on its own.
    """

    num_decode: int                  # the first num_decode sequences have exactly one query
    query_start: list[int]           # per sequence, its first row in the flat batch (+ total at the end)
    context_lens: list[int]          # per sequence, tokens in cache after this step (cached + new)
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decode] int64 on the model's device
    slot_mapping: torch.Tensor       # [num_tokens] int64: cache slot of each new token


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Tokens of the given blocks, in order: [len(block_ids) * block_size, Hkv, D].

    index_select, not advanced indexing: on CPU the latter is about ten times slower here.
    """
    return cache.index_select(0, block_ids).flatten(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, Hkv, L, D], mask [B, 1, Q, L] bool (True = attend)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                    scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's cached keys; returns [T, H, D].

    k_cache/v_cache are one layer's pool [num_blocks, block_size, Hkv, D]; the new tokens' keys
    must already be written (write_kv) so a sequence's keys are exactly its cache prefix.
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    if batch.num_decode:
        out[: batch.num_decode] = _decode_attention(q[: batch.num_decode], k_cache, v_cache, batch, scale, sliding_window)
    for i in range(batch.num_decode, len(batch.context_lens)):
        start, end = batch.query_start[i], batch.query_start[i + 1]
        context_len = batch.context_lens[i]
        num_blocks = -(-context_len // block_size)
        table = batch.block_tables[i, :num_blocks]
        k = gather_blocks(k_cache, table)[:context_len]
        v = gather_blocks(v_cache, table)[:context_len]
        num_queries = end - start
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        out[start:end] = _attend(
            q[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), mask[None, None], scale,
        )[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                      scale: float, sliding_window: int | None) -> torch.Tensor:
    """One query per sequence. Sequences are attended in groups of similar context length, so the
    keys gathered out of the paged pool are padded to the group's longest, not the batch's."""
    lens = batch.context_lens[: batch.num_decode]
    out = torch.empty_like(q)
    for rows in decode_groups(lens):
        index = torch.tensor(rows, device=q.device)
        out[index] = _decode_group(q[index], k_cache, v_cache, batch.block_tables[index],
                                   batch.decode_context_lens[index], max(lens[r] for r in rows), scale, sliding_window)
    return out


# A decode group holds at most DECODE_GROUP sequences, and a sequence joins the group of the
# shorter ones before it only while that pads the group's keys by at most DECODE_PAD_TOKENS: one
# more group costs about as much as gathering and attending that many padded keys on a CPU, while
# padding a batch of short chats to one 1,500-token document made a decode step several times
# slower.
DECODE_GROUP = 8
DECODE_PAD_TOKENS = 512


def decode_groups(context_lens: list[int]) -> list[list[int]]:
    """Rows of the decode sequences, grouped by context length (shortest first)."""
    groups: list[list[int]] = []
    for row in sorted(range(len(context_lens)), key=context_lens.__getitem__):
        group = groups[-1] if groups else None
        if group is not None and len(group) < DECODE_GROUP:
            padding = len(group) * (context_lens[row] - context_lens[group[-1]])
            if padding <= DECODE_PAD_TOKENS:
                group.append(row)
                continue
        groups.append([row])
    return groups


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  context_lens: torch.Tensor, max_len: int, scale: float, sliding_window: int | None) -> torch.Tensor:
    block_size = k_cache.shape[1]
    tables = tables[:, : -(-max_len // block_size)]
    k = gather_blocks(k_cache, tables.flatten()).view(tables.shape[0], -1, *k_cache.shape[2:])  # [B, L, Hkv, D]
    v = gather_blocks(v_cache, tables.flatten()).view(tables.shape[0], -1, *v_cache.shape[2:])
    key_pos = torch.arange(k.shape[1], device=q.device)
    mask = key_pos[None, :] < context_lens[:, None]
    if sliding_window:
        mask &= key_pos[None, :] > (context_lens[:, None] - 1 - sliding_window)
    out = _attend(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale)
    return out.squeeze(2)

def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Mixture-of-experts MLP: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x [T, hidden]; topk_weights [T, k] float32; topk_ids [T, k] int64 in [0, E); gate_up
    [E, 2 * inter, hidden] (gate rows first); down [E, hidden, inter]. One stable sort groups the
    T * k (token, expert) pairs by expert, so each expert that received tokens runs one pair of
    matmuls over all of them, however unevenly they are spread; an expert with none costs nothing.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, order // top_k)
    expert_out = torch.empty((num_tokens * top_k, down.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            activated = silu_and_mul(rows[start:end] @ gate_up[expert].T)
            torch.matmul(activated, down[expert].T, out=expert_out[start:end])
            start = end
    # Back to (token, slot) order, then the router-weighted sum over each token's k experts.
    per_slot = torch.empty_like(expert_out).index_copy_(0, order, expert_out).view(num_tokens, top_k, -1)
    return torch.bmm(topk_weights.unsqueeze(1), per_slot.float()).squeeze(1).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm of the sum; returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


# -- kernel selection --------------------------------------------------------------------------


def for_device(device: torch.device):
    """The module whose hot ops (the functions above) the model calls on `device`.

    On CUDA with triton installed: engine.kernels.ops, the same signatures on Triton kernels.
    Anywhere else: this module. Chosen once when the model is built, so a CPU step pays nothing
    per call and never imports triton.
    """
    if torch.device(device).type == "cuda":
        from engine import kernels
        if kernels.available():
            from engine.kernels import ops as kernel_ops
            return kernel_ops
    return sys.modules[__name__]
