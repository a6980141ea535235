"""Speculative decoding on CPU: output tokens per second with speculation off, n-gram and a draft model.

Two workloads on one random-weight Llama (engine_cpu's shape):

- (a) repetitive: quote-back requests, each prompt a passage, other text, and the passage's start
  again, greedy with long answers. A random model's greedy continuation falls into a cycle within
  a few dozen tokens, so the answer repeats itself and its prompt: the n-gram matches a real
  repetitive answer (quoting, code edits, lists) would give.
- (b) random: engine_cpu.py's 32 requests (random prompts of 16-255 tokens, 8-127 output tokens).

The draft model is the target's embedding, first layers and head (`--draft-layers`). On random
weights every layer moves the answer as much as the first, so with engine_cpu's model as it is the
draft hardly ever agrees (speculation with it must then back off and cost next to nothing);
`--damp 0.02` scales the target's later layers' output projections until the draft agrees with it
about two times in three, as a distilled draft does (the answers then repeat less, so n-gram finds
fewer matches). Every configuration runs the same
requests on a fresh engine, in alternating rounds (off, ngram, draft, off, ...), so a change in the
machine's load hits all of them; the result is each one's median tokens per second over the
rounds, and its ratio to speculation off. Greedy, so every configuration must produce the same
tokens (checked). Also printed: the acceptance rate (kept / proposed) and the mean accepted length
(tokens emitted per sequence-step that verified proposals), and the 1-minute load average.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--k 4] [--damp 1] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_cpu import (build_checkpoint, load_average, make_requests, new_engine,  # noqa: E402
                                   run_greedy, start_run, verdict)

CONFIGS = ("off", "ngram", "draft")


ROUND_LOADS: list[float] = []  # the load after every configuration's run, for the verdict

def build_draft(target_dir: str, draft_dir: str, layers: int, damp: float) -> None:
    """The draft: the target's embedding, first `layers` layers and head. A random model's later layers
    change its answers as much as the first ones do, where a trained model's draft agrees with it often:
    the target's layers past the draft's are damped (their outputs scaled by `damp`, 1: unchanged), so
    the draft agrees with it about as a distilled draft would; the target is saved again so damped."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer in target.model.layers[layers:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    target.save_pretrained(target_dir)
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config)
    draft.load_state_dict(target.state_dict(), strict=False)  # the layers past `layers` are left out
    draft.save_pretrained(draft_dir)


def quote_back_requests(num: int, vocab: int, max_tokens: int) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(3)
    requests = []
    for _ in range(num):
        passage = torch.randint(3, vocab, (96,), generator=generator).tolist()
        other = torch.randint(3, vocab, (32,), generator=generator).tolist()
        requests.append((passage + other + passage[:24], max_tokens))
    return requests


def speculative_config(name: str, k: int, draft_dir: str):
    from engine.speculative_config import SpeculativeConfig

    if name == "off":
        return None
    return SpeculativeConfig(name, k, draft_model=draft_dir if name == "draft" else None)


def run_once(directory: str, requests: list[tuple[list[int], int]], speculative) -> tuple[float, list[list[int]], object]:
    engine = new_engine(directory, speculative=speculative)
    started = time.perf_counter()
    outputs, _steps = run_greedy(engine, requests)
    return time.perf_counter() - started, outputs, engine.stats()


def measure(name: str, directory: str, draft_dir: str, requests, rounds: int, k: int) -> None:
    useful = sum(m for _, m in requests)
    print(f"\n{name}: {len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
          f"{useful} output tokens", flush=True)
    rates: dict[str, list[float]] = {c: [] for c in CONFIGS}
    acceptance: dict[str, tuple[float, float]] = {}
    reference = None
    for round_index in range(1, rounds + 1):
        for config in CONFIGS:
            seconds, outputs, stats = run_once(directory, requests, speculative_config(config, k, draft_dir))
            reference = reference or outputs
            if outputs != reference:
                raise SystemExit(f"{config}: greedy output differs from speculation off: a bug")
            rates[config].append(useful / seconds)
            if stats.num_draft_tokens:
                acceptance[config] = (stats.num_accepted_draft_tokens / stats.num_draft_tokens,
                                      1 + stats.num_accepted_draft_tokens / stats.num_speculative_verifications)
            ROUND_LOADS.append(load_average())
            print(f"  round {round_index} {config:>5}: {seconds:7.2f} s {rates[config][-1]:8.1f} tokens/s; "
                  f"load {ROUND_LOADS[-1]:.2f}", flush=True)
    base = statistics.median(rates["off"])
    print(f"  {'config':>6}{'tokens/s':>10}{'vs off':>8}{'acceptance':>12}{'tokens/verify':>15}")
    for config in CONFIGS:
        median = statistics.median(rates[config])
        rate, length = acceptance.get(config, (0.0, 1.0))
        print(f"  {config:>6}{median:10.1f}{median / base:7.2f}x{rate:12.2f}{length:15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="most tokens proposed per sequence per step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--damp", type=float, default=1.0,
                        help="scale of the target's layers past the draft's (1, the default: engine_cpu's model "
                             "unchanged; 0.02: the draft agrees with it about 2 times in 3)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--quote-requests", type=int, default=8)
    parser.add_argument("--quote-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    load_before = start_run(args.threads)
    with tempfile.TemporaryDirectory() as directory, tempfile.TemporaryDirectory() as draft_dir:
        print(f"building a random-weight Llama (hidden {args.hidden}, {args.layers} layers, layers past the "
              f"first {args.draft_layers} damped x{args.damp}) and its {args.draft_layers}-layer draft ...", flush=True)
        build_checkpoint(directory, args.hidden, args.layers, args.vocab)
        build_draft(directory, draft_dir, args.draft_layers, args.damp)
        run_once(directory, make_requests(2, args.vocab), None)  # first-call costs out of round 1
        measure("(a) repetitive (quote-back)", directory, draft_dir,
                quote_back_requests(args.quote_requests, args.vocab, args.quote_tokens), args.rounds, args.k)
        measure("(b) random (engine_cpu's requests)", directory, draft_dir, make_requests(32, args.vocab),
                args.rounds, args.k)
    print("\n" + verdict(load_before, max(ROUND_LOADS, default=load_before)))


if __name__ == "__main__":
    main()
