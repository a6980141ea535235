"""Engine vs transformers on CPU: the same batch of requests through both, in alternating rounds.

The batch is what a server sees: 32 requests with prompts of different lengths wanting answers
of different lengths. transformers gets all of them in one left-padded `generate` call (its most
efficient use) and must run until the longest answer is done; the engine batches continuously,
so finished requests leave the batch. Throughput counts only the tokens each request asked for.

Honest by construction: the two run in alternating rounds (engine, transformers, engine, ...), so
a change in the machine's load hits both; the result is the median of the per-round ratios; the
1-minute load average is printed before the run and with every round, and the verdict says whether
the machine was quiet (load under 1.5 before the run) -- under load transformers slows more than the
engine, which flatters the ratio. CPU seconds are printed beside wall seconds.

Then the engine's step at a steady decode batch (32 and 64 sequences): milliseconds per step split
into scheduling, input preparation, forward (the model and the sampled rows' logits), sampling and
output handling. Host overhead is everything but the forward.

    .venv/bin/python benchmarks/engine_cpu.py [--rounds 3] [--requests 32] [--hidden 512] [--layers 8] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUIET_LOAD = 1.5


def load_average() -> float:
    return os.getloadavg()[0]


def verdict(load_before: float, peak_load: float) -> str:
    """Whether a run's figures stand: quiet before it, and no more load during it than its own threads
    give (about one per CPU) with the same margin: a job that started meanwhile makes it LOADED."""
    quiet = load_before < QUIET_LOAD and peak_load < (os.cpu_count() or 1) + QUIET_LOAD
    return (f"machine: load {load_before:.2f} before the run, {peak_load:.2f} at most during it -> "
            + ("quiet: the figures stand" if quiet else "LOADED: figures not valid for the targets"))


def start_run(threads: int) -> float:
    """Set torch's threads (0: its default) and print the load the run starts under; returns that load."""
    if threads:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    load_before = load_average()
    print(f"1-minute load average before the run: {load_before:.2f} on {os.cpu_count()} CPUs "
          f"({'quiet' if load_before < QUIET_LOAD else 'LOADED'}); torch threads {torch.get_num_threads()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    return load_before


def build_checkpoint(directory: str, hidden: int, layers: int, vocab: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 128), intermediate_size=int(hidden * 2.75) // 16 * 16,
                         vocab_size=vocab, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(directory)


def make_requests(num: int, vocab: int) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(1)
    requests = []
    for i in range(num):
        prompt_len = int(torch.randint(16, 256, (1,), generator=generator))
        max_tokens = int(torch.randint(8, 128, (1,), generator=generator))
        requests.append((torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(), max_tokens))
    return requests


def new_engine(directory: str, **options):
    """The benchmark's engine; `options` override EngineConfig fields (benchmarks/moe.py: expert parallelism)."""
    from engine.engine import EngineConfig, LLMEngine

    return LLMEngine(directory, EngineConfig(**{"kv_cache_bytes": 1 << 30, "show_progress": False,
                                                "max_num_batched_tokens": 1024, "max_num_seqs": 64, **options}))


def run_greedy(engine, requests: list[tuple[list[int], int]]) -> tuple[list[list[int]], int]:
    """Every request at once, greedy, to the end: (each request's tokens, engine steps taken)."""
    from engine.sampling import SamplingParams

    outputs = {str(i): [] for i in range(len(requests))}
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
        steps += 1
    return [outputs[str(i)] for i in range(len(requests))], steps


def run_engine(directory: str, requests: list[tuple[list[int], int]], **options) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, CPU seconds, tokens) of one run on a fresh engine (an empty prefix cache)."""
    engine = new_engine(directory, **options)
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs, _steps = run_greedy(engine, requests)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    engine.shutdown()  # a multi-rank engine's worker processes (a single-process engine has none)
    return wall, cpu, outputs


def run_transformers(model, requests: list[tuple[list[int], int]]) -> tuple[float, float, list[list[int]]]:
    longest = max(len(p) for p, _ in requests)
    input_ids = torch.zeros((len(requests), longest), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(requests):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention[row, longest - len(prompt):] = 1
    started, cpu_started = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                             max_new_tokens=max(m for _, m in requests), eos_token_id=None, pad_token_id=0)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return wall, cpu, [out[row, longest:longest + m].tolist() for row, (_, m) in enumerate(requests)]


def step_profile(directory: str, batch: int, vocab: int, num_steps: int):
    """Per-step phase seconds over num_steps decode steps of `batch` running sequences (prompts of
    64-191 tokens, so contexts differ as a server's do)."""
    from engine.sampling import SamplingParams

    engine = new_engine(directory)
    generator = torch.Generator().manual_seed(2)
    for i in range(batch):
        prompt_len = int(torch.randint(64, 192, (1,), generator=generator))
        engine.add_request(f"p{i}", torch.randint(3, vocab, (prompt_len,), generator=generator).tolist(),
                           SamplingParams(max_tokens=num_steps + 64, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    before = engine.step_phases.copy()
    cpu_started = time.process_time()
    for _ in range(num_steps):
        engine.step()
    cpu = (time.process_time() - cpu_started) / num_steps
    return engine.step_phases.minus(before), cpu


def print_profile(batch: int, phases, cpu_per_step: float) -> None:
    n = phases.num_steps
    ms = {name: 1000 * getattr(phases, name) / n for name in ("schedule", "prepare", "forward", "sample", "output")}
    total = 1000 * phases.total / n
    host = 1000 * phases.host / n
    parts = "  ".join(f"{name} {value:.2f}" for name, value in ms.items())
    print(f"batch {batch:3}: {total:7.2f} ms/step ({cpu_per_step * 1000:.2f} CPU ms)  {parts}  "
          f"host overhead {host:.2f} ms = {100 * host / total:.1f}% of the step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--profile-batches", default="32,64", help="decode batches to split a step's time for")
    parser.add_argument("--profile-steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both sides (default: torch's choice)")
    args = parser.parse_args()
    load_before = start_run(args.threads)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        print(f"building a random-weight Llama (hidden {args.hidden}, {args.layers} layers) ...", flush=True)
        build_checkpoint(directory, args.hidden, args.layers, args.vocab)
        requests = make_requests(args.requests, args.vocab)
        useful = sum(m for _, m in requests)
        print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {useful} output tokens",
              flush=True)
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        run_engine(directory, requests[:2])  # first-call costs (thread pool, allocator) out of round 1
        rows, ratios, same = [], [], 0
        for round_index in range(1, args.rounds + 1):
            ours_s, ours_cpu, ours = run_engine(directory, requests)
            theirs_s, theirs_cpu, theirs = run_transformers(reference, requests)
            same = sum(a == b for a, b in zip(ours, theirs))
            ratios.append(theirs_s / ours_s)
            rows.append((round_index, ours_s, ours_cpu, theirs_s, theirs_cpu, load_average()))
            print(f"round {round_index}: edgefire {ours_s:.2f} s ({useful / ours_s:.1f} tokens/s), transformers "
                  f"{theirs_s:.2f} s ({useful / theirs_s:.1f} tokens/s), {ratios[-1]:.2f}x; "
                  f"load {rows[-1][-1]:.2f}", flush=True)
        print(f"\n{'round':>5}{'edgefire s':>12}{'CPU s':>8}{'tokens/s':>10}{'transformers s':>16}{'CPU s':>8}"
              f"{'tokens/s':>10}{'ratio':>8}{'load':>7}")
        for (index, ours_s, ours_cpu, theirs_s, theirs_cpu, load), ratio in zip(rows, ratios):
            print(f"{index:>5}{ours_s:12.2f}{ours_cpu:8.2f}{useful / ours_s:10.1f}{theirs_s:16.2f}{theirs_cpu:8.2f}"
                  f"{useful / theirs_s:10.1f}{ratio:8.2f}{load:7.2f}")
        median = statistics.median(ratios)
        print(f"median speed-up {median:.2f}x over {len(ratios)} alternating rounds "
              f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x); identical greedy outputs: {same}/{len(requests)}")
        print(verdict(load_before, max(row[-1] for row in rows)))
        print("\nengine step at a steady decode batch (milliseconds per step; host overhead = all but forward):")
        for batch in (int(b) for b in args.profile_batches.split(",") if b):
            phases, cpu = step_profile(directory, batch, args.vocab, args.profile_steps)
            print_profile(batch, phases, cpu)
        print(f"1-minute load average after the run: {load_average():.2f}")


if __name__ == "__main__":
    main()
