"""One engine across several devices: tensor parallelism (TP) inside a pipeline stage, pipeline
parallelism (PP) across stages, expert parallelism (EP: a mixture of experts' experts split across
a stage's ranks, engine.expert_parallel), one OS process per rank.

Rank 0 is the process that made the `LLMEngine`: it owns the scheduler, the block manager and the
sampler, starts ranks 1..N-1 (`worker`), and hands each step's inputs to them. A stage has
max(tp, ep) ranks: rank r is stage `r // max(tp, ep)`, and within it TP rank `r % tp` (0 when
attention is repeated for EP) and EP rank `r % ep`.

- `layout`: the layout, what each rank holds (`RankShard`) and the stage split by per-layer cost.
- `groups`: torch.distributed set-up and the process groups (TP, EP, control, results).
- `protocol`: the per-step messages between ranks.
- `kv_pool`: each rank's KV pool in memory rank 0 can map, and the canonical-layout view of them all.
- `processes`: starting ranks, the watchdog that notices a dead one, shutdown without orphans.
- `executor`: rank 0's side of a step (`ParallelExecutor`); `worker`: every other rank's loop.
"""
