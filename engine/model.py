"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, and the MoE Mixtral and Qwen3-MoE) over a flat
batch of tokens and a paged KV cache.

Weights are plain tensors; q/k/v and gate/up projections are fused at load time so a dense layer is
four matmuls. A mixture-of-experts layer replaces the MLP with engine.moe's block. Every op goes
through engine.ops so kernels can replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import ops
from engine.config import ModelConfig
from engine.moe import MoEWeights, moe_forward


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor             # [(H + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None   # Qwen3: RMSNorm over head_dim before rotary
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a mixture-of-experts layer
    down: torch.Tensor | None
    moe: MoEWeights | None = None


@dataclass(slots=True)
class ModelWeights:
    embed_tokens: torch.Tensor
    layers: list[LayerWeights]     # or engine.compression.streamed.StreamedLayers (compressed_in_memory)
    norm: torch.Tensor
    lm_head: torch.Tensor         # the embedding itself when tied


class CausalLM:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.scale = config.head_dim ** -0.5
        max_positions = config.max_position_embeddings
        self.cos_table, self.sin_table = ops.rope_cos_sin(config.head_dim, config.rope, max_positions, device)
        self.ops = ops.for_device(device)  # Triton kernels on CUDA, engine.ops elsewhere

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ops.AttentionBatch,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_cache is [layers, 2, blocks, block_size, Hkv, D]."""
        cfg = self.config
        hidden = self.weights.embed_tokens[input_ids]
        residual = None
        for index, layer in enumerate(self.weights.layers):
            if residual is None:
                residual = hidden
                normed = self.ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                normed, residual = self.ops.add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            attn = self._attention(index, layer, normed, positions, batch, kv_cache[index])
            normed, residual = self.ops.add_rms_norm(attn, residual, layer.post_norm, cfg.rms_norm_eps)
            if layer.moe is None:
                hidden = self.ops.linear(self.ops.silu_and_mul(self.ops.linear(normed, layer.gate_up)), layer.down)
            else:
                hidden = moe_forward(layer.moe, normed, self.ops)
        normed, _ = self.ops.add_rms_norm(hidden, residual, self.weights.norm, cfg.rms_norm_eps)
        return normed

    def _attention(self, index: int, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor,
                   batch: ops.AttentionBatch, layer_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        num_tokens = x.shape[0]
        qkv = self.ops.linear(x, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if layer.q_norm is not None:
            q = self.ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = self.ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = self.ops.apply_rotary(q, k, positions, self.cos_table, self.sin_table)
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        self.ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = self.ops.paged_attention(q, k_cache, v_cache, batch, self.scale, cfg.sliding_windows[index])
        return self.ops.linear(out.reshape(num_tokens, q_size), layer.o_proj)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.weights.lm_head).float()
