"""One engine across several devices: tensor parallelism (TP) inside a pipeline stage, pipeline
parallelism (PP) across stages, one OS process per rank.

Rank 0 is the process that made the `LLMEngine`: it owns the scheduler, the block manager and the
sampler, starts ranks 1..N-1 (`worker`), and hands each step's inputs to them. Rank r is stage
`r // tp`, TP rank `r % tp`.

- `layout`: the layout, what each rank holds (`RankShard`) and the stage split by per-layer cost.
- `groups`: torch.distributed set-up and the process groups (TP, control, results).
- `protocol`: the per-step messages between ranks.
- `kv_pool`: each rank's KV pool in memory rank 0 can map, and the canonical-layout view of them all.
- `processes`: starting ranks, the watchdog that notices a dead one, shutdown without orphans.
- `executor`: rank 0's side of a step (`ParallelExecutor`); `worker`: every other rank's loop.
"""
