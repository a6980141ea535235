"""The mixture-of-experts MLP block (Mixtral, Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss): route each token to its top-k
experts, run the experts, combine with the router's weights, add the shared experts if any.

Routing is computed as the reference implementations compute it, in one of three ways:
- softmax over the router's logits in float32 and a top-k (renormalized when the model says so): Mixtral, Qwen3-MoE;
- DeepSeek-V3's grouped routing (`route_grouped`, GLM-4.5's too): sigmoid scores, a per-expert correction bias that
  steers the choice but not the weights, the choice restricted to the best groups of experts, and
  weights that are the chosen sigmoid scores (renormalized when the model says so) times a scaling factor.
- gpt-oss's (`route_topk_softmax`): a biased router, the top-k logits, a softmax over those k; its experts
  carry biases and activate by a clamped SwiGLU (engine.ops.clamped_swiglu).
All are whole-batch tensor ops. The expert compute is `ops.fused_moe`: the torch version groups
tokens by expert with one sort (engine.ops), the Triton kernel on CUDA is its twin. Shared experts
are a dense MLP every token takes, added to the routed output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import MoEConfig


@dataclass(slots=True)
class MoEWeights:
    router: torch.Tensor     # [num_experts, hidden]
    gate_up: torch.Tensor    # [num_experts, 2 * inter, hidden], gate rows first
    down: torch.Tensor       # [num_experts, hidden, inter]
    top_k: int
    normalize: bool          # renormalize the top-k probabilities to sum to 1
    # DeepSeek-V3 (grouped routing, shared experts); None for softmax routing and no shared experts
    grouped_routing: MoEConfig | None = None   # the model's groups, top-k and scaling
    correction_bias: torch.Tensor | None = None   # [num_experts] float32, added to the scores for the choice only
    shared_gate_up: torch.Tensor | None = None    # [2 * shared inter, hidden]
    shared_down: torch.Tensor | None = None       # [hidden, shared inter]
    # gpt-oss: the router's bias (softmax over the top-k biased logits), the experts' biases, the clamped SwiGLU
    router_bias: torch.Tensor | None = None       # [num_experts]
    gate_up_bias: torch.Tensor | None = None      # [num_experts, 2 * inter], gate first
    down_bias: torch.Tensor | None = None         # [num_experts, hidden]
    swiglu: tuple[float, float] | None = None     # (alpha, limit): engine.ops.clamped_swiglu; None: SiLU(gate) * up


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts."""
    probs = torch.softmax((x @ router.T).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor,
                  cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: (weights [T, k] float32, expert ids [T, k] int64).

    A group of experts scores by the sum of its best two biased scores; each token picks its
    topk_groups best groups, then its top-k biased scores among their experts."""
    num_tokens = x.shape[0]
    scores = torch.sigmoid(x.float() @ router.float().T)
    biased = scores + correction_bias
    # explicit sizes: under expert parallelism a rank's slice of the batch may hold no token
    grouped = biased.view(num_tokens, cfg.num_groups, cfg.num_experts // cfg.num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(cfg.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, cfg.num_experts)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def route_topk_softmax(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k of the biased logits, weighted by a softmax over those k alone, computed in
    x's dtype as the reference computes it (weights returned in float32)."""
    logits = torch.nn.functional.linear(x, router, bias)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1).float(), ids


def select_experts(moe: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's routing of x: (weights [T, k] float32, expert ids [T, k] int64)."""
    if moe.grouped_routing is not None:
        return route_grouped(x, moe.router, moe.correction_bias, moe.grouped_routing)
    if moe.router_bias is not None:
        return route_topk_softmax(x, moe.router, moe.router_bias, moe.top_k)
    return route(x, moe.router, moe.top_k, moe.normalize)


def run_experts(moe: MoEWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
    """ops.fused_moe over the block's experts (ids index the experts it holds), with their biases and activation."""
    if moe.gate_up_bias is None and moe.swiglu is None:
        return ops.fused_moe(x, weights, ids, moe.gate_up, moe.down)
    return ops.fused_moe(x, weights, ids, moe.gate_up, moe.down, moe.gate_up_bias, moe.down_bias, moe.swiglu)


def shared_experts(moe: MoEWeights, x: torch.Tensor, ops) -> torch.Tensor | None:
    """The shared experts' output [T, hidden] for x, None when the block has none."""
    if moe.shared_gate_up is None:
        return None
    return ops.linear(ops.silu_and_mul(ops.linear(x, moe.shared_gate_up)), moe.shared_down)


def moe_forward(moe: MoEWeights, x: torch.Tensor, ops) -> torch.Tensor:
    """The block's output [T, hidden] for normed hidden states x [T, hidden]."""
    weights, ids = select_experts(moe, x)
    out = run_experts(moe, x, weights, ids, ops)
    shared = shared_experts(moe, x, ops)
    return out if shared is None else out + shared
