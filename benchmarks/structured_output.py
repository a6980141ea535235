"""The cost of structured output: engine throughput at batch 32 with and without a JSON schema on every
request, in the same run, and the grammar's own time per step and per token.

Both runs are the same 32 requests (prompts 16-255 tokens, 8-127 output tokens each, greedy) on a
random-weight Llama with a byte-level BPE tokenizer of about --vocab tokens (trained here on
generated text, so the grammar library walks a vocabulary of realistic size). The constrained run
gives every request a schema of an array of records (strings, an enum, numbers) that cannot close
before max_tokens, so both runs produce exactly the same number of tokens, in the same batches:
the difference is the grammar's cost. The runs alternate (free, constrained, free, constrained, ...)
and each side's median is compared, so load that comes and goes hurts both alike.

Grammar time is what the engine spends on masks: the batch's bitmask (llguidance's executor, on its
own threads), turning it into the logits mask, and advancing each matcher by its sampled token.

    .venv/bin/python benchmarks/structured_output.py [--requests 32] [--rounds 3] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.engine_cpu import build_checkpoint, make_requests  # noqa: E402

RECORDS = {"type": "array", "minItems": 100000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "kind", "value"],
    "properties": {"name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["sensor", "meter", "gauge"]},
                   "value": {"type": "number"}, "ok": {"type": "boolean"}}}}


def train_tokenizer(directory: str, vocab: int) -> int:
    """A byte-level BPE of about `vocab` tokens, trained on generated words and JSON-ish text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(vocab * 2)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(vocab // 2)]
    lines += [json.dumps({rng.choice(words): rng.randint(0, 9999), "v": rng.random()}) for _ in range(2000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    return tokenizer.get_vocab_size(with_added_tokens=True)


class GrammarClock:
    """Wraps the engine's grammar steps to add up their time (the benchmark's only instrumentation)."""

    def __init__(self, engine) -> None:
        self.seconds = 0.0
        self.num_steps = self.num_tokens = 0
        allowed, done = engine._allowed_tokens, engine._grammar_done

        def timed_allowed(seqs, logits):
            started = time.perf_counter()
            try:
                return allowed(seqs, logits)
            finally:
                self.seconds += time.perf_counter() - started
                self.num_steps += 1

        def timed_done(seq, token_id):
            started = time.perf_counter()
            try:
                return done(seq, token_id)
            finally:
                self.seconds += time.perf_counter() - started
                self.num_tokens += 1

        engine._allowed_tokens, engine._grammar_done = timed_allowed, timed_done


def run(directory: str, requests: list[tuple[list[int], int]], schema: dict | None):
    from engine.engine import EngineConfig, LLMEngine
    from engine.grammar import json_schema_spec
    from engine.sampling import SamplingParams

    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 30, show_progress=False,
                                               max_num_batched_tokens=1024, max_num_seqs=64))
    clock = GrammarClock(engine)
    grammar = json_schema_spec(schema) if schema is not None else None
    if grammar is not None:
        engine.grammar_compiler().matcher(grammar)  # compiled once, as a server would have it cached
    num_tokens = 0
    started = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                          grammar=grammar))
    while engine.has_work():
        num_tokens += len(engine.step())
    return time.perf_counter() - started, num_tokens, clock, engine.step_phases.copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side (medians)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as directory:
        print(f"training a ~{args.vocab}-token tokenizer and building a random-weight Llama "
              f"(hidden {args.hidden}, {args.layers} layers) ...", flush=True)
        vocab = train_tokenizer(directory, args.vocab)
        build_checkpoint(directory, args.hidden, args.layers, vocab)
        (Path(directory) / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
        requests = make_requests(args.requests, vocab)
        print(f"1-minute load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
        print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
              f"{sum(m for _, m in requests)} output tokens; vocabulary {vocab}; torch threads "
              f"{torch.get_num_threads()}", flush=True)
        results: dict[str, list] = {"free": [], "json schema": []}
        for round_ in range(args.rounds):
            for name, schema in (("free", None), ("json schema", RECORDS)):
                result = run(directory, requests, schema)
                results[name].append(result)
                print(f"round {round_ + 1}/{args.rounds}: {name:11} {result[0]:6.2f} s "
                      f"(forward {result[3].forward:.2f} s, sample {result[3].sample:.2f} s); "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    tokens = {name: {r[1] for r in rounds} for name, rounds in results.items()}
    assert tokens["free"] == tokens["json schema"] and len(tokens["free"]) == 1, "both runs must produce the same tokens"
    num_tokens = tokens["free"].pop()
    print(f"\nmedians of {args.rounds} alternating rounds")
    print(f"{'':14}{'seconds':>10}{'tokens/s':>10}{'forward s':>11}{'sample s':>10}{'other host s':>14}")
    medians = {}
    for name, rounds in results.items():
        seconds = statistics.median(r[0] for r in rounds)
        forward = statistics.median(r[3].forward for r in rounds)
        sample = statistics.median(r[3].sample for r in rounds)
        other = statistics.median(r[3].schedule + r[3].prepare + r[3].output for r in rounds)
        medians[name] = seconds
        print(f"{name:14}{seconds:10.2f}{num_tokens / seconds:10.1f}{forward:11.2f}{sample:10.2f}{other:14.2f}")
    cost = 100 * (1 - medians["free"] / medians["json schema"])
    print(f"throughput cost of a schema on every request: {cost:.1f}% (target <= 10%: {'met' if cost <= 10 else 'missed'})")
    clocks = [r[2] for r in results["json schema"]]
    grammar_s = statistics.median(c.seconds for c in clocks)
    clock = clocks[0]
    # Measured inside the constrained runs themselves, so it holds even when load differs between the runs.
    print(f"grammar time: {grammar_s:.2f} s of {medians['json schema']:.2f} s "
          f"({100 * grammar_s / medians['json schema']:.1f}%); {1000 * grammar_s / clock.num_steps:.2f} ms "
          f"per step ({clock.num_steps} steps, up to {args.requests} rows), "
          f"{1e6 * grammar_s / clock.num_tokens:.0f} us per token")
    print(f"1-minute load average after the run: {os.getloadavg()[0]:.2f}")

if __name__ == "__main__":
    main()
