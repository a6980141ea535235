"""Decode attention on the CPU in C (cpu_attention.c): one query per sequence, over its keys where the
paged cache holds them.

Why C. The torch path (ops._attend_group) gathers each group's blocks into a contiguous copy and
hands it to scaled_dot_product_attention: every key and value is read, written, and read again. The
C loop reads each once, where the cache holds it, a contiguous run of a row's KV heads at a time, with
the softmax done online. Measured on the project's 2-core AMD EPYC (benchmarks/cpu_attention.py, quiet):
2.9-5.3x faster than the torch path per call, and a whole benchmark run of the engine 11% (dense) and
13% (MoE) shorter (benchmarks/RESULTS.md, "Decode attention in C").

The items (a sequence's run of KV heads) are shared out over torch's own OpenMP threads
(cpu_attention.c says how), with the GIL released. The extension is built by the editable install
(pyproject.toml, optional); where it is missing, or for shapes it does not take (not float32, more
than 32 query heads per KV head, head_dim over 256), ops.paged_attention keeps the torch path.
"""

from __future__ import annotations

import logging

import torch

try:
    from engine import _cpu_attention
    MISSING = ""
except ImportError as exc:  # not built: the torch path attends every sequence
    _cpu_attention = None
    MISSING = str(exc)

log = logging.getLogger(__name__)
_fallback_logged = False

MAX_GROUP = 32
MAX_HEAD_DIM = 256
# Below this many keys in all (over the step's decode sequences) waking a second thread costs more
# than it saves.
MIN_KEYS_PER_THREAD = 1024


def available() -> bool:
    return _cpu_attention is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether decode() takes these: float32 on the CPU, the head sizes the C loop is built for, keys and
    values of one shape, each its own contiguous pool (not values that are a view of the keys)."""
    global _fallback_logged
    if MISSING and not _fallback_logged:
        _fallback_logged = True
        log.warning("the C decode attention is not built (%s): the CPU attends decode steps with the torch path, "
                    "about half as fast; reinstall with a C compiler (pip install -e .)", MISSING)
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    return (_cpu_attention is not None and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and q.shape[2] == k_cache.shape[3]
            and v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous())


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor, num_keys: int, scale: float, sliding_window: int | None,
           sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q [S, H, D] (each sequence's last position) over its first context_lens[s] keys in the
    cache [num_blocks, block_size, Hkv, D]; returns [S, H, D]. num_keys: the sum of context_lens (how
    many threads the work is worth); sliding_window: the last that many keys, or negative, the query's own chunk of
    -sliding_window keys (chunked attention); sinks: [H] per-head logits in the softmax's denominator (gpt-oss);
    softcap: each scaled score becomes softcap * tanh(score / softcap) (Gemma 2)."""
    q = q.contiguous()
    tables = block_tables.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    threads = max(1, min(torch.get_num_threads(), num_keys // MIN_KEYS_PER_THREAD))
    _cpu_attention.decode(q.numpy(), k_cache.numpy(), v_cache.numpy(), tables.numpy(), context_lens.numpy(),
                          out.numpy(), num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], tables.shape[1],
                          sliding_window or 0, scale, 0, num_seqs, threads,
                          None if sinks is None else sinks.float().contiguous().numpy(), softcap or 0.0)
    return out
