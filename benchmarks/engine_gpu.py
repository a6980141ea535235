"""Engine on one NVIDIA GPU, measured against the hardware limit and against transformers, in one run.

One script for one device call. It builds a Llama-3.1-8B-shaped checkpoint with random bf16
weights on the device machine, then, in order:

1. measures the device: copy bandwidth (read + write bytes of a large tensor copy) and the bf16
   matmul rate (a large square matmul);
2. engine decode tokens/s at batch 1, 8 and 64 with 1k-token contexts, and the bandwidth it
   achieves: bytes one decode step must move (every weight once, plus each sequence's K/V)
   divided by the step time, as a fraction of the measured copy bandwidth (target >= 0.8 at batch 1);
3. engine prefill tokens/s on 4k-token prompts, with the FLOPs that takes as a fraction of the
   measured matmul rate;
4. transformers `generate` on the same checkpoint, decode tokens/s at the same batches (target:
   engine >= 3x transformers at batch 64).

    python benchmarks/engine_gpu.py [--layers 32] [--model-dir DIR] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Llama-3.1-8B
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXT = 1024
DECODE_STEPS = 64
PREFILL_LEN = 4096
PREFILL_PROMPTS = 4


# -- checkpoint -------------------------------------------------------------------------------


def build_checkpoint(directory: Path, num_layers: int, device: str = "cuda") -> None:
    """Random bf16 weights (std 0.02, norms near 1) written as HF Llama safetensors, one shard per layer."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(**SHAPE, num_hidden_layers=num_layers).save_pretrained(directory)
    generator = torch.Generator(device=device).manual_seed(0)
    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    q_out, kv_out = SHAPE["num_attention_heads"] * d, SHAPE["num_key_value_heads"] * d

    def rand(*shape, norm=False):
        t = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        return (1 + 0.05 * t if norm else 0.02 * t).to(torch.bfloat16).cpu()

    weight_map = {}

    def save(name: str, tensors: dict) -> None:
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})

    save("embed.safetensors", {"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h),
                               "lm_head.weight": rand(SHAPE["vocab_size"], h), "model.norm.weight": rand(h, norm=True)})
    for layer in range(num_layers):
        p = f"model.layers.{layer}."
        save(f"layer-{layer:03d}.safetensors", {
            p + "input_layernorm.weight": rand(h, norm=True),
            p + "post_attention_layernorm.weight": rand(h, norm=True),
            p + "self_attn.q_proj.weight": rand(q_out, h), p + "self_attn.k_proj.weight": rand(kv_out, h),
            p + "self_attn.v_proj.weight": rand(kv_out, h), p + "self_attn.o_proj.weight": rand(h, q_out),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        })
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -- the device's limits ----------------------------------------------------------------------


def timed(fn, repeats: int) -> float:
    """Seconds per call on the GPU (CUDA events, after one warm-up call)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def copy_bandwidth() -> float:
    """Bytes per second a device-to-device copy reads plus writes."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats=20)
    del src, dst
    return 2 * (2 << 30) / seconds


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 matmul."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = timed(lambda: a @ b, repeats=20)
    return 2 * n**3 / seconds


# -- engine -----------------------------------------------------------------------------------


@dataclass(slots=True)
class DecodeResult:
    batch: int
    tokens_per_s: float
    step_s: float
    bytes_per_step: int


def weight_bytes(model) -> int:
    """Bytes a decode step reads from the weights: every matrix once (embedding rows are negligible)."""
    w = model.weights
    tensors = [w.norm, w.lm_head] + [t for layer in w.layers for t in (
        layer.input_norm, layer.qkv, layer.o_proj, layer.post_norm, layer.gate_up, layer.down)]
    return sum(t.numel() * t.element_size() for t in tensors)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (count, length), generator=generator).tolist()


def engine_decode(engine, batch: int) -> DecodeResult:
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=DECODE_STEPS + 2, temperature=0, ignore_eos=True)
    for n, prompt in enumerate(random_prompts(batch, DECODE_CONTEXT, seed=batch)):
        engine.add_request(f"d{batch}-{n}", prompt, params)
    produced = 0
    while produced < batch:  # prefill every prompt (each yields its first token) before timing decode
        produced += len(engine.step())
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        assert len(engine.step()) == batch  # the step returns once its sampled tokens are on the host
    elapsed = time.perf_counter() - started
    while engine.has_work():
        engine.step()
    mc = engine.model_config
    kv_bytes = batch * (DECODE_CONTEXT + DECODE_STEPS // 2) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 2
    return DecodeResult(batch, batch * DECODE_STEPS / elapsed, elapsed / DECODE_STEPS,
                        weight_bytes(engine.model) + kv_bytes)


def engine_prefill(engine) -> tuple[float, float]:
    """(prompt tokens/s, FLOPs per prompt token) on PREFILL_PROMPTS prompts of PREFILL_LEN tokens."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = random_prompts(PREFILL_PROMPTS, PREFILL_LEN, seed=99)
    engine.add_request("warm", prompts[0][:512], params)  # first prefill compiles the prefill kernel
    while engine.has_work():
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add_request(f"p{n}", prompt, params)
    while engine.has_work():
        engine.step()
    elapsed = time.perf_counter() - started
    mc = engine.model_config
    linear = 2 * (weight_bytes(engine.model) // 2)  # 2 FLOPs per bf16 weight per token (lm_head: last token only, ~2%)
    attention = 2 * mc.num_layers * mc.num_heads * mc.head_dim * PREFILL_LEN  # causal QK^T + PV, averaged per token
    return PREFILL_PROMPTS * PREFILL_LEN / elapsed, linear + attention


# -- transformers -----------------------------------------------------------------------------


def transformers_decode(model, batch: int) -> float:
    """Decode tokens/s of `generate`: the time of DECODE_STEPS extra tokens beyond the prefill."""
    prompts = torch.tensor(random_prompts(batch, DECODE_CONTEXT, seed=batch), device="cuda")
    mask = torch.ones_like(prompts)

    def generate(new_tokens: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=prompts, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    generate(2)  # warm-up
    prefill_only = generate(1)
    total = generate(1 + DECODE_STEPS)
    return batch * DECODE_STEPS / max(total - prefill_only, 1e-9)


# -- report -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-3.1-8B)")
    parser.add_argument("--model-dir", type=Path, help="reuse a checkpoint built by an earlier run")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("engine_gpu.py measures the GPU fast path and needs a CUDA GPU; none is visible here. "
                 "For CPU numbers run benchmarks/engine_cpu.py.")
    from engine import kernels
    from engine.engine import EngineConfig, LLMEngine

    print(f"device: {torch.cuda.get_device_name()}, triton kernels: {kernels.available()}")
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    print(f"measured copy bandwidth {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.model_dir or Path(scratch)
        if not (directory / "config.json").is_file():
            started = time.perf_counter()
            build_checkpoint(directory, args.layers)
            print(f"built a {args.layers}-layer Llama-3.1-8B-shaped checkpoint in {time.perf_counter() - started:.0f} s")

        config = EngineConfig(dtype="bfloat16", max_num_seqs=max(DECODE_BATCHES), max_num_batched_tokens=PREFILL_LEN,
                              max_model_len=PREFILL_LEN + 64, enable_prefix_caching=False, show_progress=False)
        started = time.perf_counter()
        engine = LLMEngine(directory, config)
        print(f"engine ready in {time.perf_counter() - started:.0f} s (load, warm-up, KV sizing, graph capture): "
              f"{engine.block_manager.num_blocks} KV blocks, CUDA graphs: {engine.executor.decode_graphs is not None}")
        decode = [engine_decode(engine, batch) for batch in DECODE_BATCHES]
        prefill_rate, flops_per_token = engine_prefill(engine)
        del engine
        gc.collect()
        torch.cuda.empty_cache()

        hf_rates: dict[int, float] = {}
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda").eval()
            hf_rates = {batch: transformers_decode(model, batch) for batch in DECODE_BATCHES}
            del model

    print(f"\n{'batch':>5} {'engine tok/s':>13} {'step ms':>8} {'GB/step':>8} {'achieved GB/s':>14} "
          f"{'of copy bw':>10} {'transformers tok/s':>19} {'speed-up':>9}")
    for r in decode:
        achieved = r.bytes_per_step / r.step_s
        hf = hf_rates.get(r.batch)
        hf_cols = f"{hf:>19.1f} {r.tokens_per_s / hf:>8.2f}x" if hf else f"{'-':>19} {'-':>9}"
        print(f"{r.batch:>5} {r.tokens_per_s:>13.1f} {r.step_s * 1e3:>8.2f} {r.bytes_per_step / 1e9:>8.2f} "
              f"{achieved / 1e9:>14.0f} {achieved / bandwidth:>10.1%} {hf_cols}")
    prefill_fraction = prefill_rate * flops_per_token / flops
    print(f"\nprefill ({PREFILL_PROMPTS} x {PREFILL_LEN}-token prompts): {prefill_rate:.0f} tokens/s, "
          f"{prefill_rate * flops_per_token / 1e12:.0f} TFLOP/s = {prefill_fraction:.1%} of the measured matmul rate")
    batch1 = decode[0].bytes_per_step / decode[0].step_s / bandwidth
    print(f"target batch-1 decode >= 80% of copy bandwidth: {'met' if batch1 >= 0.8 else 'MISSED'} ({batch1:.1%})")
    if 64 in hf_rates:
        speedup = decode[-1].tokens_per_s / hf_rates[64]
        print(f"target >= 3x transformers at batch 64: {'met' if speedup >= 3 else 'MISSED'} ({speedup:.2f}x)")


if __name__ == "__main__":
    main()
