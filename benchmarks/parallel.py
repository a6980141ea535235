"""Tensor and pipeline parallelism on CPU: one process with 2 threads vs tp=2 vs pp=2 (1 thread per
rank), the same checkpoint and requests, in one run.

Each configuration serves the same batch of requests (benchmarks/engine_cpu.py's: prompts of
16-255 tokens, answers of 8-127, all arriving at once) to the end, after one untimed warm-up request; the
configurations take turns for --rounds rounds, so a change in the machine's load hits them
alike, and the medians are printed. Printed per configuration: output tokens/s,
the mean time of one engine step, and per rank the share of its busy time spent inside
torch.distributed calls (all-reduces, step messages, hidden states, logits; waiting on a peer that
is still computing counts, as it does in any such measurement). Greedy tokens must equal the
single-process run's. Then the LM head, measured at full and half vocabulary on one thread: the
step time vocab-parallel heads save (engine.parallel.layout).

On CPU, 2 ranks on 2 cores add communication and split work that one 2-thread process already
splits; the point is to see what the runtime costs. With 2 or more GPUs it also measures decode
tokens/s of tp=1/2/4 (as many as there are GPUs) on a Llama-3.1-8B-shaped random bf16 checkpoint
(benchmarks/engine_gpu.py's); with fewer, that part is skipped and nothing is estimated.

    .venv/bin/python benchmarks/parallel.py [--requests 16] [--hidden 512] [--layers 8] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["EDGEFIRE_PARALLEL_TIMING"] = "1"  # before engine.parallel is imported: per-rank timings

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cpu import build_checkpoint, make_requests, run_greedy  # noqa: E402  the same checkpoint and requests


def run(directory: str, requests, tp: int, pp: int, threads: int) -> dict:
    from engine.engine import EngineConfig, LLMEngine
    from engine.parallel import timing
    from engine.sampling import SamplingParams

    torch.set_num_threads(threads)  # a parallel engine gives each of its ranks an equal share of these
    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=256 << 20, show_progress=False, max_num_batched_tokens=512,
                                               max_num_seqs=64, tensor_parallel_size=tp, pipeline_parallel_size=pp))
    threads = torch.get_num_threads()
    engine.add_request("warm-up", requests[0][0][:16], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    timing.TIMES.steps, timing.TIMES.step_s, timing.TIMES.comm_s = 0, 0.0, 0.0
    started = time.perf_counter()
    outputs, steps = run_greedy(engine, requests)
    elapsed = time.perf_counter() - started
    engine.shutdown()
    ranks = getattr(engine.executor, "rank_times", {})  # the workers' times include the warm-up
    return {"seconds": elapsed, "steps": steps, "threads": threads, "outputs": outputs,
            "comm": {rank: t["comm_s"] / t["step_s"] for rank, t in sorted(ranks.items()) if t["step_s"]}}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time; every run's outputs must agree."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    median = ordered[len(ordered) // 2]
    return {**median, "outputs": median["outputs"] if all(r["outputs"] == runs[0]["outputs"] for r in runs) else None}


def lm_head_split(hidden: int, vocab: int, rows: int, repeats: int = 20) -> tuple[float, float]:
    """ms per LM-head matmul of `rows` hidden states at full and half vocabulary, on one thread."""
    torch.set_num_threads(1)
    x, head = torch.randn(rows, hidden), torch.randn(vocab, hidden)
    result = []
    for weight in (head, head[: vocab // 2]):
        x @ weight.T
        started = time.perf_counter()
        for _ in range(repeats):
            x @ weight.T
        result.append((time.perf_counter() - started) / repeats * 1000)
    return result[0], result[1]


def gpu_tensor_parallel(layers: int) -> None:
    """Decode tokens/s at batch 1, 8 and 64 for tp=1, 2, 4 (up to the GPUs present)."""
    from benchmarks.engine_gpu import DECODE_BATCHES, build_checkpoint as build_8b, engine_decode
    from engine.engine import EngineConfig, LLMEngine

    sizes = [tp for tp in (1, 2, 4) if tp <= torch.cuda.device_count()]
    with tempfile.TemporaryDirectory() as directory:
        print(f"\nGPU: building a {layers}-layer Llama-3.1-8B-shaped bf16 checkpoint ...", flush=True)
        build_8b(Path(directory), layers)
        print(f"{'':8}" + "".join(f"{f'batch {b} tok/s':>18}" for b in DECODE_BATCHES), flush=True)
        for tp in sizes:
            engine = LLMEngine(directory, EngineConfig(dtype="bfloat16", max_num_seqs=max(DECODE_BATCHES),
                                                       show_progress=False, tensor_parallel_size=tp))
            rates = [engine_decode(engine, batch).tokens_per_s for batch in DECODE_BATCHES]
            engine.shutdown()
            print(f"tp={tp:<5}" + "".join(f"{rate:18.1f}" for rate in rates), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3, help="each configuration runs once per round, in turn")
    parser.add_argument("--gpu-layers", type=int, default=32, help="GPU part: decoder layers (32 = Llama-3.1-8B)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # (name, tp, pp, threads of the process that makes the engine); 1 process with 1 thread is for context:
    # on a busy 2-core machine the 2 threads of one process wait on each other far more than 2 processes do
    configs = [("1 process, 2 threads", 1, 1, 2), ("tp=2, 1 thread/rank", 2, 1, 2), ("pp=2, 1 thread/rank", 1, 2, 2),
               ("1 process, 1 thread", 1, 1, 1)]
    with tempfile.TemporaryDirectory() as directory:
        print(f"building a random-weight Llama (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}) ...",
              flush=True)
        build_checkpoint(directory, args.hidden, args.layers, args.vocab)
        requests = make_requests(args.requests, args.vocab)
        useful = sum(m for _, m in requests)
        print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {useful} output tokens; "
              f"{os.cpu_count()} CPUs", flush=True)
        runs: dict[str, list[dict]] = {name: [] for name, *_ in configs}
        for round_number in range(1, args.rounds + 1):
            for name, tp, pp, threads in configs:
                print(f"round {round_number}/{args.rounds}: {name} ...", flush=True)
                runs[name].append(run(directory, requests, tp, pp, threads))
    results = [(name, _median_run(runs[name])) for name, *_ in configs]
    reference = results[0][1]["outputs"]
    print(f"\nmedian of {args.rounds} rounds; load average now {os.getloadavg()[0]:.1f}")
    print(f"{'':22}{'threads/rank':>13}{'tokens/s':>10}{'steps':>7}{'ms/step':>9}  comm share of busy time per rank")
    for name, r in results:
        comm = ", ".join(f"rank {rank} {share:.0%}" for rank, share in r["comm"].items()) or "-"
        same = "" if r["outputs"] == reference else "   GREEDY TOKENS DIFFER"
        print(f"{name:22}{r['threads']:>13}{useful / r['seconds']:10.1f}{r['steps']:7}"
              f"{1000 * r['seconds'] / r['steps']:9.2f}  {comm}{same}")
    full, half = lm_head_split(args.hidden, args.vocab, rows=args.requests)
    print(f"\nLM head, {args.requests} rows x vocab {args.vocab}, 1 thread: {full:.2f} ms whole (replicated: one rank "
          f"does it), {half:.2f} ms per rank at vocab/2 (vocab-parallel)")
    if torch.cuda.device_count() >= 2:
        gpu_tensor_parallel(args.gpu_layers)
    else:
        print(f"GPU tp=1/2/4 (8B-shaped bf16): skipped, {torch.cuda.device_count()} GPU(s) on this machine")


if __name__ == "__main__":
    main()
