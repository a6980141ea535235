"""The mixture-of-experts MLP block (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V2 and V3, GLM-4.5, GLM-4.7-Flash,
ERNIE 4.5, MiniMax-M2, dots.llm1, K-EXAONE, Solar Open, gpt-oss, Granite MoE, Llama 4, Trinity): route each token to its
top-k experts, run the experts, combine with the router's weights, add the shared experts if any.

Routing is computed as the reference implementations compute it, in one of four ways:
- softmax over the router's logits in float32 and a top-k (renormalized when the model says so): Mixtral, Qwen3-MoE,
  Qwen2-MoE, OLMoE; Granite MoE's softmax over its top-k logits alone is the same renormalized top-k;
- DeepSeek's grouped routing (`route_grouped`): DeepSeek-V3's (GLM-4.5's, dots.llm1's, K-EXAONE's, Solar Open's
  too) sigmoid scores, a per-expert correction bias that steers the choice but not the weights, the choice
  restricted to the best groups of experts, and weights that are the chosen sigmoid scores (renormalized when the
  model says so) times a scaling factor;
  DeepSeek-V2's the same over softmax scores, with no bias, groups ranked by their best score, and no renormalizing;
  Mistral 4's over softmax scores, with no bias, groups ranked by their best two;
  ERNIE 4.5's over softmax scores with a correction bias, in one group, renormalized, unscaled (Hunyuan-A13B's the
  same without the bias); MiniMax-M2's over sigmoid scores with a correction bias, in one group, renormalized,
  unscaled, its logits in the model's dtype (Trinity's the same, scaled by its route_scale).
- gpt-oss's (`route_topk_softmax`): a biased router, the top-k logits, a softmax over those k; its experts
  carry biases and activate by a clamped SwiGLU (engine.ops.clamped_swiglu).
- Llama 4's (`route_sigmoid_topk`): the top-k logits, each expert's weight its logit's sigmoid, applied to the
  expert's input rather than its output (`run_experts_on_weighted_inputs`).
All are whole-batch tensor ops. The expert compute is `ops.fused_moe`: the torch version groups
tokens by expert with one sort (engine.ops), the Triton kernel on CUDA is its twin. Shared experts
are a dense MLP every token takes, added to the routed output (Qwen2-MoE's weighed by a gate of their own).
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
    # DeepSeek (grouped routing, shared experts); None for softmax routing and no shared experts
    grouped_routing: MoEConfig | None = None   # the model's scoring, groups, top-k and scaling
    correction_bias: torch.Tensor | None = None   # [num_experts] float32, added to the scores for the choice only (V3)
    shared_gate_up: torch.Tensor | None = None    # [2 * shared inter, hidden]
    shared_down: torch.Tensor | None = None       # [hidden, shared inter]
    shared_gate: torch.Tensor | None = None       # [1, hidden]: Qwen2-MoE's, the shared output times sigmoid(x @ it)
    # gpt-oss: the router's bias (softmax over the top-k biased logits), the experts' biases, the clamped SwiGLU
    router_bias: torch.Tensor | None = None       # [num_experts]
    gate_up_bias: torch.Tensor | None = None      # [num_experts, 2 * inter], gate first
    down_bias: torch.Tensor | None = None         # [num_experts, hidden]
    swiglu: tuple[float, float] | None = None     # (alpha, limit): engine.ops.clamped_swiglu; None: SiLU(gate) * up
    # Llama 4 (route_sigmoid_topk): each chosen expert takes the token's hidden state times its weight, and the
    # experts' outputs add up unweighted
    weighs_input: bool = False


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts."""
    probs = torch.softmax((x @ router.T).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(x: torch.Tensor, router: torch.Tensor, correction_bias: torch.Tensor | None,
                  cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: (weights [T, k] float32, expert ids [T, k] int64).

    A group of experts scores by the sum of its best group_score_experts biased scores (V3: two; V2, whose
    scores are a softmax and carry no bias: one); each token picks its topk_groups best groups, then its top-k
    biased scores among their experts (V2-Lite's greedy top-k is one group; ERNIE 4.5's too, over softmax scores
    with a correction bias)."""
    num_tokens = x.shape[0]
    logits = (x @ router.T).float() if cfg.router_in_model_dtype else x.float() @ router.float().T
    scores = torch.sigmoid(logits) if cfg.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    biased = scores if correction_bias is None else scores + correction_bias
    # explicit sizes: under expert parallelism a rank's slice of the batch may hold no token
    grouped = biased.view(num_tokens, cfg.num_groups, cfg.num_experts // cfg.num_groups)
    group_scores = grouped.topk(cfg.group_score_experts, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(cfg.topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, cfg.num_experts)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.norm_min is not None:   # ERNIE 4.5
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=cfg.norm_min)
    elif cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def route_topk_softmax(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k of the biased logits, weighted by a softmax over those k alone, computed in
    x's dtype as the reference computes it (weights returned in float32)."""
    logits = torch.nn.functional.linear(x, router, bias)
    top, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1).float(), ids


def route_sigmoid_topk(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing: the top-k of the logits (computed in x's dtype), each weighted by its sigmoid (in float32);
    the weights apply to the experts' inputs (MoEWeights.weighs_input)."""
    top, ids = torch.topk(x @ router.T, top_k, dim=-1)
    return torch.sigmoid(top.float()), ids


def select_experts(moe: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's routing of x: (weights [T, k] float32, expert ids [T, k] int64)."""
    if moe.grouped_routing is not None:
        return route_grouped(x, moe.router, moe.correction_bias, moe.grouped_routing)
    if moe.router_bias is not None:
        return route_topk_softmax(x, moe.router, moe.router_bias, moe.top_k)
    if moe.weighs_input:
        return route_sigmoid_topk(x, moe.router, moe.top_k)
    return route(x, moe.router, moe.top_k, moe.normalize)


def run_experts(moe: MoEWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ops) -> torch.Tensor:
    """ops.fused_moe over the block's experts (ids index the experts it holds), with their biases and activation."""
    if moe.gate_up_bias is None and moe.swiglu is None:
        return ops.fused_moe(x, weights, ids, moe.gate_up, moe.down)
    return ops.fused_moe(x, weights, ids, moe.gate_up, moe.down, moe.gate_up_bias, moe.down_bias, moe.swiglu)


def run_experts_on_weighted_inputs(moe: MoEWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                   ops) -> torch.Tensor:
    """Llama 4's experts: each (token, slot) pair's expert takes the token's row times the pair's weight (rounded to
    x's dtype first, as transformers rounds it), and a token's k outputs are summed."""
    num_tokens, top_k = ids.shape
    rows = (x[:, None, :] * weights.to(x.dtype)[:, :, None]).reshape(num_tokens * top_k, x.shape[1])
    unweighted = weights.new_ones((num_tokens * top_k, 1))
    out = run_experts(moe, rows, unweighted, ids.reshape(-1, 1), ops)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def shared_experts(moe: MoEWeights, x: torch.Tensor, ops) -> torch.Tensor | None:
    """The shared experts' output [T, hidden] for x, None when the block has none."""
    if moe.shared_gate_up is None:
        return None
    out = ops.linear(ops.silu_and_mul(ops.linear(x, moe.shared_gate_up)), moe.shared_down)
    return out if moe.shared_gate is None else torch.sigmoid(ops.linear(x, moe.shared_gate)) * out


def moe_forward(moe: MoEWeights, x: torch.Tensor, ops) -> torch.Tensor:
    """The block's output [T, hidden] for normed hidden states x [T, hidden]."""
    weights, ids = select_experts(moe, x)
    if moe.weighs_input:
        out = run_experts_on_weighted_inputs(moe, x, weights, ids, ops)
    else:
        out = run_experts(moe, x, weights, ids, ops)
    shared = shared_experts(moe, x, ops)
    return out if shared is None else out + shared
