"""Prefix cache, through the router: time to first token of a long prompt whose beginning a site
has cached vs the same length cold, and the cache hit rate of multi-turn chats with and without
`x-session-affinity`, measured in the same run.

    .venv/bin/python benchmarks/prefix_cache.py [--trials 5] [--conversations 6] [--turns 6] [--rounds 2]

Starts its own cluster of real processes on loopback (registry, router, three agents that each
prefill and decode, all in one city so distance favours none), on the random-weight demo model.

Part 1, TTFT. Each trial sends a `--prompt`-token prompt whose first `--cached-share` a site holds
(it served a request with that prefix and another tail, and its heartbeat has told the registry),
and a fresh prompt of the same length; prompts are random token ids. Both are streamed with the
same `max_tokens`, one at a time; the reported TTFT is the median over trials, and the cached
tokens come from each response's `usage.prompt_tokens_details.cached_tokens`.

Part 2, hit rate. `--conversations` chats start within a few seconds of each other, each `--turns`
turns of /v1/chat/completions: every turn sends the whole conversation so far (the run's system
prompt, shared by its chats as an application's is, the user messages, the assistant's answers as
returned) plus a new user message, after a random think time. Hit rate = cached prompt tokens /
prompt tokens over every turn. An answer's text does not always re-tokenize to the tokens the
random-weight model produced, so the answers themselves rarely hit; a real model's mostly would. With affinity each conversation sends its own
`x-session-affinity` header; without, nothing identifies it (no header, no `user`), so only the
sites' cache summaries in the registry can steer it. Rounds alternate which goes first; every
conversation has its own text, so neither run warms the other's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (StreamResult, endless_model, log, machine_line, markdown_table,  # noqa: E402
                                random_prompt, running_cluster, sigterm_as_interrupt, site, StreamClient, vocab_size)
from engine.demo import CORPUS, SIZES  # noqa: E402
from engine.prefix_hash import prefix_hashes  # noqa: E402

MODEL_NAME = "bench"
SITES = ("site-a", "site-b", "site-c")
WORDS = CORPUS.split()


# -- part 1: TTFT, cached prefix vs cold ----------------------------------------------------------

def cached_on_some_site(cluster, prompt: list[int], block_size: int = 16) -> bool:
    """Whether a site's heartbeat has reported the prompt's last full block (so routers can know)."""
    wanted = f"{prefix_hashes(prompt, block_size)[-1]:016x}"
    for state in cluster.snapshot()["sites"]:
        summary = (state.get("capacity") or {}).get("prefix_cache_summary") or {}
        if isinstance(summary, str):
            summary = json.loads(summary)
        if wanted in (summary.get("hashes") or ()):
            return True
    return False


async def ttft_trials(cluster, trials: int, prompt_len: int, cached_share: float, vocab: int,
                      max_tokens: int) -> tuple[list[StreamResult], list[StreamResult]]:
    warm_results, cold_results = [], []
    num_cached = int(prompt_len * cached_share)
    async with StreamClient(cluster.router_url, cluster.api_key, timeout=120.0) as http:
        async def completion(prompt: list[int]) -> StreamResult:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "logprobs": 0}  # every token is then seen, even one whose text is held back
            result = await http.stream("/v1/completions", body)
            if result.error:
                raise RuntimeError(f"request failed: {result.error}")
            return result

        for trial in range(trials):
            rng = random.Random(f"ttft/{trial}")
            prefix = random_prompt(rng, num_cached, vocab)
            first = await completion(prefix + random_prompt(rng, prompt_len - num_cached, vocab))  # a site caches it
            deadline = time.monotonic() + 30.0
            while not await asyncio.to_thread(cached_on_some_site, cluster, prefix):
                if time.monotonic() > deadline:
                    raise RuntimeError("no site reported the cached prefix within 30 s")
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # the router's snapshot refresh
            cold = await completion(random_prompt(rng, prompt_len, vocab))
            warm = await completion(prefix + random_prompt(rng, prompt_len - num_cached, vocab))
            cold_results.append(cold)
            warm_results.append(warm)
            log(f"trial {trial + 1}/{trials}: cold TTFT {1000 * cold.ttft_s:.0f} ms ({cold.cached_tokens} cached), "
                f"cached-prefix TTFT {1000 * warm.ttft_s:.0f} ms ({warm.cached_tokens} of {warm.prompt_tokens} "
                f"cached, on {warm.prefill_site}->{warm.decode_site}; the prefix went "
                f"{first.prefill_site}->{first.decode_site})")
    return warm_results, cold_results


# -- part 2: multi-turn chat hit rate ------------------------------------------------------------

def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass(slots=True)
class ChatWorkload:
    conversations: int = 6
    turns: int = 8
    system_words: int = 120      # one system prompt shared by every chat of a run, as an app's would be
    user_words: int = 25
    answer_tokens: int = 32
    think_s: tuple[float, float] = (0.5, 2.0)
    stagger_s: float = 3.0       # chats start at random within this window


async def conversation(http: StreamClient, model: str, name: str, system_prompt: str, workload: ChatWorkload,
                       affinity: bool) -> list[StreamResult]:
    rng = random.Random(name)
    messages = [{"role": "system", "content": system_prompt}]
    headers = {"x-session-affinity": name} if affinity else None
    results = []
    await asyncio.sleep(rng.uniform(0, workload.stagger_s))
    for _ in range(workload.turns):
        messages.append({"role": "user", "content": sentence(rng, workload.user_words)})
        body = {"model": model, "messages": messages, "max_tokens": workload.answer_tokens, "temperature": 0}
        result = await http.stream("/v1/chat/completions", body, headers=headers)
        if result.error:
            raise RuntimeError(f"conversation {name}: {result.error}")
        results.append(result)
        messages.append({"role": "assistant", "content": result.text})
        await asyncio.sleep(rng.uniform(*workload.think_s))
    return results


async def chat_run(cluster, label: str, workload: ChatWorkload, affinity: bool) -> list[StreamResult]:
    """Every chat of one run, in order (turns of a chat together); `label` seeds all its text."""
    system_prompt = f"You are the assistant of {label}. " + sentence(random.Random(label), workload.system_words)
    async with StreamClient(cluster.router_url, cluster.api_key, timeout=120.0) as http:
        runs = await asyncio.gather(*(conversation(http, cluster.model, f"{label}-{i}", system_prompt, workload,
                                                   affinity) for i in range(workload.conversations)))
    return [r for run in runs for r in run]


def hit_rate(results: list[StreamResult]) -> float:
    return sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results))


def sites_per_conversation(results: list[StreamResult], turns: int) -> float:
    chats = [results[i:i + turns] for i in range(0, len(results), turns)]
    return statistics.mean(len({r.prefill_site for r in chat}) for chat in chats)


# -- main ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="TTFT trials, each one cached and one cold (default 5)")
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens of the TTFT trials (default 2000)")
    parser.add_argument("--cached-share", type=float, default=0.9, help="share of it already cached (default 0.9)")
    parser.add_argument("--conversations", type=int, default=6, help="concurrent chats (default 6)")
    parser.add_argument("--turns", type=int, default=8, help="turns per chat (default 8)")
    parser.add_argument("--system-words", type=int, default=120, help="words of the shared system prompt (default 120)")
    parser.add_argument("--user-words", type=int, default=25, help="words per user message (default 25)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--think", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"),
                        help="think time between turns, uniform in seconds (default 0.5 2)")
    parser.add_argument("--rounds", type=int, default=2, help="chat rounds, each with and without affinity (default 2)")
    parser.add_argument("--size", default="small", choices=sorted(SIZES), help="demo model size (default small)")
    parser.add_argument("--model", type=Path, help="a checkpoint to use instead of the demo model")
    return parser.parse_args(argv)


def report(warm: list[StreamResult], cold: list[StreamResult], chats: dict[str, list[list[StreamResult]]],
           turns: int) -> str:
    lines = []
    if warm:
        warm_ttft, cold_ttft = statistics.median(r.ttft_s for r in warm), statistics.median(r.ttft_s for r in cold)
        rows = [("prompt", "TTFT median", "cached tokens (median)"),
                (f"{warm[0].prompt_tokens} tokens, cold", f"{1000 * cold_ttft:.0f} ms",
                 f"{statistics.median(r.cached_tokens for r in cold):.0f}"),
                (f"{warm[0].prompt_tokens} tokens, prefix cached", f"{1000 * warm_ttft:.0f} ms",
                 f"{statistics.median(r.cached_tokens for r in warm):.0f}")]
        lines += [markdown_table(rows), "",
                  f"TTFT cold / cached prefix: {cold_ttft / warm_ttft:.1f}x lower with the cache (target >= 5x)", ""]
    if chats:
        rows = [("chat", "turns", "prompt tokens", "cached tokens", "hit rate (median of rounds)",
                 "sites per conversation")]
        rates = {}
        for label, runs in chats.items():
            rates[label] = statistics.median(hit_rate(run) for run in runs)
            rows.append((label, str(sum(len(run) for run in runs)), str(sum(r.prompt_tokens for run in runs for r in run)),
                         str(sum(r.cached_tokens for run in runs for r in run)), f"{100 * rates[label]:.0f}%",
                         f"{statistics.median(sites_per_conversation(run, turns) for run in runs):.1f}"))
        lines += [markdown_table(rows), "",
                  f"hit rate without / with x-session-affinity: {100 * rates['without affinity']:.0f}% -> "
                  f"{100 * rates['with affinity']:.0f}% (published: 60% -> 80%)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log(f"machine: {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="edgefire-prefix-") as tmp, sigterm_as_interrupt():
        model_dir = endless_model(Path(tmp) / "model", args.size, args.model)
        vocab = vocab_size(model_dir)
        sites = [site(name, "both") for name in SITES]
        log(f"starting a cluster of {len(sites)} sites ({', '.join(SITES)}), each prefill and decode")
        with running_cluster(model_dir, MODEL_NAME, sites, Path(tmp) / "cluster") as cluster:
            log(f"part 1: {args.trials} trials of a {args.prompt}-token prompt, {100 * args.cached_share:.0f}% "
                f"cached vs cold")
            warm, cold = asyncio.run(ttft_trials(cluster, args.trials, args.prompt, args.cached_share, vocab, 2))
            chat = ChatWorkload(args.conversations, args.turns, args.system_words, args.user_words,
                                args.answer_tokens, tuple(args.think))
            log(f"part 2: {args.rounds} round(s) of {args.conversations} chats x {args.turns} turns, with and "
                f"without x-session-affinity")
            chats: dict[str, list[list[StreamResult]]] = {"without affinity": [], "with affinity": []}
            for index in range(args.rounds):
                order = list(chats) if index % 2 == 0 else list(chats)[::-1]
                for label in order:
                    affinity = label == "with affinity"
                    results = asyncio.run(chat_run(cluster, f"r{index}-{'sticky' if affinity else 'free'}", chat,
                                                   affinity))
                    chats[label].append(results)
                    log(f"round {index + 1} {label}: hit rate {100 * hit_rate(results):.0f}% over {len(results)} "
                        f"turns, {sites_per_conversation(results, args.turns):.1f} sites per conversation")
    print()
    print(report(warm, cold, chats, args.turns))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; cluster stopped", file=sys.stderr)
        sys.exit(130)
