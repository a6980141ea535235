"""The kernels compile for an H100 (sm_90) in bf16, even on a machine without a GPU.

The interpreter runs kernels through numpy and never sees the GPU compiler, so type errors in
the Triton IR, unsupported ops and shared-memory overflows would first appear on a GPU. Triton
compiles ahead of time for a named target with the ptxas it ships, so CI catches them here.
The compile runs in a child process: this test folder sets TRITON_INTERPRET, under which
@triton.jit yields interpreter functions that cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ != "__main__":
    import pytest

    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' brings it)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.compression.triton_decoder import _decode_kernel as _bf16_decode_kernel  # noqa: E402
from engine.kernels.activation import _act_and_mul_kernel  # noqa: E402
from engine.kernels.decode_attention import _decode_kernel, _merge_splits_kernel  # noqa: E402
from engine.kernels.fused_moe import _down_kernel, _gate_up_kernel  # noqa: E402
from engine.kernels.kv_write import _write_kv_kernel  # noqa: E402
from engine.kernels.norm import _rms_norm_kernel  # noqa: E402
from engine.kernels.prefill_attention import _prefill_kernel  # noqa: E402
from engine.kernels.rotary import _rotary_kernel  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
H100_SHARED_BYTES = 227 * 1024
BF16 = "*bf16"

# (kernel, pointer/float argument types, constexprs) at Llama-3.1-8B sizes; other int args are i32.
CASES = {
    "decode": (_decode_kernel,
               dict(q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, block_tables_ptr="*i64", context_lens_ptr="*i64",
                    out_ptr=BF16, part_out_ptr="*fp32", part_lse_ptr="*fp32", sinks_ptr=BF16, qk_scale="fp32"),
               dict(GROUP=4, BLOCK_G=16, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=8, WINDOW=0,
                    DOT_F32=False, PRECISION=None, SINKS=False)),
    # gpt-oss-20b's attention: 64 query heads over 8 KV heads of 64 dims, per-head sinks, a 128-token window
    "decode_sinks": (_decode_kernel,
                     dict(q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, block_tables_ptr="*i64",
                          context_lens_ptr="*i64", out_ptr=BF16, part_out_ptr="*fp32", part_lse_ptr="*fp32",
                          sinks_ptr="*fp32", qk_scale="fp32"),
                     dict(GROUP=8, BLOCK_G=16, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=8, WINDOW=128,
                          DOT_F32=False, PRECISION=None, SINKS=True)),
    "prefill_sinks": (_prefill_kernel,
                      dict(q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, out_ptr=BF16, block_tables_ptr="*i64",
                           query_start_ptr="*i32", context_lens_ptr="*i32", sinks_ptr="*fp32", qk_scale="fp32"),
                      dict(GROUP=8, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=32, WINDOW=128, DOT_F32=False,
                           PRECISION=None, SINKS=True)),
    "merge_splits": (_merge_splits_kernel, dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=BF16),
                     dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128)),
    "prefill": (_prefill_kernel,
                dict(q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, out_ptr=BF16, block_tables_ptr="*i64",
                     query_start_ptr="*i32", context_lens_ptr="*i32", sinks_ptr=BF16, qk_scale="fp32"),
                dict(GROUP=4, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=32, WINDOW=4096, DOT_F32=False,
                     PRECISION=None, SINKS=False)),
    "add_rms_norm": (_rms_norm_kernel, dict(x_ptr=BF16, residual_ptr=BF16, weight_ptr=BF16, out_ptr=BF16,
                                            residual_out_ptr=BF16, eps="fp32"), dict(HAS_RESIDUAL=True, BLOCK=4096)),
    # Command A's LayerNorm: the row's mean subtracted, float32 weights, hidden 12288
    "add_layer_norm": (_rms_norm_kernel, dict(x_ptr=BF16, residual_ptr=BF16, weight_ptr="*fp32", out_ptr=BF16,
                                              residual_out_ptr=BF16, eps="fp32"),
                       dict(HAS_RESIDUAL=True, ROUND_FIRST=False, SUBTRACT_MEAN=True, BLOCK=16384)),
    "silu_and_mul": (_act_and_mul_kernel, dict(gate_up_ptr=BF16, out_ptr=BF16), dict(GELU_TANH=False, BLOCK=1024)),
    "rotary": (_rotary_kernel, dict(q_ptr=BF16, k_ptr=BF16, q_out_ptr=BF16, k_out_ptr=BF16, positions_ptr="*i64",
                                    cos_ptr="*fp32", sin_ptr="*fp32"),
               dict(BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=64, BLOCK_PASS=0)),
    # Phi-4-mini's partial rotary: 96 of 128 head dims rotate, 32 pass through
    "rotary_partial": (_rotary_kernel, dict(q_ptr=BF16, k_ptr=BF16, q_out_ptr=BF16, k_out_ptr=BF16,
                                            positions_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32"),
                       dict(BLOCK_H=32, BLOCK_HKV=8, BLOCK_HALF=64, BLOCK_PASS=32)),
    # Mixtral-8x7B's expert widths (hidden 4096, inter 14336), 64-row prefill blocks.
    "moe_gate_up": (_gate_up_kernel, dict(x_ptr=BF16, w_ptr=BF16, out_ptr=BF16, bias_ptr=BF16, sorted_pairs_ptr="*i32",
                                          block_expert_ptr="*i32", swiglu_alpha="fp32", swiglu_limit="fp32"),
                    dict(TOP_K=2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, DOT_F32=False, PRECISION=None, HAS_BIAS=False,
                         SWIGLU=False)),
    "moe_down": (_down_kernel, dict(act_ptr=BF16, w_ptr=BF16, out_ptr=BF16, weights_ptr="*fp32", bias_ptr=BF16,
                                    sorted_pairs_ptr="*i32", block_expert_ptr="*i32"),
                 dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, DOT_F32=False, PRECISION=None, HAS_BIAS=False)),
    # gpt-oss's experts: biases and the clamped SwiGLU
    "moe_gate_up_gpt_oss": (_gate_up_kernel, dict(x_ptr=BF16, w_ptr=BF16, out_ptr=BF16, bias_ptr=BF16,
                                                  sorted_pairs_ptr="*i32", block_expert_ptr="*i32",
                                                  swiglu_alpha="fp32", swiglu_limit="fp32"),
                            dict(TOP_K=4, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, DOT_F32=False, PRECISION=None,
                                 HAS_BIAS=True, SWIGLU=True)),
    "moe_down_gpt_oss": (_down_kernel, dict(act_ptr=BF16, w_ptr=BF16, out_ptr=BF16, weights_ptr="*fp32",
                                            bias_ptr=BF16, sorted_pairs_ptr="*i32", block_expert_ptr="*i32"),
                         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, DOT_F32=False, PRECISION=None, HAS_BIAS=True)),
    # Compressed BF16 weights: 1024-element chunks, 128 lanes a program.
    "bf16_decode": (_bf16_decode_kernel, dict(stream_ptr="*i16", offsets_ptr="*i64", table_ptr="*i32",
                                              sign_mantissa_ptr="*u8", out_ptr="*i32", n_elements="i64"),
                    dict(CHUNK=1024, LANES=128)),
    "write_kv": (_write_kv_kernel, dict(k_ptr=BF16, v_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16,
                                        slot_mapping_ptr="*i64"), dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128)),
}


NO_TOOLCHAIN = 3  # child's exit status when this platform's triton has no ptxas


def compile_all() -> None:
    for name, (kernel, types, constexprs) in CASES.items():
        signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=H100)
        except (FileNotFoundError, PermissionError) as exc:
            print(f"no CUDA toolchain to compile with: {exc}")
            sys.exit(NO_TOOLCHAIN)
        shared = compiled.metadata.shared
        print(name, "cubin bytes", len(compiled.asm["cubin"]), "shared bytes", shared)
        if shared > H100_SHARED_BYTES:
            sys.exit(f"{name} needs {shared} bytes of shared memory; an H100 block has {H100_SHARED_BYTES}")


def test_kernels_compile_for_h100():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=repo)
    if result.returncode == NO_TOOLCHAIN:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("cubin bytes") == len(CASES)


if __name__ == "__main__":
    compile_all()
