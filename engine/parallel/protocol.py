"""The per-step messages between ranks, on the groups of engine.parallel.groups.

A step starts at rank 0 and flows down the pipeline:

    rank 0 --broadcast(header, message)--> the other ranks of stage 0          (first_stage_control)
    stage s rank t --send(header, message) + send(hidden)--> stage s+1 rank t  (control + world)
    last stage TP rank t --send(logits of its vocab rows)--> rank 0           (results)
    last stage TP rank 0 --send(hidden states of the pooled rows)--> rank 0   (results, pipeline only)

The header is [command, message length]; the message is the step's packed inputs
(engine.runner: counts first, so a receiver knows the hidden states' and logits' shapes); the
hidden states are the residual stream [num_tokens, hidden]. STOP travels the same way and ends
every worker's loop. Sends are asynchronous: the caller keeps the returned `Sends` (tensors and
works) until they complete, so a stage can take its next step while the previous one is still
on its way to the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.parallel import timing
from engine.parallel.groups import RankGroups
from engine.runner import NUM_TOKENS_AT

STEP, STOP = 1, 2
TAG = 0
POOLED_TAG = 1   # the embedding requests' hidden states, after the same rank's logits


@dataclass(slots=True)
class Sends:
    works: list = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)  # alive until the works complete

    def wait(self) -> None:
        with timing.comm():
            for work in self.works:
                work.wait()
        self.works, self.tensors = [], []


def header(command: int, message: torch.Tensor | None = None) -> torch.Tensor:
    return torch.tensor([command, 0 if message is None else message.numel()], dtype=torch.int64)


def num_tokens(message: torch.Tensor) -> int:
    return int(message[NUM_TOKENS_AT])


def broadcast_first_stage(groups: RankGroups, head: torch.Tensor, message: torch.Tensor | None) -> None:
    """Rank 0's side: stage 0's other ranks get the step."""
    with timing.comm():
        groups.first_stage_control.broadcast(head, 0).wait()
        if message is not None:
            groups.first_stage_control.broadcast(message, 0).wait()


def receive_header(groups: RankGroups, first_stage: bool) -> tuple[int, int]:
    """(command, message length) of the next step: from rank 0 on stage 0, else from the stage before.
    This is where a worker waits while the engine is idle."""
    head = torch.empty(2, dtype=torch.int64)
    if first_stage:
        groups.first_stage_control.broadcast(head, 0).wait()
    else:
        groups.control.recv([head], groups.rank - groups.layout.stage_size, TAG).wait()
    command, length = head.tolist()
    return command, length


def receive_body(groups: RankGroups, first_stage: bool, length: int, hidden_size: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's message, and on a later stage the hidden states it continues from."""
    message = torch.empty(length, dtype=torch.int64)
    with timing.comm():
        if first_stage:
            groups.first_stage_control.broadcast(message, 0).wait()
            return message, None
        src = groups.rank - groups.layout.stage_size
        groups.control.recv([message], src, TAG).wait()
        hidden = torch.empty((num_tokens(message), hidden_size), dtype=dtype, device=groups.device)
        groups.world.recv([hidden], src, TAG).wait()
    return message, hidden


def send_next_stage(groups: RankGroups, head: torch.Tensor, message: torch.Tensor | None,
                    hidden: torch.Tensor | None) -> Sends:
    dst = groups.rank + groups.layout.stage_size
    sends = Sends(tensors=[head])
    sends.works.append(groups.control.send([head], dst, TAG))
    if message is not None:
        sends.works.append(groups.control.send([message], dst, TAG))
        sends.works.append(groups.world.send([hidden], dst, TAG))
        sends.tensors += [message, hidden]
    return sends


def send_logits(groups: RankGroups, logits: torch.Tensor) -> None:
    with timing.comm():
        groups.results.send([logits], 0, TAG).wait()


def post_logits_receive(groups: RankGroups, src: int, rows: int, columns: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, dist.Work]:
    logits = torch.empty((rows, columns), dtype=dtype, device=groups.device)
    return logits, groups.results.recv([logits], src, TAG)


def send_pooled(groups: RankGroups, hidden: torch.Tensor) -> None:
    with timing.comm():
        groups.results.send([hidden], 0, POOLED_TAG).wait()


def post_pooled_receive(groups: RankGroups, src: int, rows: int, hidden_size: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, dist.Work]:
    hidden = torch.empty((rows, hidden_size), dtype=dtype, device=groups.device)
    return hidden, groups.results.recv([hidden], src, POOLED_TAG)
