"""The mixture-of-experts MLP block (Mixtral, Qwen3-MoE): route each token to its top-k experts, run
the experts, combine with the router's weights.

Routing is a softmax over the router's logits in float32 and a top-k (renormalized when the model
says so), as the reference implementations do. The expert compute is `ops.fused_moe`: the torch
version groups tokens by expert with one sort (engine.ops), the Triton kernel on CUDA is its twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MoEWeights:
    router: torch.Tensor     # [num_experts, hidden]
    gate_up: torch.Tensor    # [num_experts, 2 * inter, hidden], gate rows first
    down: torch.Tensor       # [num_experts, hidden, inter]
    top_k: int
    normalize: bool          # renormalize the top-k probabilities to sum to 1


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts."""
    probs = torch.softmax((x @ router.T).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_forward(moe: MoEWeights, x: torch.Tensor, ops) -> torch.Tensor:
    """The block's output [T, hidden] for normed hidden states x [T, hidden]."""
    weights, ids = route(x, moe.router, moe.top_k, moe.normalize)
    return ops.fused_moe(x, weights, ids, moe.gate_up, moe.down)
