"""Mixture-of-experts engine vs transformers on CPU, and the engine with its experts split over 2
ranks (expert parallelism) vs on one: the same random-weight MoE checkpoint and the same requests,
in alternating rounds of one run.

The workload and the two sides are benchmarks/engine_cpu.py's: 32 requests with prompts and answers
of different lengths; transformers gets them in one left-padded `generate` (its most efficient use),
the engine batches continuously. Each round runs every side once (engine, transformers, ...), so a
change in the machine's load hits them alike; the result is the median of the per-round ratios,
with the load average beside every round. Throughput counts only the tokens each request asked for.

The expert-parallel engine (`--expert-parallel-size`, default 2; 1 leaves it out) runs its ranks as
processes of their own with torch's threads shared among them (engine.parallel), so it uses the
cores the one-process engine uses; each rank repeats attention and holds half the experts, and
every MoE layer costs an all-to-all exchange. Its greedy tokens must equal the one-process engine's.
Its start (the worker processes, loading) is outside the timed run, as the one-process engine's is.

The checkpoint is Mixtral-shaped by default (top-2 of 8 experts per layer; `--arch qwen3-moe` for
Qwen3-MoE with renormalized top-k). Its routers are drawn wide, so tokens really spread over the
experts and a decode step of a few dozen sequences touches every expert of every layer, as it does
in a served MoE.

    .venv/bin/python benchmarks/moe.py [--arch mixtral|qwen3-moe] [--rounds 3] [--requests 32] [--threads N]
        [--expert-parallel-size 2]

On a machine other jobs share, torch's default of one thread per core makes small matmuls wait for a
descheduled thread; `--threads 1` gives both sides one core and steadier figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cpu import (load_average, make_requests, run_engine, verdict,  # noqa: E402
                                   run_transformers, start_run)


def build_checkpoint(directory: str, arch: str, hidden: int, layers: int, experts: int, top_k: int,
                     expert_inter: int, vocab: int) -> None:
    import transformers

    torch.manual_seed(0)
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                 num_key_value_heads=max(1, hidden // 128), vocab_size=vocab, max_position_embeddings=2048,
                 num_experts_per_tok=top_k)
    if arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **shape, intermediate_size=expert_inter, num_local_experts=experts))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **shape, head_dim=64, intermediate_size=4 * expert_inter, moe_intermediate_size=expert_inter,
            num_experts=experts, norm_topk_prob=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):  # routers that spread tokens over the experts
                param.normal_(0.0, 0.5)
    model.save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="mixtral", choices=["mixtral", "qwen3-moe"])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-inter", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both sides (default: torch's choice)")
    parser.add_argument("--expert-parallel-size", type=int, default=2, metavar="E",
                        help="also run the engine with its experts split over E ranks (1: leave it out)")
    args = parser.parse_args()
    load_before = start_run(args.threads)
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        print(f"building a random-weight {args.arch} (hidden {args.hidden}, {args.layers} layers, top-{args.top_k} "
              f"of {args.experts} experts of width {args.expert_inter}) ...", flush=True)
        build_checkpoint(directory, args.arch, args.hidden, args.layers, args.experts, args.top_k,
                         args.expert_inter, args.vocab)
        requests = make_requests(args.requests, args.vocab)
        useful = sum(m for _, m in requests)
        print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {useful} output tokens",
              flush=True)
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        ep = args.expert_parallel_size
        expert_side = f"edgefire ep={ep}"
        sides = {"edgefire": lambda: run_engine(directory, requests),
                 "transformers": lambda: run_transformers(reference, requests)}
        if ep > 1:
            sides[expert_side] = lambda: run_engine(directory, requests, expert_parallel_size=ep)
        run_engine(directory, requests[:2])  # first-call costs (thread pool, allocator) out of round 1
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        ratios, expert_ratios, loads, same, same_ep = [], [], [], 0, 0
        for round_index in range(1, args.rounds + 1):
            outputs = {}
            for name, run in sides.items():
                wall, _, outputs[name] = run()
                seconds[name].append(wall)
            ratios.append(seconds["transformers"][-1] / seconds["edgefire"][-1])
            if ep > 1:
                expert_ratios.append(seconds["edgefire"][-1] / seconds[expert_side][-1])
                same_ep = sum(a == b for a, b in zip(outputs[expert_side], outputs["edgefire"]))
            loads.append(load_average())
            same = sum(a == b for a, b in zip(outputs["edgefire"], outputs["transformers"]))
            print(f"round {round_index}: " + ", ".join(f"{name} {seconds[name][-1]:.2f} s "
                                                        f"({useful / seconds[name][-1]:.1f} tokens/s)" for name in sides)
                  + f", {ratios[-1]:.2f}x; load {loads[-1]:.2f}", flush=True)
    print(f"\n{'side':14}{'median s':>10}{'tokens/s':>10}   per round (s)")
    for name, values in seconds.items():
        print(f"{name:14}{statistics.median(values):10.2f}{useful / statistics.median(values):10.1f}   "
              + " ".join(f"{v:.2f}" for v in values))
    median = statistics.median(ratios)
    print(f"median speed-up {median:.2f}x over {len(ratios)} alternating rounds (min {min(ratios):.2f}x, "
          f"max {max(ratios):.2f}x; target >= 2x); identical greedy outputs: {same}/{len(requests)}")
    if expert_ratios:
        print(f"ep={ep} vs ep=1: {statistics.median(expert_ratios):.2f}x the one-process engine's speed (median over "
              f"{len(expert_ratios)} rounds, min {min(expert_ratios):.2f}x, max {max(expert_ratios):.2f}x); "
              f"identical greedy outputs: {same_ep}/{len(requests)}")
    print(verdict(load_before, max(loads)))


if __name__ == "__main__":
    main()
