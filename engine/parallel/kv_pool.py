"""Every rank's KV pool mapped into rank 0, and the canonical-layout view over them (a KVMap).

KV payloads between sites are in one canonical layout: every layer, every KV head. Under
tensor/pipeline parallelism rank r's pool holds only its stage's layers and its KV heads. Rank 0
maps each rank's pool, so export and import (engine.kv_export, LLMEngine._write_payload) read and
write each rank's slice in that rank's own memory: a chunk is assembled once, in the buffer the
transport sends, and an imported chunk's heads go straight to the pools that hold them.

Why not ship slices to rank 0 over torch.distributed: that would gather the whole payload through
rank 0 (a second copy of every byte) and need every rank to stop stepping for each chunk; an
export runs on transport threads while the engine keeps stepping, as it does on one device, and a
transfer costs the ranks nothing.

- CPU: a worker's pool is a memfd (anonymous shared memory); its descriptor goes to rank 0 over
  the worker's control socket and both map it. Nothing is named in /dev/shm, so nothing is left
  behind: the memory goes with the last process that maps it.
- GPU: a worker's pool is device memory shared with rank 0 by a CUDA IPC handle. Rank 0 runs an
  export's gathers on that GPU and copies each chunk to the host once, as on one GPU; the price is
  a CUDA context of rank 0 on every GPU of the engine.
"""

from __future__ import annotations

import base64
import math
import os
import pickle

import torch

from engine.kv_export import KVMap, KVSlice
from engine.parallel.layout import RankShard


def shared_cpu_pool(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A zeroed pool in a memfd; returns it and the descriptor to hand to rank 0."""
    fd = os.memfd_create("edgefire-kv")
    numel = math.prod(shape)
    os.ftruncate(fd, numel * torch.tensor([], dtype=dtype).element_size())
    return map_cpu_pool(fd, shape, dtype, close=False), fd


def map_cpu_pool(fd: int, shape: tuple[int, ...], dtype: torch.dtype, close: bool = True) -> torch.Tensor:
    pool = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    if close:
        os.close(fd)  # the mapping keeps the memory
    return pool


def cuda_pool_handle(pool: torch.Tensor) -> str:
    """A CUDA pool as text rank 0 can rebuild (the worker keeps the pool alive for its life)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return base64.b64encode(pickle.dumps(reduce_tensor(pool))).decode()


def open_cuda_pool(handle: str) -> torch.Tensor:
    rebuild, args = pickle.loads(base64.b64decode(handle))  # written by our own worker process
    return rebuild(*args)


def build_kv_map(shards: list[RankShard], pools: list[torch.Tensor], num_layers: int) -> KVMap:
    """shards[r] and pools[r] are rank r's; every model layer is on exactly one stage."""
    read: list[list[KVSlice]] = [[] for _ in range(num_layers)]
    write: list[list[KVSlice]] = [[] for _ in range(num_layers)]
    for shard, pool in sorted(zip(shards, pools), key=lambda sp: (sp[0].stage, sp[0].tp_rank)):
        for layer in shard.layers:
            piece = KVSlice(pool, layer - shard.layers.start, shard.kv_heads)
            write[layer].append(piece)
            covered = read[layer][-1].heads.stop if read[layer] else 0
            if shard.kv_heads.start == covered:  # a replica of heads already read is skipped
                read[layer].append(piece)
    return KVMap(read, write)
