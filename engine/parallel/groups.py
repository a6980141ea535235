"""torch.distributed set-up for one engine's ranks, and the process groups the runtime uses.

Groups are torch.distributed backends (ProcessGroupNCCL on GPUs, ProcessGroupGloo on CPU) built
on a TCPStore that rank 0 serves, not the process-wide default group: a process may hold several
engines (an agent hosting two models, a test comparing layouts), each with its own ranks. Only a
group's members build it, so adding one is local to its members.

- `world`: every rank, data backend: hidden states from one pipeline stage to the next.
- `results`: every rank, data backend: logits from the last stage to rank 0. A second group because
  NCCL runs point-to-point ops between two ranks on one stream per group: logits coming back would
  otherwise queue behind the next batch's hidden states going out.
- `tp`: the ranks of this rank's stage, data backend (None when tp == 1): the model's all-reduces.
- `experts`: the ranks sharing this stage's experts, data backend (None when ep == 1): the
  mixture-of-experts all-to-alls. With tp == ep it is the `tp` group itself; with tp == 1, a group
  of the stage's ranks of its own.
- `control`: every rank, gloo, idle timeout: each step's message from stage to stage, and set-up
  agreements. A rank waits on it while the engine is idle, which may last days, so its timeout is
  long; a dead rank is noticed by the watchdog (engine.parallel.processes), not by this timeout.
- `first_stage_control`: stage 0's ranks, gloo, idle timeout (None with one rank per stage): rank 0's
  broadcast of each step's message.

Data groups time out after DATA_TIMEOUT: a rank that is alive but stuck makes the others fail then.
To add a group over some partition of the ranks, call `subgroup` with a new name on every rank of
the partition and keep it on `RankGroups`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel import timing
from engine.parallel.layout import ParallelLayout

SETUP_TIMEOUT = datetime.timedelta(seconds=120)   # every rank started and connected
DATA_TIMEOUT = datetime.timedelta(seconds=300)    # one collective of a running step
IDLE_TIMEOUT = datetime.timedelta(days=3650)      # waiting for the next step


@dataclass(slots=True)
class RankGroups:
    rank: int
    layout: ParallelLayout
    device: torch.device
    world: dist.ProcessGroup
    results: dist.ProcessGroup
    tp: dist.ProcessGroup | None
    control: dist.ProcessGroup
    first_stage_control: dist.ProcessGroup | None
    experts: dist.ProcessGroup | None = None

    def data_groups(self) -> list[dist.ProcessGroup]:
        groups = [g for g in (self.world, self.results, self.tp) if g is not None]
        return groups + ([self.experts] if self.experts is not None and self.experts is not self.tp else [])

    def abort(self) -> None:
        """Make every pending op of the data groups fail now (NCCL waits for a dead peer forever;
        gloo fails by itself once the peer's sockets close)."""
        for group in self.data_groups():
            abort = getattr(group, "abort", None)
            if abort is not None:
                abort()


def rendezvous(world_size: int, port: int | None) -> dist.TCPStore:
    """Rank 0 serves the store (port None: any free port); the others connect to it."""
    if port is None:
        return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=SETUP_TIMEOUT, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=SETUP_TIMEOUT)


def connect(store: dist.Store, layout: ParallelLayout, rank: int, device: torch.device) -> RankGroups:
    """Every rank calls this with the same layout; it returns once all have."""
    every = list(range(layout.world_size))
    stage = layout.stage_of(rank)
    data = "nccl" if device.type == "cuda" else "gloo"
    tp = first = experts = None
    if layout.tp > 1:
        tp = subgroup(store, f"tp{stage}", layout.stage_ranks(stage), rank, data, DATA_TIMEOUT)
    if layout.ep > 1:
        experts = tp if layout.ep == layout.tp else subgroup(store, f"ep{stage}", layout.stage_ranks(stage), rank,
                                                              data, DATA_TIMEOUT)
    if layout.stage_size > 1 and stage == 0:
        first = subgroup(store, "control0", layout.stage_ranks(0), rank, "gloo", IDLE_TIMEOUT)
    return RankGroups(
        rank=rank, layout=layout, device=device,
        world=subgroup(store, "world", every, rank, data, DATA_TIMEOUT),
        results=subgroup(store, "results", every, rank, data, DATA_TIMEOUT),
        tp=tp,
        control=subgroup(store, "control", every, rank, "gloo", IDLE_TIMEOUT),
        first_stage_control=first,
        experts=experts,
    )


def subgroup(store: dist.Store, name: str, members: list[int], rank: int, backend: str,
             timeout: datetime.timedelta) -> dist.ProcessGroup:
    """This rank's handle on the group of `members` (global ranks; this rank must be one). Within the
    group, ranks are numbered by their position in `members`."""
    prefixed = dist.PrefixStore(f"{name}/", store)
    group_rank, size = members.index(rank), len(members)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, group_rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # every rank of an engine is on this machine: loopback, whatever the host's name resolves to
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(prefixed, group_rank, size, options)


def all_reduce(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    with timing.comm():
        group.allreduce([tensor]).wait()


def agree_min(group: dist.ProcessGroup, value: int) -> int:
    """The smallest of every rank's value (over a gloo group)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([tensor], options).wait()
    return int(tensor.item())
