"""A rank other than 0: `python -m engine.parallel.worker SPEC`, started by rank 0 (processes.py).

It loads its part of the model, shares its KV pool with rank 0 (kv_pool.py), then runs the steps
rank 0 sends (protocol.py) until told to stop. It exits at once when rank 0 dies, and reports any
error of its own to rank 0 before exiting non-zero.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import threading
import traceback
from pathlib import Path

import torch

from engine.config import load_config
from engine.loader import resolve_dtype
from engine.parallel import protocol, timing
from engine.parallel.groups import RankGroups, rendezvous
from engine.parallel.kv_pool import cuda_pool_handle, shared_cpu_pool
from engine.parallel.layout import ParallelLayout
from engine.parallel.processes import WATCH_INTERVAL_S, WorkerSpec, send_message
from engine.parallel.rank import finish_rank, start_rank
from engine.runner import unpack_step
from engine.shard import ModelShard

log = logging.getLogger("engine.parallel.worker")


def main(argv: list[str]) -> int:
    spec = WorkerSpec(**json.loads(argv[1]))
    control = socket.socket(fileno=spec.control_fd)
    threading.Thread(target=_exit_with_parent, args=(control, os.getppid()), name="parent-watch", daemon=True).start()
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        serve(spec, control)
    except BaseException as exc:  # every failure reaches rank 0 before this process goes
        log.error("rank %d failed:\n%s", spec.rank, traceback.format_exc())
        send_message(control, "error", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def _exit_with_parent(control: socket.socket, parent_pid: int) -> None:
    """Rank 0 closes nothing on this socket while it lives: end of file means it died."""
    while True:
        readable, _, _ = select.select([control], [], [], WATCH_INTERVAL_S)
        gone = os.getppid() != parent_pid
        if readable:
            try:
                gone = gone or not control.recv(1, socket.MSG_PEEK)
            except OSError:
                gone = True
        if gone:
            os._exit(0)


def serve(spec: WorkerSpec, control: socket.socket) -> None:
    from engine.engine import EngineConfig

    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(spec.dtype, device)
    config = EngineConfig(**spec.engine_config)
    layout = ParallelLayout(spec.tensor_parallel_size, spec.pipeline_parallel_size, spec.expert_parallel_size)
    model_dir = Path(spec.model_dir)
    model_config = load_config(model_dir)
    send_message(control, "hello")
    store = rendezvous(layout.world_size, spec.store_port)
    groups, shard, num_blocks = start_rank(store, layout, spec.rank, model_dir, model_config, config, device, dtype,
                                           show_progress=False)
    shape = shard.pool_shape(num_blocks)
    if device.type == "cuda":
        pool = torch.zeros(shape, dtype=dtype, device=device)
        send_message(control, "kv_pool", cuda_handle=cuda_pool_handle(pool))
    else:
        pool, fd = shared_cpu_pool(shape, dtype)
        send_message(control, "kv_pool", fds=[fd])
        os.close(fd)
    finish_rank(shard, num_blocks, pool, model_config, config)
    send_message(control, "ready")
    part = shard.model.shard
    log.info("rank %d ready: layers %d-%d, KV heads %s%s", spec.rank, part.layers.start, part.layers.stop - 1,
             list(part.kv_heads), f", experts {part.experts.start}-{part.experts.stop - 1}" if part.ep_size > 1 else "")
    step_loop(groups, shard)
    if timing.ENABLED:
        send_message(control, "timings", **timing.TIMES.to_dict())


def step_loop(groups: RankGroups, shard: ModelShard) -> None:
    """Take steps from rank 0 (stage 0) or the stage before, pass them on, until STOP."""
    part = shard.model.shard
    first, last, logits = part.is_first_stage, part.is_last_stage, part.computes_logits
    hidden_size, dtype = shard.model.config.hidden_size, shard.model.dtype
    sends = protocol.Sends()
    while True:
        command, length = protocol.receive_header(groups, first)
        if command == protocol.STOP:
            sends.wait()
            if not last:
                protocol.send_next_stage(groups, protocol.header(protocol.STOP), None, None).wait()
            return
        with timing.step():
            message, hidden_in = protocol.receive_body(groups, first, length, hidden_size, dtype)
            sends.wait()  # the previous step has reached the next stage: its buffers may be reused
            inputs = unpack_step(message, groups.device)
            hidden = shard.forward(inputs, hidden_in)
            if not last:
                if shard.decode_graphs is not None:
                    hidden = hidden.clone()  # a graph's output buffer is overwritten by the next replay
                sends = protocol.send_next_stage(groups, protocol.header(protocol.STEP, message), message, hidden)
                continue
            if logits and inputs.sample_rows:
                protocol.send_logits(groups, shard.model.project(hidden.index_select(0, inputs.sample_index)))
            if inputs.pool_rows and part.tp_rank == 0 and part.ep_rank == 0:   # the stage's first rank
                protocol.send_pooled(groups, hidden.index_select(0, inputs.pool_index))


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: process groups' destructors may wait on peers already gone
