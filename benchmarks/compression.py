"""Lossless BF16 compression on CPU: sizes, entropy, encode/decode speed, load time, decode-step cost.

On a random-init bf16 Llama-shaped checkpoint (weights normal with sigma = initializer_range, 0.02;
MLP a realistic ~65% of the weights) and on the demo model (float32, converted to bf16 by
`compress`):

- measured exponent entropy vs the bits per exponent the stream achieves, per tensor group;
- size per tensor group and whole model, bf16 vs compressed (targets: MLP >= 28% smaller, whole
  model >= 15% smaller, bit-exact);
- encode and decode throughput in GB/s, counted as bytes of bf16 tensor (input for the encoder,
  output for the decoder; the decoder writes into a reused buffer, as compressed_in_memory does)
  (target: decode >= 1 GB/s), for the native and the torch CPU decoders side by side, with the CPU
  time per GB each spends (on a loaded machine the wall figures share the cores; CPU time per GB
  predicts the quiet figure: threads / CPU-s per GB);
- load time from disk, plain vs compressed (both modes; the page cache is warm for both);
- decode-step time, plain vs compressed_in_memory, at batch 1 and 32 (the CPU engine computes in
  float32, so compressed_in_memory also saves float32 MLP weights: 4 bytes a weight).

    .venv/bin/python benchmarks/compression.py [--hidden 1024 --intermediate 4096 --layers 8 --vocab 16000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.compression.checkpoint import CompressedCheckpoint  # noqa: E402
from engine.compression.compress import compress_checkpoint, tensor_group  # noqa: E402
from engine.compression.encoder import compress_tensor  # noqa: E402
from engine.compression import native_decoder, torch_decoder  # noqa: E402
from engine.compression.decode import decompress_into  # noqa: E402
from engine.compression.tables import pair_table  # noqa: E402
from engine.loader import checkpoint_files  # noqa: E402

TARGET_MLP, TARGET_MODEL, TARGET_DECODE_GBS = 0.28, 0.15, 1.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_random_checkpoint(directory: Path, hidden: int, intermediate: int, layers: int, vocab: int) -> None:
    """A bf16 Llama checkpoint initialized as transformers does: normal(0, initializer_range) weights."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "hidden_act": "silu", "initializer_range": 0.02, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * config["initializer_range"]).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(heads * 64, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * 64, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * 64, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * 64),
            p + "mlp.gate_proj.weight": normal(intermediate, hidden),
            p + "mlp.up_proj.weight": normal(intermediate, hidden),
            p + "mlp.down_proj.weight": normal(hidden, intermediate),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def exponent_entropy(tensors: list[torch.Tensor]) -> float:
    """Shannon entropy (bits) of the bf16 exponents of the tensors together."""
    hist = torch.zeros(256, dtype=torch.float64)
    for t in tensors:
        hist += torch.bincount(((t.reshape(-1).view(torch.int16) >> 7) & 0xFF).to(torch.uint8), minlength=256).double()
    p = hist[hist > 0] / hist.sum()
    return float(-(p * p.log2()).sum())


def entropy_table(model_dir: Path, compressed_dir: Path) -> list[str]:
    """Per group: exponent entropy of the source vs bits per exponent spent by the compressed copy
    (stream + escape rows + chunk index + palette, per element: everything but the sign/mantissa byte)."""
    from safetensors import safe_open

    source = {}
    for name, path in checkpoint_files(model_dir).items():
        with safe_open(str(path), framework="pt") as handle:
            source[name] = handle.get_tensor(name).to(torch.bfloat16)
    checkpoint = CompressedCheckpoint(compressed_dir, checkpoint_files(compressed_dir))
    lines = [f"{'group':<12}{'entropy':>9}{'achieved':>10}{'(stream only)':>15}   bits per exponent, compressed tensors"]
    groups = sorted({tensor_group(n) for n in checkpoint.compressed})
    for group in groups:
        names = [n for n in checkpoint.compressed if tensor_group(n) == group]
        parts = [checkpoint.read_compressed(n) for n in names]
        elements = sum(t.numel for t in parts)
        stream_bits = sum(t.exponent_stream.numel() * 16 for t in parts)
        other_bits = sum(8 * (t.nbytes - t.sign_mantissa.numel() - 2 * t.exponent_stream.numel()) for t in parts)
        lines.append(f"{group:<12}{exponent_entropy([source[n] for n in names]):>9.3f}"
                     f"{(stream_bits + other_bits) / elements:>10.3f}{stream_bits / elements:>15.3f}")
    return lines


@dataclass(slots=True)
class DecodeSpeed:
    threads: float          # GB/s of bf16 output, all decode threads
    one_thread: float       # GB/s, one thread
    cpu_s_per_gb: float     # CPU-seconds of the process per GB of output, one thread (load-independent-ish)
    cpu_s_per_gb_threads: float   # the same with all threads (includes any hand-off cost)


def codec_throughput(compressed_dir: Path, repeats: int) -> tuple[float, dict[str, DecodeSpeed], int]:
    """(encode GB/s, decode speed per CPU decoder, MLP bytes) over the MLP tensors: bf16 bytes per second;
    decode into a reused output buffer, as compressed_in_memory does. Both decoders in the same run."""
    checkpoint = CompressedCheckpoint(compressed_dir, checkpoint_files(compressed_dir))
    names = [n for n in checkpoint.compressed if tensor_group(n) == "mlp"]
    tensors = [checkpoint.read_compressed(n) for n in names]
    originals = [checkpoint.read(n) for n in names]
    total = sum(2 * t.numel for t in tensors)
    started = time.perf_counter()
    for name, original in zip(names, originals):
        compress_tensor(name, original)
    encode = total / (time.perf_counter() - started) / 1e9
    tables = [pair_table(t.palette, t.code_lengths) for t in tensors]   # the torch decoder's, built once
    out = torch.empty(max(t.numel for t in tensors), dtype=torch.int16)

    def decode_all(decoder) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for t, table in zip(tensors, tables):
            decompress_into(t, out[: t.numel], table, decoder=decoder)
        return time.perf_counter() - wall, time.process_time() - cpu

    speeds = {}
    threads = torch.get_num_threads()
    for label, decoder in (("native", native_decoder), ("torch", torch_decoder)):
        if label == "native" and not native_decoder.available():
            log(f"native decoder not built ({native_decoder.MISSING}): skipped")
            continue
        passes = repeats if label == "native" else max(1, repeats // 2)   # the torch decoder is 5x slower
        decode_all(decoder)
        many = [decode_all(decoder) for _ in range(passes)]
        torch.set_num_threads(1)
        try:
            one = [decode_all(decoder) for _ in range(passes)]
        finally:
            torch.set_num_threads(threads)
        speeds[label] = DecodeSpeed(total / min(w for w, _ in many) / 1e9, total / min(w for w, _ in one) / 1e9,
                                    min(c for _, c in one) / (total / 1e9), min(c for _, c in many) / (total / 1e9))
        for t, original in zip(tensors, originals):   # the timed decodes were real: check them
            decompress_into(t, out[: t.numel], decoder=decoder)
            assert torch.equal(out[: t.numel], original.reshape(-1).view(torch.int16)), (label, t.name)
    return encode, speeds, total


def load_times(plain: Path, compressed: Path) -> dict[str, float]:
    from engine.config import load_config
    from engine.loader import load_model

    config = load_config(plain)
    runs = {"plain": (plain, "decompress_on_load"), "compressed, decompress_on_load": (compressed, "decompress_on_load"),
            "compressed, compressed_in_memory": (compressed, "compressed_in_memory")}
    times = {}
    for label, (directory, mode) in runs.items():
        samples = []
        for _ in range(2):   # the first read warms the page cache for both
            started = time.perf_counter()
            load_model(directory, config, torch.device("cpu"), torch.float32, show_progress=False, weight_mode=mode)
            samples.append(time.perf_counter() - started)
        times[label] = min(samples)
    return times


def step_times(directory: Path, mode: str, batch: int, steps: int) -> tuple[float, int]:
    """(median seconds per decode step at `batch` sequences, KV blocks) for an engine in `mode`."""
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=256 << 20, show_progress=False, weight_mode=mode,
                                               max_num_seqs=max(batch, 1), max_num_batched_tokens=2048))
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [3 + (i + j) % 500 for j in range(16)], params)
    engine.step()   # the prefill of all prompts
    samples = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[1:]), engine.stats().num_blocks_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--repeats", type=int, default=3, help="decode passes over the MLP tensors (best counts)")
    parser.add_argument("--decode-steps", type=int, default=5, help="timed decode steps per engine and batch")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    import os
    log(f"CPU threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="edgefire-compression-") as tmp:
        tmp = Path(tmp)
        plain, compressed = tmp / "random-bf16", tmp / "random-bf16.compressed"
        log(f"building a random bf16 Llama: hidden {args.hidden}, intermediate {args.intermediate}, "
            f"{args.layers} layers, vocab {args.vocab}")
        build_random_checkpoint(plain, args.hidden, args.intermediate, args.layers, args.vocab)
        report = compress_checkpoint(plain, compressed, show_progress=False, say=log)
        total, mlp = report.total, report.groups["mlp"]
        print(f"\n== random-init checkpoint (sigma 0.02): sizes, compressed by `edgefire compress` in {report.seconds:.1f} s "
              f"(incl. the read-back verification)")
        print(report.table())
        print("\n".join(["", *entropy_table(plain, compressed)]))
        encode, speeds, mlp_bytes = codec_throughput(compressed, args.repeats)
        threads = torch.get_num_threads()
        print(f"\n== throughput over the MLP tensors ({mlp_bytes / 2**20:.0f} MiB of bf16), GB/s of bf16 data")
        print(f"encode {encode:.3f} GB/s")
        print(f"{'decoder':<9}{f'{threads} threads':>12}{'1 thread':>11}{'CPU s/GB, 1 thread':>21}"
              f"{f'CPU s/GB, {threads} threads':>23}{'predicted quiet':>17}")
        for label, speed in speeds.items():
            # A quiet machine runs each thread at 1 / (CPU s per GB) GB/s: the wall figures here share the cores.
            print(f"{label:<9}{speed.threads:>12.2f}{speed.one_thread:>11.2f}{speed.cpu_s_per_gb:>21.3f}"
                  f"{speed.cpu_s_per_gb_threads:>23.3f}{threads / speed.cpu_s_per_gb_threads:>17.2f}")
        decode = speeds["native" if "native" in speeds else "torch"].threads
        print("\n== load from disk (warm page cache), float32 on CPU")
        disk = {"plain": sum(p.stat().st_size for p in plain.glob("*.safetensors")),
                "compressed": sum(p.stat().st_size for p in compressed.glob("*.safetensors"))}
        print(f"weight files: plain {disk['plain'] / 2**20:.1f} MiB, compressed {disk['compressed'] / 2**20:.1f} MiB "
              f"({1 - disk['compressed'] / disk['plain']:.1%} fewer bytes to read)")
        for label, seconds in load_times(plain, compressed).items():
            print(f"{label:<36}{seconds:>8.2f} s")
        print("\n== decode step on CPU (median, ms), plain vs compressed_in_memory")
        for batch in (1, 32):
            base, blocks = step_times(plain, "decompress_on_load", batch, args.decode_steps)
            streamed, streamed_blocks = step_times(compressed, "compressed_in_memory", batch, args.decode_steps)
            print(f"batch {batch:>2}: plain {base * 1e3:8.1f} | compressed_in_memory {streamed * 1e3:8.1f} "
                  f"({streamed / base:.2f}x) | KV blocks {blocks} -> {streamed_blocks}")
        if not args.skip_demo:
            from engine.demo import make_demo_model
            demo = make_demo_model(tmp / "demo", "small")
            demo_report = compress_checkpoint(demo, tmp / "demo.compressed", show_progress=False, say=log)
            print("\n== demo model (small; float32 weights of several sigmas, converted to bf16)")
            print(demo_report.table())
            print("\n".join(["", *entropy_table(demo, tmp / "demo.compressed")]))
        print("\n== targets")
        print(f"MLP weights {mlp.saving:.1%} smaller (target >= {TARGET_MLP:.0%}): {'met' if mlp.saving >= TARGET_MLP else 'MISSED'}")
        print(f"whole model {total.saving:.1%} smaller (target >= {TARGET_MODEL:.0%}): "
              f"{'met' if total.saving >= TARGET_MODEL else 'MISSED'}")
        print(f"CPU decode {decode:.2f} GB/s with {threads} threads, {next(iter(speeds))} decoder "
              f"(target >= {TARGET_DECODE_GBS:.0f} GB/s): {'met' if decode >= TARGET_DECODE_GBS else 'MISSED'}")
        print("bit-exact: every tensor verified by `compress` on read-back; the decode timing's output checked")
        print("GPU (batch-1 cost of compressed_in_memory with the Triton decoder): not run, no GPU here")
        log(f"done, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
