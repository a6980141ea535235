"""Lossless BF16 weight compression: smaller checkpoints, faster cold starts, more room for KV.

In bf16 only the 8-bit exponent is worth compressing: each tensor gets a palette of its 16 most
frequent exponents and a length-limited canonical Huffman code over them, groups of 64 elements
holding a rarer exponent are stored verbatim, and the sign/mantissa byte is kept as is. MLP
weights shrink by about a third, bit-exactly. FORMAT.md is the file format.

Modules: `codes` (code lengths, canonical codes), `format` (a compressed tensor, its checks),
`encoder`, `tables` (decode tables), `native_decoder` (CPU: C, built by the install),
`torch_decoder` (CPU fallback, reference), `triton_decoder` (CUDA), `workers` (the CPU decode
threads), `decode` (picks one), `checkpoint` (reading a compressed checkpoint), `writer` and
`compress` (`edgefire compress`), `streamed` (compressed_in_memory's layer-by-layer decoding).
This module stays free of torch imports: configs read WEIGHT_MODES from it.
"""

# How the engine holds a compressed checkpoint's weights (EngineConfig.weight_mode, agent weight_mode):
# decompress_on_load decodes everything while loading; compressed_in_memory keeps the MLP weights
# compressed on the device and decodes each layer's just before it runs.
WEIGHT_MODES = ("decompress_on_load", "compressed_in_memory")
