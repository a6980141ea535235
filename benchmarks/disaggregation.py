"""Disaggregation: inter-token latency and time to first token, two sites colocated vs one prefill
site and one decode site, under the same workload, measured in the same run.

    .venv/bin/python benchmarks/disaggregation.py [--rounds 2] [--seconds 25] [--prefill-load 0.5]

Three clusters of real processes run on loopback side by side (registry, router, two agents each):
  colocated               two sites, both prefill and decode; the router places each request whole
                          on one of them by load (`allow_split = false`); the agents' default
                          per-step token budget (`--max-batched-tokens`, 512): the prefill chunk;
  colocated, small chunk  the same with a `--small-chunk` budget (64): how a colocated operator
                          shortens the stall a prefill chunk puts into every stream, at the cost of
                          slower prefill;
  split                   site `prefill` (prefill only) and site `decode` (decode only), budget 512:
                          every request is prefilled on one, its KV pulled over the data port, and
                          decoded on the other.
Each cluster's two agents are held to one CPU each (taskset, one torch thread), the first agent of
every cluster to the same CPU and the second to the other, so each mode gets the same two cores;
the routers and this load generator are not pinned. Rounds alternate the order of the modes
(ABC, CBA, ...) and every figure is the median over rounds.

Why the small chunk: chunked prefill bounds the stall a long prompt causes to one chunk per step,
so inter-token latency suffers only on the steps that carry a chunk. On one CPU core a 512-token
chunk costs about 25 decode steps of the small demo model (on a GPU, a few), so such steps are
rare and the interference shows at p99, not p90; a small chunk makes them frequent and short,
which is the regime GPUs are in.

The workload, identical in every mode of a round: `--streams` clients each run one streamed
completion after another (a short prompt, `--stream-tokens` tokens out), and long prompts
(`--long-prompt` tokens, `--long-tokens` out) arrive on a seeded Poisson schedule, whether or not
earlier ones are done. Their mean gap is calibrated at start so that prefilling them keeps one site
`--prefill-load` busy (a long prompt's solo TTFT on the idle split cluster ÷ the load), so the
prefill site of the split mode is neither idle nor saturated on any machine; `--long-every` fixes
it instead. Every prompt is random token ids, so nothing hits a prefix cache. The model is the
random-weight demo model without an end-of-text token, so every answer is exactly as long as
asked. Tokens are timed as they reach this client (through the router, `logprobs` on so each
token is seen): TTFT from request to first token, inter-token latency between consecutive tokens
of one answer (the decode-site handoff of a split answer included, and shown on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (StreamResult, cpu_for_sites, endless_model, log, machine_line,  # noqa: E402
                                markdown_table, percentile, random_prompt, running_cluster, sigterm_as_interrupt,
                                site, stream, vocab_size)
from engine.demo import SIZES  # noqa: E402

MODEL_NAME = "bench"


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    roles: tuple[str, str]       # of the two sites
    small_chunk: bool = False    # the agents' per-step token budget is --small-chunk, not --max-batched-tokens


MODES = (Mode("colocated", ("both", "both")),
         Mode("colocated, small chunk", ("both", "both"), small_chunk=True),
         Mode("split", ("prefill", "decode")))


@dataclass(slots=True)
class Workload:
    seconds: float
    streams: int
    stream_prompt: int
    stream_tokens: int
    long_prompt: int
    long_tokens: int
    long_every: float
    vocab: int


@dataclass(slots=True)
class RoundStats:
    mode: str
    results: list[StreamResult] = field(default_factory=list)
    window_start: float = 0.0
    window_end: float = 0.0

    @property
    def ok(self) -> list[StreamResult]:
        return [r for r in self.results if not r.error]

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.results if r.error]

    def figures(self) -> dict[str, float]:
        ok = self.ok
        ttft = [r.ttft_s for r in ok]
        long_ttft = [r.ttft_s for r in ok if r.kind == "long"]
        stream_ttft = [r.ttft_s for r in ok if r.kind == "stream"]
        gaps = [g for r in ok for g in r.gaps_s]
        handoffs = [r.gaps_s[0] for r in ok if r.split and len(r.token_times) > 1]
        in_window = sum(1 for r in ok for t in r.token_times if self.window_start <= t <= self.window_end)
        return {
            "requests": len(self.results), "failed": len(self.errors),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
            "long_ttft_p50": percentile(long_ttft, 0.5), "long_ttft_p90": percentile(long_ttft, 0.9),
            "stream_ttft_p90": percentile(stream_ttft, 0.9),
            "handoff_p50": percentile(handoffs, 0.5), "handoff_p90": percentile(handoffs, 0.9),
            "itl_p50": percentile(gaps, 0.5), "itl_p90": percentile(gaps, 0.9), "itl_p99": percentile(gaps, 0.99),
            "tokens_per_s": in_window / (self.window_end - self.window_start),
            "split_share": sum(r.split for r in ok) / max(1, len(ok)),
        }


async def run_round(cluster, mode: str, workload: Workload, seed: int | str) -> RoundStats:
    """One mode's run of the round's workload (the same prompts and arrival times for both modes)."""
    stats = RoundStats(mode)
    limits = httpx.Limits(max_connections=workload.streams + 64)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=300.0, limits=limits,
                                 headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
        stats.window_start = time.perf_counter()
        deadline = stats.window_start + workload.seconds

        async def request(kind: str, prompt: list[int], max_tokens: int) -> None:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "logprobs": 0}
            stats.results.append(await stream(http, "/v1/completions", body, kind))

        async def steady_client(client: int) -> None:
            rng = random.Random(f"{seed}/stream/{client}")
            while time.perf_counter() < deadline:
                await request("stream", random_prompt(rng, workload.stream_prompt, workload.vocab),
                              workload.stream_tokens)

        async def long_prompts() -> None:
            rng = random.Random(f"{seed}/long")
            arrivals, at = [], rng.expovariate(1.0 / workload.long_every)
            while at < workload.seconds:
                arrivals.append(at)
                at += rng.expovariate(1.0 / workload.long_every)
            tasks = []
            for at in arrivals:
                prompt = random_prompt(rng, workload.long_prompt, workload.vocab)
                await asyncio.sleep(max(0.0, stats.window_start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(request("long", prompt, workload.long_tokens)))
            await asyncio.gather(*tasks)

        await asyncio.gather(long_prompts(), *(steady_client(c) for c in range(workload.streams)))
        stats.window_end = deadline
    return stats


def summary(figures: dict[str, float]) -> str:
    return (f"{figures['requests']:.0f} requests ({figures['failed']:.0f} failed), "
            f"TTFT p50/p90 {1000 * figures['ttft_p50']:.0f}/{1000 * figures['ttft_p90']:.0f} ms, "
            f"ITL p50/p90/p99 {1000 * figures['itl_p50']:.1f}/{1000 * figures['itl_p90']:.1f}/"
            f"{1000 * figures['itl_p99']:.1f} ms, {figures['tokens_per_s']:.0f} tokens/s, "
            f"split {100 * figures['split_share']:.0f}%")


def median_figures(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def ms(seconds: float, digits: int = 0) -> str:
    return "-" if seconds != seconds else f"{1000 * seconds:.{digits}f} ms"


def report(by_mode: dict[str, list[dict[str, float]]]) -> str:
    medians = {mode: median_figures(rounds) for mode, rounds in by_mode.items()}
    main = [("mode", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "ITL p99", "output tokens/s")]
    detail = [("mode", "requests", "split", "stream TTFT p90", "long-prompt TTFT p50 / p90",
               "split handoff gap p50 / p90")]
    for mode, m in medians.items():
        main.append((mode, ms(m["ttft_p50"]), ms(m["ttft_p90"]), ms(m["itl_p50"], 1), ms(m["itl_p90"], 1),
                     ms(m["itl_p99"], 1), f"{m['tokens_per_s']:.0f}"))
        detail.append((mode, f"{m['requests']:.0f}", f"{100 * m['split_share']:.0f}%", ms(m["stream_ttft_p90"]),
                       f"{ms(m['long_ttft_p50'])} / {ms(m['long_ttft_p90'])}",
                       f"{ms(m['handoff_p50'])} / {ms(m['handoff_p90'])}"))
    lines = [markdown_table(main), "", markdown_table(detail), ""]
    split = medians["split"]
    for name, colo in medians.items():
        if name == "split":
            continue
        lines.append(f"{name} vs split: ITL p90 {colo['itl_p90'] / split['itl_p90']:.2f}x lower split (target >= 3x), "
                     f"ITL p99 {colo['itl_p99'] / split['itl_p99']:.2f}x; TTFT p90 split / {name} "
                     f"{split['ttft_p90'] / colo['ttft_p90']:.2f}x (target <= 1.5x)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every mode (default 2)")
    parser.add_argument("--seconds", type=float, default=25.0, help="load per mode per round (default 25)")
    parser.add_argument("--streams", type=int, default=4, help="steady streaming clients (default 4)")
    parser.add_argument("--stream-prompt", type=int, default=64, help="their prompt tokens (default 64)")
    parser.add_argument("--stream-tokens", type=int, default=128, help="their output tokens (default 128)")
    parser.add_argument("--long-prompt", type=int, default=1500, help="long prompt tokens (default 1500)")
    parser.add_argument("--long-tokens", type=int, default=32, help="long prompts' output tokens (default 32)")
    parser.add_argument("--prefill-load", type=float, default=0.5,
                        help="long prompts arrive to keep one site this busy prefilling them (default 0.5): the mean "
                             "gap is a measured solo prefill's time divided by this")
    parser.add_argument("--long-every", type=float, help="mean seconds between long prompts (instead of --prefill-load)")
    parser.add_argument("--size", default="small", choices=sorted(SIZES), help="demo model size (default small)")
    parser.add_argument("--model", type=Path, help="a checkpoint to use instead of the demo model")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="the agents' per-step token budget, i.e. the prefill chunk (default 512, the agent's)")
    parser.add_argument("--small-chunk", type=int, default=64,
                        help="the budget of the 'colocated, small chunk' mode (default 64)")
    return parser.parse_args(argv)


def start_clusters(stack: ExitStack, model_dir: Path, tmp: Path, args: argparse.Namespace) -> dict:
    cpus = cpu_for_sites(2)
    clusters = {}
    for index, mode in enumerate(MODES):
        names = ("prefill", "decode") if mode.roles == ("prefill", "decode") else (f"site-{index}a", f"site-{index}b")
        sites = [site(name, role, cpus[i]) for i, (name, role) in enumerate(zip(names, mode.roles))]
        chunk = args.small_chunk if mode.small_chunk else args.max_batched_tokens
        log(f"starting the {mode.name} cluster: " + ", ".join(f"{s.name} ({s.role}, CPU {s.cpus or 'any'})"
                                                               for s in sites) + f", chunk {chunk}")
        agent = {"max_num_batched_tokens": chunk, "kv_cache_bytes": 256 << 20}
        # Colocated means colocated: the router may not split a request across the two sites.
        router = {"allow_split": mode.name == "split"}
        clusters[mode.name] = stack.enter_context(running_cluster(model_dir, MODEL_NAME, sites, tmp / f"mode-{index}",
                                                                  agent=agent, router=router))
    return clusters


async def solo_prefill_s(cluster, long_prompt: int, vocab: int, trials: int = 3) -> float:
    """Median TTFT of a long prompt alone on an idle cluster: what one long prompt costs a site."""
    rng = random.Random("calibration")
    ttfts = []
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=300.0,
                                 headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
        for attempt in range(trials + 5):  # a site can miss a heartbeat on a loaded machine: retry a few
            body = {"model": cluster.model, "prompt": random_prompt(rng, long_prompt, vocab), "max_tokens": 2,
                    "temperature": 0, "logprobs": 0}
            result = await stream(http, "/v1/completions", body)
            if not result.error:
                ttfts.append(result.ttft_s)
                if len(ttfts) == trials:
                    break
            elif attempt == trials + 4:
                raise RuntimeError(f"calibration request failed: {result.error}")
            else:
                log(f"calibration request failed ({result.error[:120]}); retrying")
                await asyncio.sleep(1.0)
    return statistics.median(ttfts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log(f"machine: {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="edgefire-disagg-") as tmp, sigterm_as_interrupt(), ExitStack() as stack:
        model_dir = endless_model(Path(tmp) / "model", args.size, args.model)
        vocab = vocab_size(model_dir)
        clusters = start_clusters(stack, model_dir, Path(tmp), args)
        warm = Workload(4.0, 2, 32, 8, args.long_prompt, 4, 2.0, vocab)
        for name, cluster in clusters.items():
            log(f"warming up {name}")
            asyncio.run(run_round(cluster, name, warm, seed="warm-up"))
        long_every = args.long_every
        if long_every is None:
            prefill_s = asyncio.run(solo_prefill_s(clusters["split"], args.long_prompt, vocab))
            long_every = prefill_s / args.prefill_load
            log(f"a {args.long_prompt}-token prompt alone takes {1000 * prefill_s:.0f} ms to its first token: "
                f"one arrives every {long_every:.2f}s on average (prefill load {args.prefill_load:.0%})")
        workload = Workload(args.seconds, args.streams, args.stream_prompt, args.stream_tokens, args.long_prompt,
                            args.long_tokens, long_every, vocab)
        by_mode: dict[str, list[dict[str, float]]] = {mode.name: [] for mode in MODES}
        log(f"{args.rounds} round(s) x {args.seconds:.0f}s per mode: {args.streams} streams of "
            f"{args.stream_prompt}+{args.stream_tokens} tokens, {args.long_prompt}-token prompts "
            f"({args.long_tokens} out) every {long_every:.2f}s on average, model {args.model or 'demo ' + args.size}")
        for index in range(args.rounds):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                stats = asyncio.run(run_round(clusters[mode.name], mode.name, workload, seed=index))
                figures = stats.figures()
                by_mode[mode.name].append(figures)
                log(f"round {index + 1} {mode.name}: {summary(figures)}")
                for error in stats.errors[:3]:
                    log(f"  error: {error}")
    print()
    print(report(by_mode))
    failed = sum(f["failed"] for rounds in by_mode.values() for f in rounds)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; clusters stopped", file=sys.stderr)
        sys.exit(130)
