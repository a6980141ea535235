"""Engine vs transformers on CPU: the same batch of requests through both, in one run.

The batch is what a server sees: 32 requests with prompts of different lengths wanting answers
of different lengths. transformers gets all of them in one left-padded `generate` call (its most
efficient use) and must run until the longest answer is done; the engine batches continuously,
so finished requests leave the batch. Throughput counts only the tokens each request asked for.

    .venv/bin/python benchmarks/engine_cpu.py [--requests 32] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time

import torch


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


def run_engine(directory: str, requests: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(directory, EngineConfig(kv_cache_bytes=1 << 30, show_progress=False,
                                               max_num_batched_tokens=1024, max_num_seqs=64))
    outputs = {str(i): [] for i in range(len(requests))}
    started = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out.token.token_id)
    return time.perf_counter() - started, [outputs[str(i)] for i in range(len(requests))]


def run_transformers(directory: str, requests: list[tuple[list[int], int]]) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    longest = max(len(p) for p, _ in requests)
    input_ids = torch.zeros((len(requests), longest), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(requests):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt)
        attention[row, longest - len(prompt):] = 1
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                             max_new_tokens=max(m for _, m in requests), eos_token_id=None, pad_token_id=0)
    elapsed = time.perf_counter() - started
    return elapsed, [out[row, longest:longest + m].tolist() for row, (_, m) in enumerate(requests)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as directory:
        print(f"building a random-weight Llama (hidden {args.hidden}, {args.layers} layers) ...", flush=True)
        build_checkpoint(directory, args.hidden, args.layers, args.vocab)
        requests = make_requests(args.requests, args.vocab)
        useful = sum(m for _, m in requests)
        print(f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {useful} output tokens; "
              f"torch threads {torch.get_num_threads()}", flush=True)
        print("running the engine ...", flush=True)
        ours_s, ours = run_engine(directory, requests)
        print("running transformers generate ...", flush=True)
        theirs_s, theirs = run_transformers(directory, requests)
    same = sum(a == b for a, b in zip(ours, theirs))
    print(f"\n{'':14}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'edgefire':14}{ours_s:10.2f}{useful / ours_s:12.1f}")
    print(f"{'transformers':14}{theirs_s:10.2f}{useful / theirs_s:12.1f}")
    print(f"speed-up {theirs_s / ours_s:.2f}x; identical greedy outputs: {same}/{len(requests)}")


if __name__ == "__main__":
    main()
