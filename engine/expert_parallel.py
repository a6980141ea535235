"""Expert parallelism: a mixture-of-experts layer's experts split across the ranks of a group, each
token's rows sent to the ranks that own its experts and the results brought back.

Every rank of the group holds the same tokens when the MoE block starts (attention is replicated
across the group, or tensor-parallel and already all-reduced). The block then runs in five
collectives over the group, all sized by the batch, never by the expert count:

1. Each rank takes its contiguous slice of the tokens and routes it (engine.moe.select_experts).
   Its (token, expert) pairs are sorted by owning rank; the counts per owner go out first
   (all-to-all of one integer per rank) so every rank knows how many rows it will receive.
2. The pairs' hidden rows and their experts' local ids go to the owners (two all-to-alls).
3. Each owner runs its experts on what it received with `ops.fused_moe` (the grouped path of one
   device; the Triton kernel on CUDA) and sends the rows back (all-to-all).
4. Each rank puts its rows back in (token, slot) order and sums them with the router weights,
   exactly as one device combines them, adds its tokens' shared experts (DeepSeek-V3: every rank
   holds them whole); an all-gather gives every rank the block's whole output.

A skewed batch (every token on one expert) only makes one owner's receive larger: the counts say
so before any row moves. Ranks hold experts in contiguous runs: rank r owns experts
[r * E / n, (r + 1) * E / n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.moe import MoEWeights, run_experts, select_experts, shared_experts
from engine.parallel import timing
from engine.parallel.layout import expert_range


@dataclass(slots=True)
class ExpertGroup:
    """The ranks sharing a stage's experts (a torch.distributed process group) and this rank's place in it."""

    group: dist.ProcessGroup
    rank: int
    size: int
    num_experts: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def local_experts(self) -> range:
        return expert_range(self.num_experts, self.size, self.rank)


def _all_to_all(group: dist.ProcessGroup, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    with timing.comm():
        group.alltoall_base(out, rows.contiguous(), receive, send, dist.AllToAllOptions()).wait()
    return out


def moe_forward_parallel(moe: MoEWeights, x: torch.Tensor, experts: ExpertGroup, ops) -> torch.Tensor:
    """The MoE block's output [T, hidden] for normed hidden states x [T, hidden] (the same on every
    rank of the group), with this rank holding only its experts (moe.gate_up/down: [E / n, ...])."""
    group, size = experts.group, experts.size
    num_tokens, hidden = x.shape
    per_rank = -(-num_tokens // size)
    first, last = min(num_tokens, experts.rank * per_rank), min(num_tokens, (experts.rank + 1) * per_rank)
    mine = x[first:last]
    weights, ids = select_experts(moe, mine)
    flat_ids = ids.flatten()
    owners = flat_ids // experts.experts_per_rank
    order = owners.argsort(stable=True)
    send = torch.bincount(owners, minlength=size)
    receive = _all_to_all(group, send, [1] * size, [1] * size)
    send_sizes, receive_sizes = send.tolist(), receive.tolist()

    rows = mine.index_select(0, order // moe.top_k)
    if moe.weighs_input:   # Llama 4: each expert takes its row times the pair's weight; the outputs add up unweighted
        rows = rows * weights.flatten()[order].to(rows.dtype)[:, None]
        weights = torch.ones_like(weights)
    rows = _all_to_all(group, rows, send_sizes, receive_sizes)
    local_ids = _all_to_all(group, (flat_ids - owners * experts.experts_per_rank)[order], send_sizes, receive_sizes)
    unweighted = torch.ones((rows.shape[0], 1), dtype=torch.float32, device=x.device)
    expert_out = run_experts(moe, rows, unweighted, local_ids[:, None], ops)
    returned = _all_to_all(group, expert_out, receive_sizes, send_sizes)

    per_slot = torch.empty_like(returned).index_copy_(0, order, returned).view(last - first, moe.top_k, hidden)
    combined = torch.bmm(weights.unsqueeze(1), per_slot.float()).squeeze(1).to(x.dtype)
    shared = shared_experts(moe, mine, ops)   # every rank holds the shared experts: each runs its tokens'
    if shared is not None:
        combined = combined + shared
    padded = x.new_zeros((per_rank, hidden))
    padded[: last - first] = combined
    gathered = x.new_empty((size * per_rank, hidden))
    with timing.comm():
        group._allgather_base(gathered, padded).wait()
    return gathered[:num_tokens]
