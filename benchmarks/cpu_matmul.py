"""A matmul of a few rows on the CPU: the C loop (engine.cpu_matmul) vs torch's matmul as ops.linear
ran it before (per-thread weight slabs), on the weight shapes of the benchmark models' decode steps,
in alternating rounds of one run, against the time a plain one-pass read of the weight takes; then
whole engine runs with and without the C loop (benchmarks/cpu_attention.py's engine_runs).

At a few rows a matmul's time is the weight streaming from memory: the floor is reading it once.

    .venv/bin/python benchmarks/cpu_matmul.py [--rounds 7] [--engine-rounds 4] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_attention import c_loop_vs_torch, engine_runs  # noqa: E402
from benchmarks.engine_cpu import load_average, start_run, verdict  # noqa: E402
from engine import cpu_matmul, ops  # noqa: E402

# (name, experts or layers multiplied per call group, out features, in features): the MoE benchmark
# model's 32 expert matmuls of a step (4 layers x 8 experts, gate+up then down) and the dense one's MLPs.
SHAPES = [("MoE experts gate+up", 32, 1408, 512), ("MoE experts down", 32, 512, 704),
          ("dense MLP gate+up", 4, 2816, 512), ("dense MLP down", 4, 512, 1408)]
ROWS = (2, 4, 8, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=10, help="calls per side per round (the fastest counts)")
    parser.add_argument("--engine-rounds", type=int, default=4, help="whole engine runs per path (0: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if not cpu_matmul.available():
        sys.exit(f"the C matmul is not built ({cpu_matmul.MISSING}); run `make install`")
    load_before = start_run(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds, fastest of {args.repeats} passes per "
          f"side per round, median over rounds; a pass multiplies every weight of the group once\n")
    print("| weights | rows | weight bytes | C loop | torch | speed-up | C loop vs read floor |")
    print("|---|---|---|---|---|---|---|")
    loads = []
    for name, count, out_features, in_features in SHAPES:
        generator = torch.Generator().manual_seed(0)
        weights = [torch.randn(out_features, in_features, generator=generator) * 0.05 for _ in range(count)]
        flat = torch.randn(count * out_features * in_features, generator=generator)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator)

            def run() -> None:
                for weight in weights:
                    ops.linear(x, weight)

            times, _ = c_loop_vs_torch(cpu_matmul, "_cpu_matmul", run, flat.sum, args.rounds, args.repeats)
            c_s, torch_s, floor_s = times["c"], times["torch"], times["floor"]
            print(f"| {name} ({count} x {out_features} x {in_features}) | {rows} | {flat.numel() * 4 / 2**20:.0f} MiB | "
                  f"{c_s * 1e3:.2f} ms | {torch_s * 1e3:.2f} ms | {torch_s / c_s:.2f}x | {c_s / floor_s:.2f}x |")
        loads.append(load_average())
    if args.engine_rounds:
        loads.append(engine_runs(args.engine_rounds, cpu_matmul, "_cpu_matmul"))
    print(verdict(load_before, max(loads)))


if __name__ == "__main__":
    main()
