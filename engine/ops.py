"""The model's hot ops in plain torch: RMSNorm (and Cohere's LayerNorm, StarCoder2's with a bias), rotary embedding,
KV-cache write, paged attention.

Each op is one function with a fixed signature so a faster kernel (engine/kernels) can replace it
on CUDA while this version stays the reference and the CPU path.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import cpu_attention, cpu_matmul
from engine.config import RopeConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in x's dtype (as the reference implementations do).

    The weight's dtype says where the rounding falls: a weight in the model's dtype multiplies the row
    already rounded to it (Llama and most families); a float32 weight (Gemma 3's 1 + weight, stored so
    by the loader) multiplies the float32 row, rounded after."""
    orig_dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (x32 * weight).to(orig_dtype)
    return weight * x32.to(orig_dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm: the row's mean subtracted, then divided by its standard deviation, in float32, times
    the weight (no bias), returned in x's dtype; the weight's dtype says where the rounding falls, as in rms_norm."""
    orig_dtype = x.dtype
    x32 = x.float()
    centered = x32 - x32.mean(-1, keepdim=True)
    x32 = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (x32 * weight).to(orig_dtype)
    return weight * x32.to(orig_dtype)


def biased_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """StarCoder2's LayerNorm: layer_norm's, plus a bias, computed as torch's layer_norm (in float32 for every dtype,
    rounded once after the bias), as transformers computes it."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times up: Gemma 3's MLP activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation over a fused gate/up projection (gate columns first): the gate clamped to at most
    limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), in the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh(up: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation) of an ungated projection: StarCoder2's MLP activation."""
    return F.gelu(up, approximate="tanh")


def relu_squared(up: torch.Tensor) -> torch.Tensor:
    """ReLU(up) squared, of an ungated projection: Nemotron's and Arcee's MLP activation."""
    return torch.square(F.relu(up))


def xielu(up: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """xIELU of an ungated projection (Apertus), by one layer's learned parameters in up's dtype: params holds
    (softplus(alpha_p), beta + softplus(alpha_n), beta, eps), which the loader computed from the stored ones.
    Positive inputs give alpha_p x^2 + beta x, the others (expm1(min(x, eps)) - x) alpha_n + beta x, computed in up's
    dtype as transformers computes it."""
    alpha_p, alpha_n, beta, eps = params
    return torch.where(up > 0, alpha_p * up * up + beta * up,
                       (torch.expm1(torch.minimum(up, eps)) - up) * alpha_n + beta * up)


# hidden_act -> the name of the op applying it to a fused gate/up projection (here and in engine.kernels.ops)
ACT_AND_MUL = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}
# ... and to an ungated one (ModelConfig.gated_mlp false); xielu also takes its layer's parameters
# (LayerWeights.act_params)
ACT = {"gelu_pytorch_tanh": "gelu_tanh", "relu2": "relu_squared", "xielu": "xielu"}


# A CPU matmul with this many rows or fewer runs on one thread whatever torch's thread count, so
# a decode step with a small batch is bound by one core streaming the weights from memory.
LINEAR_SPLIT_ROWS = 32
# Below this many weight elements (1 MiB of float32) a slab streams in well under 100 us and handing
# half of it to another thread costs more than it saves.
LINEAR_SPLIT_MIN_ELEMENTS = 1 << 18


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight [out, in].T (+ bias [out]).

    In bfloat16 or float16 the bias joins the float32 products before their one rounding to x's dtype, as
    torch.nn.functional.linear adds it (added after, each biased projection would be rounded twice); in float32 the
    product is already float32 and the bias is added after it, the sum the engine always computed.

    On a CPU, up to 16 rows against a large float32 weight go to the C loop (engine.cpu_matmul). Where
    it is not built or does not take the shapes, with several threads, few rows and a large weight, the
    weight's rows are cut into one
    slab per thread and multiplied as one batched matmul, which torch spreads over its threads: a
    small-batch decode step then streams its weights on every core (about 1.5x less time per matmul
    on 2 cores at 1-4 rows; no loss up to 32 rows, where torch's own threading takes over).
    """
    if cpu_matmul.takes(x, weight, bias):
        return cpu_matmul.matmul(x, weight, bias)
    if bias is not None and x.dtype == torch.float32:
        return linear(x, weight) + bias
    rows, num_threads = x.shape[0], torch.get_num_threads()
    if (rows > LINEAR_SPLIT_ROWS or num_threads == 1 or x.device.type != "cpu"
            or weight.numel() < LINEAR_SPLIT_MIN_ELEMENTS or weight.shape[0] % num_threads):
        return x @ weight.T if bias is None else F.linear(x, weight, bias)
    slabs = weight.view(num_threads, weight.shape[0] // num_threads, weight.shape[1]).transpose(1, 2)
    if bias is None:
        out = torch.matmul(x, slabs)
    else:   # each slab's bias rows join its products before the rounding, as F.linear adds them
        out = torch.baddbmm(bias.view(num_threads, 1, -1), x.expand(num_threads, *x.shape), slabs)
    return out.transpose(0, 1).reshape(rows, weight.shape[0])


def rope_inv_freq(head_dim: int, rope: RopeConfig, max_model_len: int) -> torch.Tensor:
    """Inverse frequencies of the rotary dims (head_dim: those that rotate, all of a head's or its first part)
    for an engine serving sequences of up to max_model_len tokens (only longrope's depend on it)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if rope.rope_type == "longrope":   # the factors divide the frequencies, as transformers computes them
        factors = rope.long_factor if rope.uses_long_factor(max_model_len) else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** exponents)
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope)
    if rope.rope_type == "linear":   # positions divided by factor, which is every frequency divided by it
        return inv_freq / rope.factor
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


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """yarn: original frequencies for the dims that rotate fast over the original context (more
    than beta_fast turns), interpolated ones (divided by factor) for those that rotate slowly
    (fewer than beta_slow), a linear blend between."""
    def dim_of(rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def rope_cos_sin(head_dim: int, rope: RopeConfig, max_positions: int, device,
                 max_model_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim] in float32 (halves duplicated, rotate-half layout;
    times yarn's or longrope's attention factor). head_dim: the rotary dims of a head; max_model_len: the
    longest sequence the engine serves (default max_positions), which picks longrope's factors."""
    inv_freq = rope_inv_freq(head_dim, rope, max_model_len or max_positions)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope.attention_factor if rope.rope_type in ("yarn", "longrope") else 1.0
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by their token positions [T]. Tables narrower than D (partial
    rotary: [max_positions, R]) rotate each head's first R dims and pass the others through."""
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    rotary_dim = cos_table.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x[..., :rotary_dim].float()
        half = rotary_dim // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        out = (x32 * cos + rotated * sin).to(x.dtype)
        return out if rotary_dim == x.shape[-1] else torch.cat((out, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at flat cache slots [T] (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


@dataclass(slots=True)
class AttentionBatch:
    """Where each sequence's queries sit in the flat token batch and where its keys sit in the cache.

    Decode sequences (one query each) come first; the kernels attend them in one batched call and
    each other sequence on its own.
    """

    num_decode: int                  # the first num_decode sequences have exactly one query
    query_start: list[int]           # per sequence, its first row in the flat batch (+ total at the end)
    context_lens: list[int]          # per sequence, tokens in cache after this step (cached + new)
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decode] int64 on the model's device
    slot_mapping: torch.Tensor       # [num_tokens] int64: cache slot of each new token
    # The CPU path's attention groups, planned by the first layer and reused by the others.
    cpu_plan: CPUAttentionPlan | None = None


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Tokens of the given blocks, in order: [len(block_ids) * block_size, Hkv, D].

    index_select, not advanced indexing: on CPU the latter is about ten times slower here.
    """
    return cache.index_select(0, block_ids).flatten(0, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
                    scale: float, sliding_window: int | None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's cached keys; returns [T, H, Dv].

    k_cache/v_cache are one layer's pool [num_blocks, block_size, Hkv, D] and [..., Dv]; the new
    tokens' keys must already be written (write_kv) so a sequence's keys are exactly its cache prefix.
    Values may be narrower than keys and a view into them (multi-head latent attention: the values
    are the first dims of the cached latent).

    Decode sequences (one query each) are attended in place by the C loop (engine.cpu_attention)
    where it is built and takes the shapes. Other sequences with few queries (speculative
    verification; decode without the C loop) are attended in groups of similar context length, one
    gather and one attention call per group; longer prefill chunks one by one. The plan is made once
    per step (every layer attends the same sequences).

    sliding_window: the last that many keys each query sees, or, negative, chunked attention (Llama 4): the keys of
    its own chunk of -sliding_window tokens up to it (window_start); None: all keys up to it.
    sinks [H] float32 (gpt-oss): each head's learned logit, one more term in its softmax's denominator that
    weighs no value (transformers appends it to the scaled, masked scores and drops its column after).
    softcap (Gemma 2): each scaled score becomes softcap * tanh(score / softcap) before the mask and softmax.
    """
    if batch.cpu_plan is None:
        batch.cpu_plan = plan_attention(batch, k_cache.shape[1], q.device, cpu_attention.supports(q, k_cache, v_cache))
    out = q.new_empty((*q.shape[:2], v_cache.shape[-1]))
    if batch.cpu_plan.native_decode:
        n = batch.num_decode
        out[:n] = cpu_attention.decode(q[:n], k_cache, v_cache, batch.block_tables[:n], batch.decode_context_lens,
                                       batch.cpu_plan.num_decode_keys, scale, sliding_window, sinks, softcap)
    for group in batch.cpu_plan.groups:
        out.index_copy_(0, group.rows, _attend_group(q, k_cache, v_cache, group, scale, sliding_window, sinks,
                                                     softcap))
    for i in batch.cpu_plan.chunks:
        start, end = batch.query_start[i], batch.query_start[i + 1]
        out[start:end] = _attend_chunk(q[start:end], k_cache, v_cache, batch.block_tables[i], batch.context_lens[i],
                                       scale, sliding_window, sinks, softcap)
    return out


def window_start(query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """The first key each query position sees under a layer's window (ModelConfig.sliding_windows): the last
    `window` tokens' first, or under chunked attention (a negative window, Llama 4) its own chunk's first."""
    if window > 0:
        return query_pos - window + 1
    return torch.div(query_pos, -window, rounding_mode="floor") * -window


# Sequences with at most this many queries in a step are attended in groups.
GROUPED_QUERIES_MAX = 16
# A group holds at most DECODE_GROUP sequences, and a sequence joins the group of the shorter ones
# before it only while that pads the group's keys by at most DECODE_PAD_TOKENS: one more group
# costs about as much as gathering and attending that many padded keys on a CPU, while padding a
# batch of short chats to one 1,500-token document made a decode step several times slower.
DECODE_GROUP = 8
DECODE_PAD_TOKENS = 512


@dataclass(slots=True)
class AttentionGroup:
    """Sequences with the same number of queries, attended together over their padded keys."""

    rows: torch.Tensor            # [size * num_queries] the queries' rows in the flat batch, by sequence
    block_ids: torch.Tensor       # [size * num_blocks] the sequences' block tables, cut to the longest
    query_pos: torch.Tensor       # [size, num_queries] position of each query
    size: int
    num_queries: int
    masks: dict = field(default_factory=dict)  # sliding window -> additive mask [size, 1, Q, L]

    def mask(self, num_keys: int, sliding_window: int | None) -> torch.Tensor:
        mask = self.masks.get(sliding_window)
        if mask is None:
            key_pos = torch.arange(num_keys, device=self.query_pos.device)
            hidden = key_pos > self.query_pos[..., None]
            if sliding_window:
                hidden |= key_pos < window_start(self.query_pos[..., None], sliding_window)
            mask = torch.zeros(hidden.shape, device=hidden.device).masked_fill_(hidden, float("-inf")).unsqueeze(1)
            self.masks[sliding_window] = mask
        return mask


@dataclass(slots=True)
class CPUAttentionPlan:
    groups: list[AttentionGroup]
    chunks: list[int]             # sequences attended one by one (long prefill chunks)
    native_decode: bool = False   # the decode sequences go to engine.cpu_attention, not to groups
    num_decode_keys: int = 0      # their keys in all (how many threads the C loop's work is worth)


def plan_attention(batch: AttentionBatch, block_size: int, device, native_decode: bool = False) -> CPUAttentionPlan:
    num_queries = [end - start for start, end in zip(batch.query_start, batch.query_start[1:])]
    native_decode = native_decode and batch.num_decode > 0
    first = batch.num_decode if native_decode else 0
    short = [i for i, n in enumerate(num_queries) if n <= GROUPED_QUERIES_MAX and i >= first]
    groups = []
    for members in decode_groups([batch.context_lens[i] for i in short], [num_queries[i] for i in short]):
        seqs = [short[m] for m in members]
        count, longest = num_queries[seqs[0]], max(batch.context_lens[i] for i in seqs)
        rows = [batch.query_start[i] + j for i in seqs for j in range(count)]
        query_pos = [[batch.context_lens[i] - count + j for j in range(count)] for i in seqs]
        tables = batch.block_tables[torch.tensor(seqs, device=batch.block_tables.device)]
        groups.append(AttentionGroup(
            rows=torch.tensor(rows, device=device),
            block_ids=tables[:, : -(-longest // block_size)].flatten(),
            query_pos=torch.tensor(query_pos, device=device),
            size=len(seqs), num_queries=count))
    chunks = [i for i, n in enumerate(num_queries) if n > GROUPED_QUERIES_MAX]
    num_decode_keys = sum(batch.context_lens[:batch.num_decode]) if native_decode else 0
    return CPUAttentionPlan(groups, chunks, native_decode, num_decode_keys)


def decode_groups(context_lens: list[int], num_queries: list[int] | None = None) -> list[list[int]]:
    """Indices into context_lens, grouped: the same number of queries, similar context lengths
    (shortest first), at most DECODE_GROUP each."""
    num_queries = num_queries or [1] * len(context_lens)
    groups: list[list[int]] = []
    for row in sorted(range(len(context_lens)), key=lambda r: (num_queries[r], context_lens[r])):
        group = groups[-1] if groups else None
        if group is not None and len(group) < DECODE_GROUP and num_queries[group[-1]] == num_queries[row]:
            padding = len(group) * (context_lens[row] - context_lens[group[-1]])
            if padding <= DECODE_PAD_TOKENS:
                group.append(row)
                continue
        groups.append([row])
    return groups


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                  scale: float, sliding_window: int | None, sinks: torch.Tensor | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """The group's outputs [size * Q, H, Dv], in the order of group.rows."""
    size, count = group.size, group.num_queries
    num_heads, head_dim, num_kv_heads, value_dim = q.shape[1], q.shape[2], k_cache.shape[2], v_cache.shape[3]
    queries = q.index_select(0, group.rows).view(size, count, num_heads, head_dim).transpose(1, 2)
    k = k_cache.index_select(0, group.block_ids).view(size, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, group.block_ids).view(size, -1, num_kv_heads, value_dim).transpose(1, 2)
    mask = group.mask(k.shape[2], sliding_window)
    out = _attention(queries, k, v, mask, scale, sinks, softcap)
    return out.transpose(1, 2).reshape(size * count, num_heads, value_dim)


def _attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                  context_len: int, scale: float, sliding_window: int | None,
                  sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One sequence's queries q [Q, H, D] (its last Q positions) over its first context_len keys; [Q, H, Dv]."""
    block_size, num_queries = k_cache.shape[1], q.shape[0]
    table = table[: -(-context_len // block_size)]
    k = gather_blocks(k_cache, table)[:context_len].transpose(0, 1).unsqueeze(0)
    v = gather_blocks(v_cache, table)[:context_len].transpose(0, 1).unsqueeze(0)
    q = q.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    plain = sinks is None and softcap is None
    if num_queries == context_len and not (sliding_window and abs(sliding_window) < context_len) and plain:
        # A whole prompt in one chunk: plain causal attention, no mask to build (and the upper
        # triangle is skipped rather than masked).
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_pos = torch.arange(context_len - num_queries, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window:
            mask &= key_pos[None, :] >= window_start(query_pos[:, None], sliding_window)
        out = _attention(q, k, v, mask[None, None], scale, sinks, softcap)
    return out[0].transpose(0, 1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               sinks: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over k, v [B, Hkv, L, D] under mask (boolean: visible, or additive), [B, H, Q, Dv]. With sinks
    or softcap, the softmax is written out: scaled scores, soft-capped (softcap * tanh(score / softcap)), masked,
    each head's sink appended as one more logit, its weight dropped after the softmax (scaled_dot_product_attention
    has neither)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Mixture-of-experts MLP: out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x [T, hidden]; topk_weights [T, k] float32; topk_ids [T, k] int64 in [0, E); gate_up
    [E, 2 * inter, hidden] (gate rows first); down [E, hidden, inter]. gpt-oss's experts also add
    gate_up_bias [E, 2 * inter] and down_bias [E, hidden] and activate by clamped_swiglu(*swiglu)
    (None: SiLU(gate) * up). One stable sort groups the T * k (token, expert) pairs by expert, so each expert that received tokens runs one pair of
    matmuls over all of them, however unevenly they are spread; an expert with none costs nothing.
    In a decode step an expert gets a few rows: `linear` spreads such a matmul over the threads.
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
            gate_up_out = linear(rows[start:end], gate_up[expert])
            if gate_up_bias is not None:
                gate_up_out += gate_up_bias[expert]
            activated = silu_and_mul(gate_up_out) if swiglu is None else clamped_swiglu(gate_up_out, *swiglu)
            expert_out[start:end] = linear(activated, down[expert])
            if down_bias is not None:
                expert_out[start:end] += down_bias[expert]
            start = end
    # Back to (token, slot) order, then the router-weighted sum over each token's k experts.
    per_slot = torch.empty_like(expert_out).index_copy_(0, order, expert_out).view(num_tokens, top_k, down.shape[1])
    return torch.bmm(topk_weights.unsqueeze(1), per_slot.float()).squeeze(1).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm of the sum; returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then layer_norm of the sum; returns (normed, new residual)."""
    residual = residual + x
    return layer_norm(residual, weight, eps), residual


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
