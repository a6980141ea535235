"""One rank's model: its weights, its KV pool, its decode CUDA graphs, and a step's forward on them.

The single-process engine has one, holding the whole model; under tensor/pipeline parallelism each
rank has its own part (engine.parallel). The pool holds this rank's layers and KV heads for every
block of the engine's one block table. Its size: `kv_cache_bytes` per rank when given (default
256 MiB on CPU); on a GPU, the free memory after the weights less the largest step's activations,
times gpu_memory_utilization; plus, with weight_mode compressed_in_memory, the memory the
compressed MLP weights save. Ranks then agree on the smallest block count among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import math

import torch

from engine.compression.streamed import StreamedLayers
from engine.kv_export import KVMap
from engine.memory import CPU_KV_BYTES
from engine.model import CausalLM
from engine.runner import ForwardResult, StepInputs

if TYPE_CHECKING:
    from engine.engine import EngineConfig

log = logging.getLogger(__name__)


class ModelShard:
    def __init__(self, model: CausalLM, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = model.device
        self.kv_cache: torch.Tensor | None = None   # [layers, kv_parts, blocks, block_size, Hkv, D] of this rank
        self.num_blocks = 0
        self.num_kv_blocks_from_compression = 0   # of num_blocks, those compressed_in_memory paid for
        self.max_model_len = 0
        self.decode_graphs = None

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.model.dtype).element_size()
        return math.prod(self.pool_shape(1)) * element

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        model = self.model
        return model.config.kv_pool_shape(len(model.shard.layers), num_blocks, self.config.block_size,
                                          model.num_kv_heads)

    def blocks_fit(self) -> int:
        """KV blocks this rank's budget holds."""
        cfg = self.config
        saved = self._weight_bytes_saved()
        if cfg.kv_cache_bytes is not None:
            budget = cfg.kv_cache_bytes + saved   # the configured pool, plus what compression saved
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()       # free memory after the weights: the saving is in it
            saved = int(saved * cfg.gpu_memory_utilization)
        else:
            budget = CPU_KV_BYTES + saved
        num_blocks = budget // self.bytes_per_block
        self.num_kv_blocks_from_compression = num_blocks - (budget - saved) // self.bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"KV budget of {budget} bytes holds {num_blocks} blocks; at least 2 needed "
                             f"({self.bytes_per_block} bytes per block)")
        return num_blocks

    def _weight_bytes_saved(self) -> int:
        """Bytes compressed_in_memory saves against plain MLP weights in the engine's dtype (0 otherwise)."""
        layers = self.model.weights.layers
        if not isinstance(layers, StreamedLayers):
            return 0
        plain, saved = layers.plain_bytes, layers.bytes_saved
        log.info("compressed_in_memory: the MLP weights of %d layers take %.1f MiB compressed plus %.1f MiB of "
                 "decode buffers instead of %.1f MiB: %.1f MiB more for the KV cache", layers.num_compressed,
                 layers.compressed_bytes / 2**20, layers.buffer_bytes / 2**20, plain / 2**20, saved / 2**20)
        return max(0, saved)

    def allocate(self, num_blocks: int, pool: torch.Tensor | None = None) -> None:
        """Take `pool` (memory allocated elsewhere, e.g. shared with rank 0) or allocate a zeroed one."""
        shape = self.pool_shape(num_blocks)
        if pool is None:
            pool = torch.zeros(shape, dtype=self.model.dtype, device=self.device)
        self.kv_cache = pool.view(shape)
        self.num_blocks = num_blocks
        self.num_kv_blocks_from_compression = min(self.num_kv_blocks_from_compression, num_blocks)

    @property
    def kv_map(self) -> KVMap:
        return KVMap.single(self.kv_cache)

    # -- GPU fast path (CPU engines never enter these) -----------------------------------------

    def _cuda_kv_budget(self) -> int:
        """The free memory after the weights, less the activations of the largest step (measured by
        running it), times gpu_memory_utilization."""
        from engine.kernels.profile import activation_peak_bytes
        cfg = self.config
        activations = activation_peak_bytes(self.model, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size)
        free, _ = torch.cuda.mem_get_info(self.device)
        return int((free - activations) * cfg.gpu_memory_utilization)

    def capture_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or not self.config.enable_cuda_graphs:
            return
        if isinstance(self.model.weights.layers, StreamedLayers):
            # Decoding on a side stream inside a captured graph has not been validated on a GPU yet.
            log.info("compressed_in_memory: decode steps run without CUDA graphs")
            return
        if self.model.experts is not None:
            # an expert-parallel step sizes its all-to-alls by counts read on the host: not capturable
            log.info("expert parallelism: decode steps run without CUDA graphs")
            return
        if self.model.config.mla is not None:
            # its attention (engine.mla) plans groups from host-side lengths each step: not capturable
            log.info("multi-head latent attention: decode steps run without CUDA graphs")
            return
        from engine import kernels
        if not kernels.available():
            return
        from engine.kernels.cuda_graphs import DecodeGraphs
        max_blocks = -(-max_model_len // self.config.block_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, self.config.max_num_seqs, max_blocks)

    # -- the step ------------------------------------------------------------------------------

    def forward(self, inputs: StepInputs, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.can_run(inputs):
            return self.decode_graphs.run(inputs, hidden)
        return self.model.forward(inputs.input_ids, inputs.positions, inputs.batch, self.kv_cache, hidden)

    def run(self, inputs: StepInputs) -> ForwardResult:
        """The single-process step: logits [sample rows, vocab] (float32) and the pooled rows' hidden states."""
        hidden = self.forward(inputs)
        pooled = hidden.index_select(0, inputs.pool_index) if inputs.pool_rows else None
        if not inputs.sample_rows:
            return ForwardResult(None, pooled)
        return ForwardResult(self.model.compute_logits(hidden.index_select(0, inputs.sample_index)), pooled)


def max_model_len(config: EngineConfig, model_max_positions: int, num_blocks: int) -> int:
    limit = config.max_model_len or model_max_positions
    return min(limit, model_max_positions, num_blocks * config.block_size)
