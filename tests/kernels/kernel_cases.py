"""Shared by the kernel tests: the device, random paged-KV batches, and dtype-aware tolerances."""

from __future__ import annotations

import torch

from engine.ops import AttentionBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_batch(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, device: torch.device):
    """q [T, H, D], a filled K/V pool [num_blocks, block_size, Hkv, D] each, and the AttentionBatch.

    Sequences with query length 1 must come first (the engine's decode-first order). Blocks are
    handed out in a shuffled order so a wrong block-table lookup cannot pass by accident.
    """
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks).tolist()
    tables = torch.zeros((len(context_lens), max(blocks_per_seq)), dtype=torch.int64)
    for i, count in enumerate(blocks_per_seq):
        tables[i, :count] = torch.tensor([pool.pop() for _ in range(count)])
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)
    query_start = [0]
    slots = []
    for i, (nq, ctx) in enumerate(zip(query_lens, context_lens)):
        query_start.append(query_start[-1] + nq)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - nq, ctx)]
    num_decode = next((i for i, nq in enumerate(query_lens) if nq != 1), len(query_lens))
    batch = AttentionBatch(
        num_decode=num_decode,
        query_start=query_start,
        context_lens=list(context_lens),
        block_tables=tables.to(device),
        decode_context_lens=torch.tensor(context_lens[:num_decode], dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    q = torch.randn(query_start[-1], num_heads, head_dim).to(dtype).to(device)
    return q, k_cache, v_cache, batch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative error bound of the dtype: fp32 accumulation-order noise, or bf16's 8-bit mantissa."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
