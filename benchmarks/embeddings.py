"""Embeddings: the engine vs transformers on CPU, the same inputs through both, in alternating rounds.

The workload is what an embeddings endpoint sees: many inputs of different lengths (16 to 512 tokens) at once.
transformers gets them as sentence-transformers feeds a model: sorted by length, in batches of 32, padded on
the right with an attention mask, the last real token's final hidden state pooled and L2-normalized. The
engine gets every input as an embedding request at once (engine.pooling, last-token pooling): scheduled,
batched and chunked as prefills, no padding. Throughput counts input tokens. Both sides run with the same
torch threads; the vectors are compared (largest difference) so a fast wrong answer cannot pass.

Honest by construction, as benchmarks/engine_cpu.py: alternating rounds, the median of the per-round ratios,
the 1-minute load printed before the run and with every round, and a verdict on whether the machine was quiet.

    .venv/bin/python benchmarks/embeddings.py [--rounds 3] [--inputs 256] [--hidden 512] [--layers 8] [--threads N]
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

from benchmarks.engine_cpu import build_checkpoint, load_average, new_engine, start_run, verdict  # noqa: E402

BATCH = 32   # sentence-transformers' default batch size


def make_inputs(num: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (int(torch.randint(16, 513, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(num)]


def run_engine(directory: str, inputs: list[list[int]]) -> tuple[float, float, torch.Tensor]:
    """(wall seconds, CPU seconds, vectors [inputs, hidden]) of one run on a fresh engine (no prefix cache)."""
    engine = new_engine(directory)
    vectors: dict[int, torch.Tensor] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    for i, ids in enumerate(inputs):
        engine.add_embedding_request(str(i), ids)
    while engine.has_work():
        for out in engine.step():
            if out.embedding is not None:
                vectors[int(out.request_id)] = out.embedding
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    engine.shutdown()
    return wall, cpu, torch.stack([vectors[i] for i in range(len(inputs))])


def run_transformers(model, inputs: list[list[int]]) -> tuple[float, float, torch.Tensor]:
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    vectors = torch.empty((len(inputs), model.config.hidden_size))
    started, cpu_started = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for start in range(0, len(order), BATCH):
            rows = order[start:start + BATCH]
            longest = max(len(inputs[i]) for i in rows)
            ids = torch.zeros((len(rows), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(rows):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(rows)), mask.sum(dim=1) - 1]
            vectors[rows] = torch.nn.functional.normalize(last, dim=-1)
    return time.perf_counter() - started, time.process_time() - cpu_started, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both sides (default: torch's choice)")
    args = parser.parse_args()
    load_before = start_run(args.threads)
    from transformers import AutoModel

    with tempfile.TemporaryDirectory() as directory:
        print(f"building a random-weight Llama (hidden {args.hidden}, {args.layers} layers) ...", flush=True)
        build_checkpoint(directory, args.hidden, args.layers, args.vocab)
        inputs = make_inputs(args.inputs, args.vocab)
        tokens = sum(len(ids) for ids in inputs)
        print(f"{len(inputs)} inputs, {tokens} tokens (16-512 each)", flush=True)
        reference = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
        run_engine(directory, inputs[:4])  # first-call costs (thread pool, allocator) out of round 1
        rows, ratios, peak_load, difference = [], [], load_before, 0.0
        for round_index in range(1, args.rounds + 1):
            ours_s, ours_cpu, ours = run_engine(directory, inputs)
            theirs_s, theirs_cpu, theirs = run_transformers(reference, inputs)
            difference = max(difference, float((ours - theirs).abs().max()))
            ratios.append(theirs_s / ours_s)
            load = load_average()
            peak_load = max(peak_load, load)
            rows.append((round_index, ours_s, ours_cpu, theirs_s, theirs_cpu, load))
            print(f"round {round_index}: edgefire {ours_s:.2f} s ({tokens / ours_s:.0f} tokens/s), transformers "
                  f"{theirs_s:.2f} s ({tokens / theirs_s:.0f} tokens/s), {ratios[-1]:.2f}x; load {load:.2f}",
                  flush=True)
        print(f"\n{'round':>5}{'edgefire s':>12}{'CPU s':>8}{'tokens/s':>10}{'transformers s':>16}{'CPU s':>8}"
              f"{'tokens/s':>10}{'ratio':>8}{'load':>7}")
        for (index, ours_s, ours_cpu, theirs_s, theirs_cpu, load), ratio in zip(rows, ratios):
            print(f"{index:>5}{ours_s:12.2f}{ours_cpu:8.2f}{tokens / ours_s:10.0f}{theirs_s:16.2f}{theirs_cpu:8.2f}"
                  f"{tokens / theirs_s:10.0f}{ratio:8.2f}{load:7.2f}")
        print(f"\nmedian: edgefire {statistics.median(tokens / r[1] for r in rows):.0f} tokens/s, transformers "
              f"{statistics.median(tokens / r[3] for r in rows):.0f} tokens/s, ratio {statistics.median(ratios):.2f}x; "
              f"largest difference between the two sides' vectors {difference:.1e}")
        print(verdict(load_before, peak_load))


if __name__ == "__main__":
    main()
