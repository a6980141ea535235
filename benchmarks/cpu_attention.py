"""Decode attention on the CPU: the C loop over the paged cache in place (engine.cpu_attention) vs the
torch path (gather each group's blocks, then scaled_dot_product_attention), on the same batch, in
alternating rounds of one run, and both against the memory-traffic floor.

A decode step's attention reads every key and value of every running sequence once per layer; the
torch path reads them, writes a gathered copy and reads that again. The printed floor is the bytes
the C loop must read, at the bandwidth this run measures for a plain one-pass read of the same size.
Then whole engine runs with either path (benchmarks/engine_cpu.py's 32 requests on its dense
checkpoint and on benchmarks/moe.py's MoE checkpoint), alternating, say what it is worth end to end.

`--baseline PATH` adds another build of the extension (say the `_cpu_attention*.so` of an earlier
commit, kept aside before `make install` rebuilt it) to the same alternating rounds of the per-call
table, so a change to the C loop is measured against what it replaces in one run.

    .venv/bin/python benchmarks/cpu_attention.py [--rounds 7] [--engine-rounds 4] [--threads N] [--baseline SO]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import engine_cpu, moe  # noqa: E402
from benchmarks.engine_cpu import load_average, start_run, verdict  # noqa: E402
from engine import cpu_attention, ops  # noqa: E402

# (sequences, shortest and longest context, query heads, KV heads, head size): the MoE and dense
# benchmark models' attention (8 heads over 4 KV heads of 64) at a few batches, an 8B-shaped layer, and
# the `small` demo model's (8 over 4 of 32) at contexts up to 1,500 tokens.
SHAPES = [(8, 100, 300, 8, 4, 64), (32, 100, 300, 8, 4, 64), (32, 800, 1200, 8, 4, 64), (16, 200, 600, 32, 8, 128),
          (7, 130, 1500, 8, 4, 32)]
BLOCK_SIZE = 16


def decode_batch(num_seqs: int, shortest: int, longest: int, num_heads: int, num_kv_heads: int, head_dim: int):
    generator = torch.Generator().manual_seed(0)
    lens = torch.randint(shortest, longest + 1, (num_seqs,), generator=generator).tolist()
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    order = torch.randperm(sum(blocks), generator=generator).tolist()  # blocks scattered, as a served cache's are
    tables = torch.zeros((num_seqs, max(blocks)), dtype=torch.int64)
    for row, count in enumerate(blocks):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)])
    shape = (sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, tables, lens


def attend(q, k_cache, v_cache, tables, lens) -> torch.Tensor:
    batch = ops.AttentionBatch(num_decode=len(lens), query_start=list(range(len(lens) + 1)), context_lens=lens,
                               block_tables=tables, decode_context_lens=torch.tensor(lens),
                               slot_mapping=torch.zeros(0, dtype=torch.int64))
    return ops.paged_attention(q, k_cache, v_cache, batch, q.shape[-1] ** -0.5, None)


def best_of(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def c_loop_vs_torch(module, attribute: str, run, floor, rounds: int, repeats: int, baseline=None) -> tuple:
    """run() with the C loop (module.attribute, the built extension), without it (None there: the torch
    path) and, given one, with the baseline build of the extension, and floor(), in alternating rounds:
    ({side: median over rounds of the fastest of `repeats` calls, in seconds}; {side: run()'s output})."""
    native = getattr(module, attribute)
    sides = [("c", native), ("torch", None)] + ([("baseline", baseline)] if baseline is not None else [])
    times: dict[str, list[float]] = {side: [] for side, _ in sides} | {"floor": []}
    outputs = {}
    try:
        for _ in range(rounds):
            for side, extension in sides:
                setattr(module, attribute, extension)
                outputs[side] = run()
                times[side].append(best_of(run, repeats))
            times["floor"].append(best_of(floor, repeats))
    finally:
        setattr(module, attribute, native)
    return {side: statistics.median(values) for side, values in times.items()}, outputs


def load_baseline(path: Path):
    """Another build of the extension, loaded beside the installed one."""
    spec = importlib.util.spec_from_file_location("baseline._cpu_attention", path)
    if spec is None or not path.is_file():
        sys.exit(f"--baseline {path}: not a built extension module (a _cpu_attention*.so file)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20, help="calls per side per round (the fastest counts)")
    parser.add_argument("--engine-rounds", type=int, default=4, help="whole engine runs per path (0: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--baseline", type=Path, help="another build of the extension (.so) to measure beside this one")
    args = parser.parse_args()
    if not cpu_attention.available():
        sys.exit(f"the C decode attention is not built ({cpu_attention.MISSING}); run `make install`")
    baseline = load_baseline(args.baseline) if args.baseline else None
    load_before = start_run(args.threads)
    print(f"{torch.get_num_threads()} threads, {args.rounds} alternating rounds, fastest of {args.repeats} calls per "
          f"side per round, median over rounds" + (f"; baseline build {args.baseline}" if baseline else ""))
    extra = " baseline build | this build vs baseline |" if baseline else ""
    print(f"\n| sequences | context | heads / KV heads x size | K+V read | C loop | torch path | speed-up "
          f"| C loop vs read floor |{extra}")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if baseline else ""))
    loads = []
    for num_seqs, shortest, longest, num_heads, num_kv_heads, head_dim in SHAPES:
        q, k_cache, v_cache, tables, lens = decode_batch(num_seqs, shortest, longest, num_heads, num_kv_heads, head_dim)
        kv_bytes = 2 * sum(lens) * num_kv_heads * head_dim * 4
        flat = torch.randn(kv_bytes // 4)
        seconds, outputs = c_loop_vs_torch(
            cpu_attention, "_cpu_attention", lambda: attend(q, k_cache, v_cache, tables, lens), flat.sum, args.rounds,
            args.repeats, baseline)
        for side in outputs:
            torch.testing.assert_close(outputs[side], outputs["torch"], rtol=1e-4, atol=1e-4)
        loads.append(load_average())
        c_s, torch_s = seconds["c"], seconds["torch"]
        against = (f" {seconds['baseline'] * 1e6:.0f} us | {seconds['baseline'] / c_s:.2f}x |" if baseline else "")
        print(f"| {num_seqs} | {shortest}-{longest} | {num_heads} / {num_kv_heads} x {head_dim} | "
              f"{kv_bytes / 2**20:.1f} MiB | {c_s * 1e6:.0f} us | {torch_s * 1e6:.0f} us | {torch_s / c_s:.2f}x | "
              f"{c_s / seconds['floor']:.2f}x |{against}")
    print(f"\nSame outputs on {'all three' if baseline else 'both'} paths (within 1e-4) at every shape.")
    if args.engine_rounds:
        loads.append(engine_runs(args.engine_rounds, cpu_attention, "_cpu_attention"))
    print(verdict(load_before, max(loads)))


def engine_runs(rounds: int, module, attribute: str) -> float:
    """Whole greedy runs of the engine on the dense and the MoE benchmark checkpoints, with the C loop
    (module.attribute, the extension) and without it (None there: the torch path), alternating; prints
    the medians and returns the load after the last round."""
    native = getattr(module, attribute)
    requests = engine_cpu.make_requests(32, 8192)
    print(f"\nWhole engine runs ({len(requests)} requests, {sum(m for _, m in requests)} output tokens), "
          f"{rounds} alternating rounds, median seconds:\n")
    print("| checkpoint | C loop | torch path | run time saved |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as dense, tempfile.TemporaryDirectory() as mixture:
        engine_cpu.build_checkpoint(dense, 512, 4, 8192)
        moe.build_checkpoint(mixture, "mixtral", 512, 4, 8, 2, 704, 8192)
        for name, directory in (("dense (engine_cpu.py)", dense), ("MoE (moe.py)", mixture)):
            engine_cpu.run_engine(directory, requests[:2])  # first-call costs out of the rounds
            seconds: dict[str, list[float]] = {"C loop": [], "torch path": []}
            outputs = {}
            for _ in range(rounds):
                for side in seconds:
                    setattr(module, attribute, native if side == "C loop" else None)
                    wall, _, outputs[side] = engine_cpu.run_engine(directory, requests)
                    seconds[side].append(wall)
            setattr(module, attribute, native)
            if outputs["C loop"] != outputs["torch path"]:
                sys.exit(f"{name}: the two paths' greedy tokens differ")
            c_s, torch_s = statistics.median(seconds["C loop"]), statistics.median(seconds["torch path"])
            print(f"| {name} | {c_s:.2f} s | {torch_s:.2f} s | {100 * (1 - c_s / torch_s):.1f}% |")
    print("\nIdentical greedy tokens on both paths.")
    return load_average()


if __name__ == "__main__":
    main()
