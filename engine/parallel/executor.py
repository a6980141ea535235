"""Rank 0's side of a tensor/pipeline/expert-parallel engine: starts the other ranks, hands each step
to them, runs its own part (stage 0, TP rank 0), and gathers the logits for the sampler.

`submit` starts a batch and returns once rank 0's stage is done with it; `collect` waits for the
oldest submitted batch's logits (and the hidden states of the rows embedding requests pool: rank 0's own
with one stage, which holds the whole residual stream after the all-reduces, else sent by the last stage's
first rank). With pipeline parallelism the engine submits up to pp batches
before collecting, so while later stages run batch k, rank 0 already runs batch k+1. `run` is
both at once (one batch at a time; every TP-only step). Logits come back vocab-parallel: each TP rank
of the last stage sends its vocabulary rows' columns straight to rank 0 (ranks that only replicate
attention for expert parallelism send none).

Any failure (a rank that died, a collective that failed or timed out, an error in rank 0's own
part mid-step) leaves the ranks out of step: every rank is stopped and the engine raises
RankFailedError from then on.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.errors import EngineError, RankFailedError
from engine.kv_export import KVMap
from engine.parallel import protocol, timing
from engine.parallel.groups import RankGroups, rendezvous
from engine.parallel.kv_pool import build_kv_map, map_cpu_pool, open_cuda_pool
from engine.parallel.layout import ParallelLayout, rank_shard
from engine.parallel.processes import RankProcesses, WorkerSpec
from engine.parallel.rank import finish_rank, start_rank
from engine.runner import ForwardResult, StepInputs

if TYPE_CHECKING:
    from engine.engine import EngineConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0   # a worker's start-up steps: import torch, load its weights, capture graphs


@dataclass(slots=True)
class _Pending:
    """A submitted batch: where its logits will come from."""

    num_rows: int
    own: torch.Tensor | None                         # rank 0's vocabulary columns (pp == 1)
    receives: list[tuple[torch.Tensor, dist.Work]]   # the other last-stage ranks' columns, in TP order
    sends: protocol.Sends = field(default_factory=protocol.Sends)
    pooled: torch.Tensor | None = None               # the pooled rows' hidden states (rank 0's, pp == 1)
    pooled_receive: tuple[torch.Tensor, dist.Work] | None = None   # from the last stage (pp > 1)


class ParallelExecutor:
    def __init__(self, model_dir: Path, model_config: ModelConfig, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype):
        self.layout = layout = config.layout
        _check_devices(layout, device)
        self.model_config = model_config
        self.failure: RankFailedError | None = None
        self._pending: deque[_Pending] = deque()
        self.rank_times: dict[int, dict] = {}   # per rank, with EDGEFIRE_PARALLEL_TIMING=1, once shut down
        self._threads_before = torch.get_num_threads()
        num_threads = max(1, self._threads_before // layout.world_size) if device.type == "cpu" else 1
        stages = layout.stages(model_config)
        self.shards = [rank_shard(layout, model_config, r, stages) for r in range(layout.world_size)]
        # where each rank runs (rank 0 here): the engine reports these, so no one else restates the rule
        self.rank_devices = rank_devices(device, layout.world_size)
        log.info("starting %d ranks (%s); stages hold layers %s", layout.world_size, layout,
                 ", ".join(f"{r.start}-{r.stop - 1}" for r in stages))
        store = rendezvous(layout.world_size, None)
        specs = [WorkerSpec(rank, str(model_dir), layout.tp, layout.pp, layout.ep, store.port, -1,
                            str(self.rank_devices[rank]), str(dtype).removeprefix("torch."), num_threads,
                            {**asdict(config), "speculative": None},  # rank 0 speculates; ranks run the steps
                            logging.getLogger().getEffectiveLevel())
                 for rank in range(1, layout.world_size)]
        self.processes = RankProcesses(specs)
        self.groups: RankGroups | None = None
        self.processes.on_failure = self._abort_groups
        if device.type == "cpu":
            torch.set_num_threads(num_threads)
        try:
            self._start(store, model_dir, config, device, dtype)
        except BaseException as exc:
            # rank 0's own bad input (a checkpoint error, a KV budget too small) is the error to show;
            # anything else is most likely a worker that failed first (its error, or how it died)
            own = isinstance(exc, (EngineError, ValueError))
            reason = None if own else self.processes.wait_failure(timeout=2.0)
            self.processes.stop()
            torch.set_num_threads(self._threads_before)
            if reason is not None:  # a worker failed first (its error, or how it died): that is the cause
                raise RankFailedError(f"starting the {layout.world_size}-rank engine ({layout}) failed: {reason}") from exc
            raise

    def _start(self, store: dist.Store, model_dir: Path, config: EngineConfig, device: torch.device,
               dtype: torch.dtype) -> None:
        for rank in self.processes.procs:  # every worker is up before rank 0 waits on the store for them
            self.processes.receive(rank, "hello", START_TIMEOUT_S)
        self.groups, self.shard, num_blocks = start_rank(store, self.layout, 0, model_dir, self.model_config, config,
                                                         device, dtype, config.show_progress)
        finish_rank(self.shard, num_blocks, None, self.model_config, config)
        pools = [self.shard.kv_cache]
        for rank in self.processes.procs:
            message, fds = self.processes.receive(rank, "kv_pool", START_TIMEOUT_S)
            pools.append(_open_pool(message, fds, self._pool_shape(rank, num_blocks, config), dtype))
        for rank in self.processes.procs:
            self.processes.receive(rank, "ready", START_TIMEOUT_S)
        self.kv_map: KVMap = build_kv_map(self.shards, pools, self.model_config.num_layers)
        self.num_blocks = num_blocks
        self.max_model_len = self.shard.max_model_len
        self.model = self.shard.model
        self.bytes_per_block = self.shard.bytes_per_block
        self.num_kv_blocks_from_compression = self.shard.num_kv_blocks_from_compression  # rank 0's
        self._vocab = [self.shards[self.layout.rank_of(self.layout.pp - 1, t)].vocab for t in range(self.layout.tp)]

    def _pool_shape(self, rank: int, num_blocks: int, config: EngineConfig) -> tuple[int, ...]:
        shard = self.shards[rank]
        return self.model_config.kv_pool_shape(len(shard.layers), num_blocks, config.block_size, len(shard.kv_heads))

    # -- steps ---------------------------------------------------------------------------------

    def run(self, inputs: StepInputs) -> ForwardResult:
        self.submit(inputs)
        return self.collect()

    def submit(self, inputs: StepInputs) -> None:
        self.raise_if_failed()
        groups, layout = self.groups, self.layout
        message, rows = inputs.message, len(inputs.sample_rows)
        head = protocol.header(protocol.STEP, message)
        with self._guard(), timing.step():
            if groups.first_stage_control is not None:
                protocol.broadcast_first_stage(groups, head, message)
            last = layout.pp - 1
            receives = [protocol.post_logits_receive(groups, layout.rank_of(last, t), rows, len(self._vocab[t]),
                                                     self.model.dtype)
                        for t in range(layout.tp) if rows and layout.rank_of(last, t) != 0]
            pending = _Pending(rows, None, receives)
            if inputs.pool_rows and layout.pp > 1:   # posted after the logits: the sender sends in this order
                pending.pooled_receive = protocol.post_pooled_receive(
                    groups, layout.rank_of(last, 0), len(inputs.pool_rows), self.model_config.hidden_size,
                    self.model.dtype)
            hidden = self.shard.forward(inputs)
            if layout.pp > 1:
                if self.shard.decode_graphs is not None:
                    hidden = hidden.clone()  # a graph's output buffer is overwritten by the next replay
                pending.sends = protocol.send_next_stage(groups, head, message, hidden)
            else:
                if rows:
                    pending.own = self.model.project(hidden.index_select(0, inputs.sample_index))
                if inputs.pool_rows:
                    pending.pooled = hidden.index_select(0, inputs.pool_index)
        self._pending.append(pending)

    def collect(self) -> ForwardResult:
        """Logits [rows, vocab] (float32) of the oldest submitted batch (None when none of its rows sample),
        and its pooled rows' hidden states (None when none)."""
        pending = self._pending.popleft()
        self.raise_if_failed()
        with self._guard(), timing.step(count=False), timing.comm():
            for _, work in pending.receives:
                work.wait()
            if pending.pooled_receive is not None:
                pending.pooled = pending.pooled_receive[0]
                pending.pooled_receive[1].wait()
            pending.sends.wait()
        if not pending.num_rows:
            return ForwardResult(None, pending.pooled)
        columns = ([pending.own] if pending.own is not None else []) + [logits for logits, _ in pending.receives]
        return ForwardResult((columns[0] if len(columns) == 1 else torch.cat(columns, dim=1)).float(), pending.pooled)

    # -- failure and shutdown --------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        if self.failure is None and self.processes.failure is not None:
            self.failure = RankFailedError(self._describe(self.processes.failure))
        if self.failure is not None:
            raise self.failure

    @contextmanager
    def _guard(self):
        try:
            yield
        except Exception as exc:
            # a dead peer fails rank 0's op at once; give the watchdog a moment to say which and how
            reason = self.processes.wait_failure(timeout=2.0)
            if reason is None:
                self.processes.mark_failed(f"rank 0 failed: {type(exc).__name__}: {exc}")
                reason = self.processes.failure
            self.failure = RankFailedError(self._describe(reason))
            log.error("%s", self.failure)
            raise self.failure from exc

    def _describe(self, reason: str) -> str:
        return (f"{reason}; this {self.layout.world_size}-rank engine ({self.layout}) has stopped every rank "
                f"and cannot serve until it is restarted")

    def _abort_groups(self) -> None:
        if self.groups is not None:
            self.groups.abort()

    def shutdown(self) -> None:
        """Stop every rank (an orderly STOP when the ranks are healthy); no process is left behind."""
        if self.processes.failure is None and self.failure is None and self.groups is not None:
            self.processes.expect_exit()
            try:
                while self._pending:
                    self.collect()
                stop = protocol.header(protocol.STOP)
                if self.groups.first_stage_control is not None:
                    protocol.broadcast_first_stage(self.groups, stop, None)
                if self.layout.pp > 1:
                    protocol.send_next_stage(self.groups, stop, None, None).wait()
                if timing.ENABLED:
                    self.rank_times = {0: timing.TIMES.to_dict()} | {
                        rank: self.processes.receive(rank, "timings", 10.0)[0] for rank in self.processes.procs}
            except (RuntimeError, RankFailedError) as exc:
                log.warning("ranks did not take the stop (%s); killing them", exc)
        self.processes.stop(grace_s=5.0)
        torch.set_num_threads(self._threads_before)


def _check_devices(layout: ParallelLayout, device: torch.device) -> None:
    """Every rank has a GPU of its own (rank r on the engine's device index + r): refused before any
    rank starts, rather than as a worker's "invalid device ordinal"."""
    if device.type != "cuda":
        return
    first, count = device.index or 0, torch.cuda.device_count()
    if first + layout.world_size > count:
        raise ValueError(f"{layout} runs {layout.world_size} ranks, one GPU each from cuda:{first} on, but this "
                         f"process sees {count} GPU(s); lower tensor_parallel_size, pipeline_parallel_size or "
                         f"expert_parallel_size to fit, or start from a lower device index")


def rank_devices(device: torch.device, world_size: int) -> list[torch.device]:
    """Each rank's device: rank r on the engine's device index + r (a bare "cuda" counts from cuda:0)."""
    if device.type != "cuda":
        return [device] * world_size
    return [torch.device("cuda", (device.index or 0) + rank) for rank in range(world_size)]


def _open_pool(message: dict, fds: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if "cuda_handle" in message:
        return open_cuda_pool(message["cuda_handle"])
    return map_cpu_pool(fds[0], shape, dtype)
