"""The kernel-backed ops: engine.ops's hot-op signatures, each on a Triton kernel.

engine.ops.for_device returns this module in place of engine.ops on CUDA, so the model calls
`self.ops.rms_norm(...)` and never branches per call.
"""

import torch

from engine.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from engine.kernels.attention import paged_attention
from engine.kernels.fused_moe import fused_moe
from engine.kernels.kv_write import write_kv
from engine.kernels.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from engine.kernels.rotary import apply_rotary
# StarCoder2's biased LayerNorm (Nemotron's too) and the ungated activations (StarCoder2's GELU, Nemotron's and Arcee's
# ReLU squared, Apertus's xIELU): torch's own ops already run fused on the GPU
from engine.ops import biased_layer_norm, gelu_tanh, relu_squared, xielu

__all__ = ["add_layer_norm", "add_rms_norm", "apply_rotary", "biased_layer_norm", "fused_moe", "gelu_tanh",
           "gelu_tanh_and_mul", "layer_norm", "linear", "paged_attention", "relu_squared", "rms_norm", "silu_and_mul",
           "write_kv", "xielu"]


def linear(x, weight, bias=None):
    """x @ weight.T (+ bias): cuBLAS already spreads a matmul of any row count over the whole GPU. In bfloat16 or
    float16 the bias joins before the one rounding, in cuBLAS's epilogue (torch.nn.functional.linear); in float32
    it is added after, as engine.ops.linear adds it."""
    if bias is None:
        return x @ weight.T
    if x.dtype != torch.float32:
        return torch.nn.functional.linear(x, weight, bias)
    return x @ weight.T + bias
