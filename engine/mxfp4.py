"""MXFP4 weights (the OCP microscaling format gpt-oss's experts are released in), dequantized at load time.

A block of 32 consecutive values along a weight row shares one scale. Each value is a 4-bit E2M1 float
(sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two to a byte,
the even-indexed value in the low nibble; the scale is an E8M0 byte, the power of two 2^(byte - 127).
A checkpoint stores a weight [..., rows, cols] as `*_blocks` uint8 [..., rows, cols / 32, 16] and
`*_scales` uint8 [..., rows, cols / 32]. The engine computes in float32, float16 or bfloat16, so the
weights are expanded once, as they are read; every E2M1 value times a power of two is exact in those
dtypes within their range.

`edgefire compress` copies these tensors into a compressed checkpoint as they are (is_part): 4-bit codes
and power-of-two scales leave no redundancy for its bf16 exponent coding to remove.
"""

from __future__ import annotations

import torch

from engine.config import GPT_OSS_QUANTIZATION

VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2
SCALE_BIAS = 127
PART_SUFFIXES = ("_blocks", "_scales")   # a weight W is stored as W_blocks and W_scales
# The 16 E2M1 codes' values: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] as values [..., G * 32] in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree: blocks are "
                         f"[..., G, {BYTES_PER_BLOCK}] for scales [..., G]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()   # low nibble first
    values = table[codes] * torch.exp2(scales.float() - SCALE_BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def is_quantized(raw_config: dict) -> bool:
    """Whether a checkpoint's config.json (raw) says its weights hold MXFP4 tensors."""
    quantization = raw_config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == GPT_OSS_QUANTIZATION


def is_part(name: str, dtype: torch.dtype) -> bool:
    """Whether a tensor of an MXFP4 checkpoint is one of its quantized weights' blocks or scales."""
    return name.endswith(PART_SUFFIXES) and dtype == torch.uint8
