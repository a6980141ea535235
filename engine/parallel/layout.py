"""Which part of the model each rank holds: its pipeline stage's layers, its share of the heads,
the MLP, the experts and the vocabulary.

TP splits attention heads and KV heads across the ranks of a stage (column-parallel q/k/v and
gate/up, row-parallel o_proj and down). With fewer KV heads than ranks, each KV head is
replicated on tp / num_kv_heads ranks, and every rank still holds whole query-head groups.
Multi-head latent attention (DeepSeek-V3) is the extreme case: its cache has one "KV head", the
latent, replicated on every rank, and each rank decompresses it for its query heads.

Expert parallelism (EP) splits each mixture-of-experts layer's experts across the ranks of a stage
in contiguous runs (engine.expert_parallel dispatches tokens to them). A stage has
max(tp, ep) ranks, and one of two shapes:

- ep == tp: the EP group is the stage's TP group. Attention and the dense MLP layers are split by
  heads and rows as under TP alone; the experts are split by expert. tp=2, ep=2 is 2 ranks per stage.
- tp == 1: attention, the dense MLP layers, the embedding and the LM head are replicated on the ep
  ranks (each computes them for the whole batch and holds the whole KV of its stage); only the
  experts are split. Only the first rank of the last stage computes logits, so only it holds the LM head.

Any other mix (tp=2, ep=4; tp=4, ep=2) would need attention replicated within a part of the stage
and is refused, as is tp > 1 with ep == 1 for a mixture of experts (its experts would not be split).

The embedding and the LM head are vocab-parallel: each TP rank holds vocab/tp rows. The LM head
is the largest matmul of a decode step (vocab x hidden, e.g. 128k x 4096 = 2.4 Llama-8B layers),
so splitting it splits the step's biggest single cost; the embedding split costs one all-reduce of
[tokens, hidden] per step (one more than the 2 per layer TP already pays) and saves vocab x hidden
x (tp-1)/tp of memory on every rank; with tied embeddings the two are one tensor. See
benchmarks/parallel.py for the measured LM-head split.

Stages are contiguous runs of layers chosen to balance estimated per-stage cost: the weight bytes a
decode step reads (decode is memory-bound), with the LM head's vocab x hidden on the last stage.
The embedding is a lookup of one row per token, so it weighs next to nothing on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(slots=True, frozen=True)
class ParallelLayout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_parallel_size

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return max(self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.stage_size % self.tp

    def ep_rank_of(self, rank: int) -> int:
        return rank % self.stage_size % self.ep

    def rank_of(self, stage: int, tp_rank: int) -> int:
        return stage * self.stage_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [stage * self.stage_size + r for r in range(self.stage_size)]

    def stages(self, cfg: ModelConfig) -> list[range]:
        """Each stage's layers, balanced by what one of its ranks holds."""
        return split_layers(cfg, self.pp, self.ep // self.tp if self.ep > self.tp else 1)

    def __str__(self) -> str:
        return f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")

    def validate(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.ep > 1 and self.tp > 1 and self.ep != self.tp:
            raise ValueError(f"expert_parallel_size {self.ep} with tensor_parallel_size {self.tp}: the experts split "
                             f"across the stage's tensor-parallel ranks (expert_parallel_size {self.tp}), or across "
                             f"ranks that replicate attention (tensor_parallel_size 1)")

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise ValueError saying which size to change when the model cannot be split this way."""
        tp, pp = self.tp, self.pp
        if cfg.num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {cfg.num_heads} attention heads; "
                             f"use one of {_divisors(cfg.num_heads)}")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's {cfg.num_kv_heads} KV heads or be a "
                             f"multiple of them")
        if cfg.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the MLP size {cfg.intermediate_size}")
        if cfg.vocab_size < tp:
            raise ValueError(f"tensor_parallel_size {tp} exceeds the vocabulary ({cfg.vocab_size} tokens)")
        if cfg.num_layers < pp:
            raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {cfg.num_layers} layers")
        ep = self.ep
        if cfg.moe is None:
            if ep > 1:
                raise ValueError(f"expert_parallel_size {ep} needs a mixture-of-experts model; this {cfg.model_type} "
                                 f"model is dense (use tensor_parallel_size to split it)")
            return
        if tp > 1 and ep == 1:
            raise ValueError(f"tensor_parallel_size {tp} alone does not split a mixture-of-experts model's experts; "
                             f"set expert_parallel_size {tp} as well (experts split across the same ranks)")
        if cfg.moe.num_experts % ep:
            raise ValueError(f"expert_parallel_size {ep} does not divide the model's {cfg.moe.num_experts} experts; "
                             f"use one of {_divisors(cfg.moe.num_experts)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(slots=True, frozen=True)
class RankShard:
    """What one rank holds. Ranges are in the whole model's numbering."""

    rank: int
    tp_rank: int
    tp_size: int
    stage: int
    num_stages: int
    layers: range
    heads: range          # query heads
    kv_heads: range       # KV heads (a replica when the model has fewer KV heads than tp)
    mlp: range            # rows of gate/up, columns of down
    vocab: range          # rows of the embedding and the LM head
    ep_rank: int = 0
    ep_size: int = 1
    experts: range = range(0)   # of each mixture-of-experts layer: the experts this rank holds

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def is_replica(self) -> bool:
        """Expert parallelism without TP: this rank repeats the attention of its stage's first rank."""
        return self.tp_size == 1 and self.ep_rank > 0

    @property
    def computes_logits(self) -> bool:
        """Holds the LM head (its vocabulary rows) and sends their logits to rank 0."""
        return self.is_last_stage and not self.is_replica


def _all_experts(cfg: ModelConfig) -> range:
    return range(cfg.moe.num_experts if cfg.moe is not None else 0)


def whole_model(cfg: ModelConfig) -> RankShard:
    """The single-process engine's shard: everything."""
    return RankShard(0, 0, 1, 0, 1, range(cfg.num_layers), range(cfg.num_heads), range(cfg.num_kv_heads),
                     range(cfg.intermediate_size), range(cfg.vocab_size), experts=_all_experts(cfg))


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> range:
    per_rank = -(-vocab_size // tp)
    return range(min(vocab_size, tp_rank * per_rank), min(vocab_size, (tp_rank + 1) * per_rank))


def kv_head_range(num_kv_heads: int, tp: int, tp_rank: int) -> range:
    if num_kv_heads >= tp:
        per_rank = num_kv_heads // tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank // (tp // num_kv_heads)
    return range(head, head + 1)


def expert_range(num_experts: int, ep: int, ep_rank: int) -> range:
    """Rank ep_rank's contiguous run of the experts (engine.expert_parallel routes to owners by it)."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def rank_shard(layout: ParallelLayout, cfg: ModelConfig, rank: int, stages: list[range]) -> RankShard:
    tp, t = layout.tp, layout.tp_rank_of(rank)
    heads, inter = cfg.num_heads // tp, cfg.intermediate_size // tp
    stage, e = layout.stage_of(rank), layout.ep_rank_of(rank)
    experts = expert_range(cfg.moe.num_experts, layout.ep, e) if cfg.moe is not None else range(0)
    return RankShard(rank, t, tp, stage, layout.pp, stages[stage], range(t * heads, (t + 1) * heads),
                     kv_head_range(cfg.num_kv_heads, tp, t), range(t * inter, (t + 1) * inter),
                     vocab_range(cfg.vocab_size, tp, t), e, layout.ep, experts)


# -- the stage split ---------------------------------------------------------------------------


def layer_parameters(cfg: ModelConfig, layer: int, num_heads: int, num_kv_heads: int, num_mlp_rows: int,
                     num_experts: int) -> int:
    """Weight elements of decoder layer `layer` holding num_heads query heads and num_kv_heads KV heads (latent
    attention: its latent projections whole), num_mlp_rows rows of a dense MLP, and num_experts of a
    mixture-of-experts layer's routed experts (the router, its correction bias and the shared experts whole)."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    if cfg.mla is not None:
        attention = cfg.mla.num_parameters(hidden, num_heads)
    else:
        attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)   # q, k, v in and o out
        if cfg.qkv_bias:
            attention += (num_heads + 2 * num_kv_heads) * head_dim
        if cfg.o_bias:
            attention += hidden
        if cfg.qk_norm:   # one head's width each, or OLMo 2's over the whole q and k (this rank's heads')
            per_head = cfg.qk_norm_over_heads or cfg.qk_norm_weight_per_head   # OLMo 2's, Command R+'s
            attention += (num_heads + num_kv_heads) * head_dim if per_head else 2 * head_dim
        if cfg.attention_sinks:   # gpt-oss: one per query head
            attention += num_heads
        if cfg.attn_output_gate:   # Trinity's gate_proj: a row per query head's dim
            attention += hidden * head_dim * num_heads
    if cfg.is_sparse(layer):
        moe = cfg.moe
        mlp = (num_experts * moe.intermediate_size + moe.shared_width) * 3 * hidden + moe.num_experts * hidden
        mlp += hidden if moe.shared_expert_gate else 0   # Qwen2-MoE's shared expert's gate
        mlp += moe.num_experts if moe.has_correction_bias else 0   # the routing correction bias
        mlp += moe.num_experts if moe.router_bias else 0
        mlp += num_experts * (2 * moe.intermediate_size + hidden) if moe.expert_bias else 0   # gpt-oss's experts' biases
    elif not cfg.gated_mlp:   # StarCoder2's c_fc and c_proj (the others' up_proj and down_proj)
        mlp = 2 * hidden * num_mlp_rows + (num_mlp_rows + hidden if cfg.mlp_bias else 0)
        mlp += 4 if cfg.hidden_act == "xielu" else 0   # Apertus's activation's parameters
    else:
        mlp = 3 * hidden * num_mlp_rows + (2 * num_mlp_rows + hidden if cfg.mlp_bias else 0)
    num_norms = 4 if cfg.sandwich_norms and cfg.input_norms else 1 if cfg.parallel_block else 2   # the layer's
    num_norms = num_norms if cfg.norm_weights else 0   # nanochat's store no weight
    return attention + mlp + num_norms * hidden * (2 if cfg.norm_bias else 1)


def layer_cost(cfg: ModelConfig, layer: int, expert_split: int = 1) -> int:
    """Weight elements of one decoder layer (every expert of a mixture-of-experts layer: all are resident,
    and a batch of any size touches most of them). expert_split: how many more ways the experts are
    split than the rest of the layer (ep / tp: ep ranks replicating attention hold 1/ep of the experts
    each, and all of the attention)."""
    num_experts = cfg.moe.num_experts // expert_split if cfg.moe is not None else 0
    return layer_parameters(cfg, layer, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, num_experts)


def split_layers(cfg: ModelConfig, num_stages: int, expert_split: int = 1) -> list[range]:
    """Contiguous layer ranges, one per stage, minimizing the costliest stage's estimated cost (the
    last stage also carries the LM head; the first the embedding's lookups). Among equally good
    splits, the earliest stages take the extra layers."""
    num_layers = cfg.num_layers
    before = [0]  # before[n]: the cost of layers 0..n-1
    for layer in range(num_layers):
        before.append(before[-1] + layer_cost(cfg, layer, expert_split))
    head, embed = cfg.vocab_size * cfg.hidden_size, cfg.hidden_size  # the embedding: one row per token

    def cost(stage: int, start: int, end: int) -> int:
        return before[end] - before[start] + (embed if stage == 0 else 0) + (head if stage == num_stages - 1 else 0)

    # best[s][start]: the smallest possible max cost of stages s.. holding layers start..
    worst = 1 << 62
    best = [[worst] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[num_stages][num_layers] = 0
    end_of = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for s in range(num_stages - 1, -1, -1):
        for start in range(num_layers - (num_stages - s) + 1):
            # every stage keeps at least one layer; the largest first stage wins a tie
            for end in range(num_layers - (num_stages - s - 1), start, -1):
                value = max(cost(s, start, end), best[s + 1][end])
                if value < best[s][start]:
                    best[s][start], end_of[s][start] = value, end
    ranges, start = [], 0
    for s in range(num_stages):
        end = end_of[s][start]
        ranges.append(range(start, end))
        start = end
    return ranges
