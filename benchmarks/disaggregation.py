"""Disaggregation: inter-token latency and time to first token, two sites colocated vs one prefill
site and one decode site, under the same workload, measured in the same run.

    .venv/bin/python benchmarks/disaggregation.py [--prefill-loads 0.3,0.45,0.6] [--rounds 2] [--seconds 20]
                                                  [--frontend-cpu any|first] [--frontend-priority]

About 8 minutes with the defaults. Three clusters of real processes run on loopback side by side
(registry, router, two agents each):
  colocated         two sites, both prefill and decode; the router places each request whole on one
                    of them by load (`allow_split = false`); the agent's default step budget
                    (`--max-batched-tokens`, 512), which is its prefill chunk;
  colocated-scaled  the same with the chunk scaled to this machine (below);
  split             site `prefill` (prefill only) and site `decode` (decode only), budget 512: every
                    request is prefilled on one, its KV pulled over the data port, and decoded on
                    the other.
Each cluster's two agents are held to one CPU each (taskset, one torch thread), the first agent of
every cluster to the same CPU and the second to the other, so every mode gets the same two cores.
Whether the two CPUs are independent is checked first and printed (a one-thread loop on one, alone
and while the other is busy): were they one core's two hardware threads, a busy prefill site would
slow the decode site's steps, and split would not be the isolation it is on separate machines;
the routers and this load generator are not pinned (their CPU use is printed: on a two-core machine
the router takes about a fifth of a core from the agents, this load generator, which keeps each read
with its arrival time and parses an answer once it is whole, about a twentieth), unless
`--frontend-cpu first` holds them, and the registries, to the first site's CPU: the split decode
site then has its core to itself, as on separate machines, and the prefill site shares its core
with them. `--frontend-priority` leaves them on any CPU but runs them, and the registries, at nice
-10 (root only), so a token ready at a site is relayed at once instead of waiting for a slice beside
a busy engine: the nearest one machine comes to routers and clients on machines of their own.
Rounds alternate the order of the modes (ABC, CBA, ...) and every figure is the median over rounds.
Only the measured cluster runs: the others are stopped (SIGSTOP) outside their rounds, so their
heartbeats and polls do not wake on its cores, and each is resumed until its router sees both sites
live again before its round.

The regime, and why the chunk is scaled. Chunked prefill bounds what a long prompt does to the
streams of its site: a step that carries a chunk of c prompt tokens lasts about d + c*t (d a plain
decode step as the client sees it, t one prompt token), and only such steps stretch a gap. Whether
colocated p90 inter-token latency shows the stall depends on two numbers:
  - the stall, 1 + k with k = c*t/d. The published result (100 ms colocated against 20-30 ms split,
    on GPUs) is a chunk step of about five decode steps: a GPU's decode step is long (it reads all
    the weights) and its prompt tokens are cheap. On one CPU core it is the other way round: d is
    7-8 ms and t 0.17-0.21 ms, so a 512-token chunk step lasts 13-15 plain steps;
  - the share f of gaps that fall on chunk steps. For a site that spends rho of its time on prompt
    tokens, f ~ rho / (k (1 - rho (1 + 1/k))), and p90 lands on chunk steps only when f > 0.1. At
    c = 512 (k ~ 13) that needs rho ~ 0.5 per colocated site, so the stall shows only at p99 until
    the split mode's one prefill site, which carries both sites' prompts, is nearly saturated.
So the benchmark measures d and t on the colocated cluster first and runs a second colocated mode
whose chunk step lasts `--chunk-steps` (5) plain steps, as on the GPUs of the published result:
c = (5 - 1) d / t, about 160 tokens here. Every mode is reported against split.

The trade-off the loads show (quiet runs, benchmarks/RESULTS.md). `--prefill-loads` sets how busy
the long prompts keep the split mode's prefill site (each colocated site gets half). Colocated p90
lands on chunk steps only once f passes 0.1: at load ~0.45 for the scaled chunk, and at load ~0.6
for the 512 chunk, when split's one prefill site is 70-90% busy and queues (its TTFT p90 2-3x
colocated's, whose two sites both prefill). At loads 0.45-0.5 the scaled chunk's five-gap stall
gives split 2.3-2.7x lower ITL p90 with TTFT p90 within 1.5x; what keeps it from 3x is split's own
p90, 1.5-1.9x its p50: a long prompt decoding beside the chats lengthens the decode site's step
(by ~50% in the demo model `small`, whose 1,500-token KV is half its weights' bytes; ~15% in
`--size medium`, a step that costs mostly weights as on GPUs), and the router, which relays every
token, takes a tenth to a fifth of a core from the sites. Held to the prefill site's CPU
(`--frontend-cpu first`) it leaves the decode site's gaps tighter but slows the prefill site, which
moves the miss to TTFT. Whether a quiet machine finds a load where both targets hold is what the
summary table at the end answers.

The workload, identical in every mode at a load: `--streams` clients each run one streamed
completion after another (a short prompt, `--stream-tokens` tokens out), and long prompts
(`--long-prompt` tokens, `--long-tokens` out) arrive on a seeded Poisson schedule whether or not
earlier ones are done, with a mean gap of (a long prompt's solo TTFT on the split cluster) / load.
Every prompt is random token ids, so nothing hits a prefix cache. The model is the random-weight
demo model without an end-of-text token, so every answer is exactly as long as asked. Tokens are
timed as they reach this client (through the router, `logprobs` on so each token is seen): TTFT
from request to first token, inter-token latency (ITL) between consecutive tokens of one answer
(the handoff gap of a split answer included, and shown on its own), TPOT each answer's mean gap.
"Site ITL" is the same gap as the agents stream tokens out (their edgefire_agent_inter_token_seconds
histograms, merged over the cluster's sites), before the router and this client add theirs: on a
two-CPU machine those two share the sites' cores, which puts a floor of a few ms under the client's
p90 whatever the sites do.
Per site the agents' engine step totals (`edgefire_agent_engine_*_total` on /metrics) say which
regime a mode ran in: rho (the share of time in steps with prompt tokens), the share of steps and
of decoded tokens (gaps) such steps had, a plain decode step and a step with prompt tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (StreamResult, core_interference, cpu_for_sites, endless_model, log,  # noqa: E402
                                machine_line, markdown_table, percentile, pin_process, random_prompt, running_cluster,
                                set_priority, sigterm_as_interrupt, site, StreamClient, vocab_size)
from engine.demo import SIZES  # noqa: E402

MODEL_NAME = "bench"
CHUNK_MULTIPLE = 16  # the scaled chunk is rounded to whole KV blocks


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    roles: tuple[str, str]       # of the two sites
    scaled_chunk: bool = False   # the agents' step budget is the calibrated chunk, not --max-batched-tokens


MODES = (Mode("colocated", ("both", "both")),
         Mode("colocated-scaled", ("both", "both"), scaled_chunk=True),
         Mode("split", ("prefill", "decode")))


@dataclass(slots=True)
class Workload:
    seconds: float
    streams: int
    stream_prompt: int
    stream_tokens: int
    long_prompt: int
    long_tokens: int
    long_every: float            # mean seconds between long prompts; math.inf: none
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
        # time per output token: each answer's mean gap (what per-request SLOs are written in)
        tpots = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                 for r in ok if len(r.token_times) > 1]
        handoffs = [r.gaps_s[0] for r in ok if r.split and len(r.token_times) > 1]
        in_window = sum(1 for r in ok for t in r.token_times if self.window_start <= t <= self.window_end)
        return {
            "requests": len(self.results), "failed": len(self.errors),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p90": percentile(ttft, 0.9),
            "long_ttft_p50": percentile(long_ttft, 0.5), "long_ttft_p90": percentile(long_ttft, 0.9),
            "stream_ttft_p90": percentile(stream_ttft, 0.9),
            "handoff_p50": percentile(handoffs, 0.5), "handoff_p90": percentile(handoffs, 0.9),
            "itl_p50": percentile(gaps, 0.5), "itl_p90": percentile(gaps, 0.9), "itl_p99": percentile(gaps, 0.99),
            "tpot_p50": percentile(tpots, 0.5), "tpot_p90": percentile(tpots, 0.9),
            "tokens_per_s": in_window / (self.window_end - self.window_start),
            "split_share": sum(r.split for r in ok) / max(1, len(ok)),
        }


async def run_round(cluster, mode: str, workload: Workload, seed: int | str) -> RoundStats:
    """One mode's run of the round's workload (the same prompts and arrival times for every mode)."""
    stats = RoundStats(mode)
    async with StreamClient(cluster.router_url, cluster.api_key) as http:
        stats.window_start = time.perf_counter()
        deadline = stats.window_start + workload.seconds

        async def request(kind: str, prompt: list[int], max_tokens: int) -> None:
            body = {"model": cluster.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "logprobs": 0}
            stats.results.append(await http.stream("/v1/completions", body, kind))

        async def steady_client(client: int) -> None:
            rng = random.Random(f"{seed}/stream/{client}")
            while time.perf_counter() < deadline:
                await request("stream", random_prompt(rng, workload.stream_prompt, workload.vocab),
                              workload.stream_tokens)

        async def long_prompts() -> None:
            rng = random.Random(f"{seed}/long")
            if math.isinf(workload.long_every):
                return
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


# -- what the agents' engines did (their step totals on /metrics) -------------------------------

STEP_COUNTERS = {"edgefire_agent_engine_steps": "steps", "edgefire_agent_engine_step_seconds": "seconds",
                 "edgefire_agent_engine_decode_tokens": "decoded", "edgefire_agent_engine_prefill_tokens": "prefilled"}


SITE_ITL = "edgefire_agent_inter_token_seconds"  # the gaps between the tokens an agent streams out


def step_totals(cluster) -> dict[str, dict[str, float] | None]:
    """Per site: `<counter>/<kind>` -> running total, and `itl_le/<bound>` -> the site's inter-token
    histogram (cumulative counts), summed over the site's models (None: its /metrics did not answer
    after a few tries; that site's figures are then left blank)."""
    totals = {}
    with cluster.http_client(timeout=10.0) as http:
        for spec in cluster.config.sites:
            totals[spec.name] = None
            for attempt in range(3):
                try:
                    text = http.get(cluster.metrics_url(spec.name)).raise_for_status().text
                except httpx.HTTPError as exc:
                    log(f"reading {spec.name}'s /metrics failed ({exc}){'; retrying' if attempt < 2 else ''}")
                    continue
                totals[spec.name] = site_totals = {}
                for family in text_string_to_metric_families(text):
                    if family.name == SITE_ITL:
                        for sample in family.samples:
                            if sample.name.endswith("_bucket"):
                                key = f"itl_le/{sample.labels['le']}"
                                site_totals[key] = site_totals.get(key, 0.0) + sample.value
                        continue
                    short = STEP_COUNTERS.get(family.name)
                    for sample in family.samples if short else ():
                        if sample.name.endswith("_total"):
                            key = f"{short}/{sample.labels.get('kind', 'all')}"
                            site_totals[key] = site_totals.get(key, 0.0) + sample.value
                break
    return totals


def regime(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], seconds: float) -> dict:
    """Per site, over a window: the figures that say which regime a mode ran in."""
    figures = {}
    for name in after:
        if after[name] is None or before.get(name) is None:
            figures[name] = dict.fromkeys(("busy", "rho", "chunk_step_share", "gaps_on_chunks", "decode_step_s",
                                           "chunk_step_s", "prefill_tokens"), math.nan)
            continue
        delta = {key: after[name].get(key, 0.0) - before[name].get(key, 0.0) for key in after[name]}
        prefill_steps, decode_steps = delta.get("steps/prefill", 0.0), delta.get("steps/decode", 0.0)
        prefill_s, decode_s = delta.get("seconds/prefill", 0.0), delta.get("seconds/decode", 0.0)
        gaps_on_chunks, gaps_plain = delta.get("decoded/prefill", 0.0), delta.get("decoded/decode", 0.0)
        figures[name] = {
            "busy": (prefill_s + decode_s) / seconds, "rho": prefill_s / seconds,
            "chunk_step_share": prefill_steps / max(1.0, prefill_steps + decode_steps),
            "gaps_on_chunks": gaps_on_chunks / max(1.0, gaps_on_chunks + gaps_plain),
            "decode_step_s": decode_s / decode_steps if decode_steps else math.nan,
            "chunk_step_s": prefill_s / prefill_steps if prefill_steps else math.nan,
            "prefill_tokens": delta.get("prefilled/all", 0.0),
        }
    return figures


def site_itl(before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]) -> dict:
    """p50/p90 of the gaps between tokens as the sites streamed them out over a window (all the cluster's
    sites' histograms merged, each percentile interpolated within its bucket): inter-token latency
    before the router and the client, which on a two-CPU machine share the sites' cores."""
    counts: dict[float, float] = {}
    for name, totals in after.items():
        if totals is None or before.get(name) is None:
            return {"site_itl_p50": math.nan, "site_itl_p90": math.nan}
        for key, value in totals.items():
            if key.startswith("itl_le/"):
                bound = float(key.split("/", 1)[1])
                counts[bound] = counts.get(bound, 0.0) + value - before[name].get(key, 0.0)
    return {"site_itl_p50": histogram_quantile(counts, 0.5), "site_itl_p90": histogram_quantile(counts, 0.9)}


def histogram_quantile(cumulative: dict[float, float], q: float) -> float:
    """The q-quantile of a cumulative histogram {upper bound: count}, linear within the bucket it falls in."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if not total:
        return math.nan
    lower, below = 0.0, 0.0
    for bound in bounds:
        if cumulative[bound] >= q * total:
            if math.isinf(bound):
                return lower
            inside = cumulative[bound] - below
            return lower + (bound - lower) * ((q * total - below) / inside if inside else 1.0)
        lower, below = bound, cumulative[bound]
    return lower


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (Linux /proc); NaN where that cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return math.nan


def cpu_pids(cluster) -> dict[str, int | None]:
    """The processes whose CPU use is reported, named alike in every mode (first site: CPU of the
    cluster's first agent, e.g. the split prefill site)."""
    first, second = (spec.name for spec in cluster.config.sites)
    processes = cluster.processes
    return {"first site": processes[first].pid, "second site": processes[second].pid,
            "router": processes["router"].pid, "registry": processes["registry"].pid, "client": os.getpid()}


# -- one measured round ------------------------------------------------------------------------

@dataclass(slots=True)
class Measured:
    figures: dict[str, float]
    sites: dict[str, dict]                  # site -> regime figures
    cpu_share: dict[str, float]             # process -> share of one core over the round


def measure(cluster, mode: str, workload: Workload, seed: int | str, dump: Path | None) -> tuple[Measured, list[str]]:
    pids = cpu_pids(cluster)
    cpu_before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    before = step_totals(cluster)
    started = time.perf_counter()
    stats = asyncio.run(run_round(cluster, mode, workload, seed))
    elapsed = time.perf_counter() - started
    after = step_totals(cluster)
    cpu = {name: (process_cpu_s(pid) - cpu_before[name]) / elapsed for name, pid in pids.items()}
    if dump is not None:
        with dump.open("a") as out:
            for r in stats.results:
                out.write(json.dumps({"mode": mode, "seed": seed, "kind": r.kind, "started": r.started,
                                      "token_times": r.token_times, "prefill_site": r.prefill_site,
                                      "decode_site": r.decode_site, "error": r.error}) + "\n")
    return Measured({**stats.figures(), **site_itl(before, after)}, regime(before, after, elapsed), cpu), stats.errors


# -- calibration ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Calibration:
    plain_gap_s: float       # client-seen inter-token p50 of the streams alone on a colocated site
    decode_step_s: float     # the engines' plain decode step meanwhile
    prompt_token_s: float    # the engines' time per prompt token of a long prompt alone
    solo_ttft_s: float       # a long prompt alone on the split cluster's prefill site, to its first token

    def scaled_chunk(self, chunk_steps: float, limit: int) -> int:
        """The chunk whose step costs chunk_steps plain decode steps: (chunk_steps - 1) gaps of prompt tokens."""
        tokens = (chunk_steps - 1) * self.plain_gap_s / self.prompt_token_s
        return max(CHUNK_MULTIPLE, min(limit, round(tokens / CHUNK_MULTIPLE) * CHUNK_MULTIPLE))


async def solo_ttfts(cluster, long_prompt: int, vocab: int, trials: int, seed: str) -> list[float]:
    """TTFTs of long prompts sent one at a time to an idle cluster (a missed heartbeat is retried)."""
    rng = random.Random(seed)
    ttfts = []
    async with StreamClient(cluster.router_url, cluster.api_key) as http:
        for attempt in range(trials + 5):
            body = {"model": cluster.model, "prompt": random_prompt(rng, long_prompt, vocab), "max_tokens": 2,
                    "temperature": 0, "logprobs": 0}
            result = await http.stream("/v1/completions", body)
            if not result.error:
                ttfts.append(result.ttft_s)
                if len(ttfts) == trials:
                    return ttfts
            elif attempt == trials + 4:
                raise RuntimeError(f"calibration request failed: {result.error}")
            else:
                log(f"calibration request failed ({result.error[:120]}); retrying")
                await asyncio.sleep(1.0)
    return ttfts


def calibrate(colocated, split, args: argparse.Namespace, vocab: int) -> Calibration:
    """d and t from the engines of an idle colocated cluster, the arrival scale from the split one."""
    streams_only = Workload(args.calibration_seconds, args.streams, args.stream_prompt, args.stream_tokens,
                            args.long_prompt, args.long_tokens, math.inf, vocab)
    before = step_totals(colocated)
    started = time.perf_counter()
    stats = asyncio.run(run_round(colocated, "calibration", streams_only, seed="calibration"))
    elapsed = time.perf_counter() - started
    if stats.errors:  # a site that missed a heartbeat on a loaded machine; the answers that came are enough
        log(f"calibration: {len(stats.errors)} of {len(stats.results)} streams failed ({stats.errors[0][:120]})")
    if not any(r.gaps_s for r in stats.ok):
        raise RuntimeError("calibration: no stream answered; is the cluster serving?")
    streams_regime = regime(before, step_totals(colocated), elapsed)
    plain_gap = percentile([g for r in stats.ok for g in r.gaps_s], 0.5)
    steps = [s["decode_step_s"] for s in streams_regime.values() if not math.isnan(s["decode_step_s"])]
    decode_step = statistics.median(steps) if steps else math.nan  # for the record; the gap decides the chunk
    before = step_totals(colocated)
    asyncio.run(solo_ttfts(colocated, args.long_prompt, vocab, 3, "calibration/colocated"))
    after = step_totals(colocated)
    if any(totals is None for totals in (*before.values(), *after.values())):
        raise RuntimeError("calibration: an agent's /metrics did not answer")
    prompt_tokens = sum(after[s].get("prefilled/all", 0) - before[s].get("prefilled/all", 0) for s in after)
    prompt_s = sum(after[s].get("seconds/prefill", 0) - before[s].get("seconds/prefill", 0) for s in after)
    solo = statistics.median(asyncio.run(solo_ttfts(split, args.long_prompt, vocab, 3, "calibration/split")))
    return Calibration(plain_gap, decode_step, prompt_s / prompt_tokens, solo)


# -- the report ----------------------------------------------------------------------------------

def median_figures(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds that have it (NaN: none has)."""
    def median(values: list[float]) -> float:
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan
    return {name: median([r[name] for r in rounds]) for name in rounds[0]}


def ms(seconds: float, digits: int = 0) -> str:
    return "-" if seconds != seconds else f"{1000 * seconds:.{digits}f} ms"


def pct(share: float) -> str:
    return "-" if share != share else f"{100 * share:.0f}%"


def summary(figures: dict[str, float]) -> str:
    return (f"{figures['requests']:.0f} requests ({figures['failed']:.0f} failed), "
            f"TTFT p50/p90 {1000 * figures['ttft_p50']:.0f}/{1000 * figures['ttft_p90']:.0f} ms, "
            f"ITL p50/p90/p99 {1000 * figures['itl_p50']:.1f}/{1000 * figures['itl_p90']:.1f}/"
            f"{1000 * figures['itl_p99']:.1f} ms (at the sites p50/p90 {1000 * figures.get('site_itl_p50', math.nan):.1f}/"
            f"{1000 * figures.get('site_itl_p90', math.nan):.1f} ms), {figures['tokens_per_s']:.0f} tokens/s, "
            f"split {100 * figures['split_share']:.0f}%")


ITL_TARGET = 3.0    # split p90 inter-token latency at least this many times lower than colocated
TTFT_TARGET = 1.5   # split p90 TTFT at most this many times colocated's
FRONTEND_NICE = -10  # --frontend-priority: the routers', registries' and load generator's nice value


def ratios(colocated: dict[str, float], split: dict[str, float]) -> tuple[float, float, float, float]:
    """(ITL p90, ITL p99 and TPOT p90 colocated / split; TTFT p90 split / colocated)"""
    return (colocated["itl_p90"] / split["itl_p90"], colocated["itl_p99"] / split["itl_p99"],
            colocated["tpot_p90"] / split["tpot_p90"], split["ttft_p90"] / colocated["ttft_p90"])


def verdicts(medians: dict[str, dict[str, float]]) -> list[str]:
    split = medians.get("split")
    if split is None:
        return []
    lines = []
    for name, colo in medians.items():
        if name == "split":
            continue
        itl, itl99, tpot, ttft = ratios(colo, split)
        at_sites = colo.get("site_itl_p90", math.nan) / split.get("site_itl_p90", math.nan)
        lines.append(f"{name} vs split: ITL p90 {itl:.2f}x lower split (target >= {ITL_TARGET:g}x: "
                     f"{'met' if itl >= ITL_TARGET else 'missed'}), ITL p99 {itl99:.2f}x, TPOT p90 {tpot:.2f}x; "
                     f"TTFT p90 split / {name} {ttft:.2f}x (target <= {TTFT_TARGET:g}x: "
                     f"{'met' if ttft <= TTFT_TARGET else 'missed'}); as the sites stream it, ITL p90 "
                     f"{at_sites:.2f}x lower split")
    return lines


def summary_table(results: list) -> str:
    """One row per load and colocated mode: both targets side by side, and whether they hold together."""
    rows = [("prefill load", "split vs", "ITL p90 colocated / split", "ITL p99", "TPOT p90",
             "TTFT p90 split / colocated", "both targets")]
    for result in results:
        medians = {mode: median_figures(rounds) for mode, rounds in result.figures.items()}
        for name, colo in medians.items():
            if name == "split":
                continue
            itl, itl99, tpot, ttft = ratios(colo, medians["split"])
            met = itl >= ITL_TARGET and ttft <= TTFT_TARGET
            rows.append((f"{result.load:.2f}", name, f"{itl:.2f}x", f"{itl99:.2f}x", f"{tpot:.2f}x", f"{ttft:.2f}x",
                         "met" if met else "missed"))
    return markdown_table(rows)


def report(by_mode: dict[str, list[dict[str, float]]], sites: dict[str, list[dict]] | None = None,
           cpu: dict[str, list[dict[str, float]]] | None = None) -> str:
    """The tables of one load: latency per mode, details, and (when measured) each site's regime and CPU."""
    medians = {mode: median_figures(rounds) for mode, rounds in by_mode.items()}
    main = [("mode", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90", "ITL p99", "TPOT p50 / p90", "output tokens/s",
             "site ITL p50 / p90")]
    detail = [("mode", "requests", "failed", "split", "stream TTFT p90", "long-prompt TTFT p50 / p90",
               "split handoff gap p50 / p90")]
    for mode, m in medians.items():
        main.append((mode, ms(m["ttft_p50"]), ms(m["ttft_p90"]), ms(m["itl_p50"], 1), ms(m["itl_p90"], 1),
                     ms(m["itl_p99"], 1), f"{ms(m['tpot_p50'], 1)} / {ms(m['tpot_p90'], 1)}",
                     f"{m['tokens_per_s']:.0f}", f"{ms(m.get('site_itl_p50', math.nan), 1)} / "
                                                 f"{ms(m.get('site_itl_p90', math.nan), 1)}"))
        detail.append((mode, f"{m['requests']:.0f}", f"{m['failed']:.0f}", pct(m["split_share"]),
                       ms(m["stream_ttft_p90"]), f"{ms(m['long_ttft_p50'])} / {ms(m['long_ttft_p90'])}",
                       f"{ms(m['handoff_p50'])} / {ms(m['handoff_p90'])}"))
    lines = [markdown_table(main), "", markdown_table(detail), ""]
    if sites:
        rows = [("mode", "site", "busy", "rho (time in steps with prompt tokens)", "steps with prompt tokens",
                 "gaps on those steps", "plain decode step", "step with prompt tokens")]
        for mode, per_round in sites.items():
            for name in per_round[0]:
                m = median_figures([r[name] for r in per_round])
                rows.append((mode, name, pct(m["busy"]), pct(m["rho"]), pct(m["chunk_step_share"]),
                             pct(m["gaps_on_chunks"]), ms(m["decode_step_s"], 1), ms(m["chunk_step_s"], 1)))
        lines += [markdown_table(rows), ""]
    if cpu:
        names = list(next(iter(cpu.values()))[0])
        rows = [("mode", *[f"{n} CPU" for n in names])]
        for mode, per_round in cpu.items():
            m = median_figures(per_round)
            rows.append((mode, *[pct(m[n]) for n in names]))
        lines += [markdown_table(rows) + "  (share of one core)", ""]
    return "\n".join(lines + verdicts(medians))


# -- main ------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-loads", default="0.3,0.45,0.6",
                        help="comma-separated loads the long prompts put on the split mode's prefill site (each "
                             "colocated site gets half); each load runs every mode (default 0.3,0.45,0.6)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per load; each runs every mode (default 2)")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per mode per round (default 20)")
    parser.add_argument("--streams", type=int, default=4, help="steady streaming clients (default 4)")
    parser.add_argument("--stream-prompt", type=int, default=64, help="their prompt tokens (default 64)")
    parser.add_argument("--stream-tokens", type=int, default=128, help="their output tokens (default 128)")
    parser.add_argument("--long-prompt", type=int, default=1500, help="long prompt tokens (default 1500)")
    parser.add_argument("--long-tokens", type=int, default=32, help="long prompts' output tokens (default 32)")
    parser.add_argument("--chunk-steps", type=float, default=5.0,
                        help="the scaled chunk's step costs this many plain decode steps (default 5: the published "
                             "100 ms against 20 ms)")
    parser.add_argument("--scaled-chunk", type=int, help="the scaled mode's chunk in tokens (instead of calibrating)")
    parser.add_argument("--modes", default=",".join(m.name for m in MODES),
                        help=f"comma-separated modes to run (default all: {', '.join(m.name for m in MODES)})")
    parser.add_argument("--calibration-seconds", type=float, default=5.0,
                        help="streams alone, to measure the plain decode gap (default 5)")
    parser.add_argument("--size", default="small", choices=sorted(SIZES), help="demo model size (default small)")
    parser.add_argument("--model", type=Path, help="a checkpoint to use instead of the demo model")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="the agents' per-step token budget, i.e. the prefill chunk (default 512, the agent's)")
    parser.add_argument("--dump", type=Path, help="append every request's token arrival times here (JSON lines)")
    parser.add_argument("--frontend-cpu", choices=("any", "first"), default="any",
                        help="where the routers, registries and this load generator run: any CPU (default), or "
                             "the first site's (split: the prefill site's), so the second site's core is its own")
    parser.add_argument("--frontend-priority", action="store_true",
                        help=f"run the routers, registries and this load generator at nice {FRONTEND_NICE} "
                             "(root only), ahead of the sites on the shared cores")
    args = parser.parse_args(argv)
    if args.frontend_priority and args.frontend_cpu == "first":
        parser.error("--frontend-priority and --frontend-cpu first are two ways to place the frontend: give one")
    try:
        args.prefill_loads = [float(v) for v in args.prefill_loads.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--prefill-loads {args.prefill_loads!r}: give comma-separated numbers such as 0.4,0.7")
    if not args.prefill_loads or not all(0 < load < 1.5 for load in args.prefill_loads):
        parser.error("--prefill-loads: each load must be above 0 and below 1.5 (1 keeps the prefill site always busy)")
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(names) - {m.name for m in MODES})
    if unknown or "split" not in names or len(names) < 2:
        parser.error(f"--modes {args.modes!r}: name split and at least one of "
                     f"{', '.join(m.name for m in MODES if m.name != 'split')}")
    args.modes = [m for m in MODES if m.name in names]
    return args


def start_cluster(stack: ExitStack, model_dir: Path, tmp: Path, mode: Mode, chunk: int, cpus: list[list[int]],
                  frontend_cpus: list[int], frontend_priority: bool = False) -> object:
    index = MODES.index(mode)
    names = ("prefill", "decode") if mode.roles == ("prefill", "decode") else (f"site-{index}a", f"site-{index}b")
    sites = [site(name, role, cpus[i]) for i, (name, role) in enumerate(zip(names, mode.roles))]
    log(f"starting the {mode.name} cluster: " + ", ".join(f"{s.name} ({s.role}, CPU {s.cpus or 'any'})"
                                                           for s in sites) + f", chunk {chunk}")
    agent = {"max_num_batched_tokens": chunk, "kv_cache_bytes": 256 << 20}
    # Colocated means colocated: the router may not split a request across the two sites.
    router = {"allow_split": mode.name == "split"}
    if frontend_cpus:  # the cluster's config checks the sites' CPUs against this process's own
        pin_process(os.getpid(), sorted({cpu for group in cpus for cpu in group}))
    cluster = stack.enter_context(running_cluster(model_dir, MODEL_NAME, sites, tmp / f"mode-{index}",
                                                  agent=agent, router=router))
    if frontend_cpus:
        for pid in (cluster.processes["router"].pid, cluster.processes["registry"].pid, os.getpid()):
            pin_process(pid, frontend_cpus)
    if frontend_priority:  # started by this process, they inherited its nice value; the sites go back to 0
        for s in sites:
            set_priority(cluster.processes[s.name].pid, 0)
    return cluster


def warm_up(cluster, name: str, long_prompt: int, vocab: int) -> None:
    log(f"warming up {name}")
    asyncio.run(run_round(cluster, name, Workload(4.0, 2, 32, 8, long_prompt, 4, 2.0, vocab), seed="warm-up"))


class Idle:
    """Keeps the clusters not being measured stopped (SIGSTOP to each process group), so their
    heartbeats, snapshot polls and timers do not wake on the cores the measured cluster runs on, as
    they would not on machines of their own. A cluster is resumed for its rounds and waited on until
    its router sees both sites live again."""

    def __init__(self) -> None:
        self.stopped: list = []

    def stop(self, cluster) -> None:
        self._signal(cluster, signal.SIGSTOP)
        self.stopped.append(cluster)

    def resume(self, cluster) -> None:
        if cluster not in self.stopped:
            return
        self.stopped.remove(cluster)
        self._signal(cluster, signal.SIGCONT)
        resumed = time.monotonic()
        cluster.wait_for(lambda: router_live_sites(cluster, since=resumed) == len(cluster.config.sites), 60.0,
                         "the router to see every site live again after the pause")
        time.sleep(RESUME_SETTLE_S)

    def resume_all(self) -> None:
        for cluster in list(self.stopped):
            self.stopped.remove(cluster)
            self._signal(cluster, signal.SIGCONT)

    @staticmethod
    def _signal(cluster, signum: int) -> None:
        for process in cluster.processes.values():
            if process.pid is not None:
                try:
                    os.killpg(process.pid, signum)  # each child leads a session of its own
                except ProcessLookupError:
                    continue


RESUME_SETTLE_S = 2.0  # after the router sees the sites again: fresh heartbeats and a fresh snapshot


def router_live_sites(cluster, since: float) -> int:
    """Sites the cluster's router places with, counted only from a snapshot it fetched after `since`."""
    with cluster.http_client(timeout=5.0) as http:
        health = http.get(f"{cluster.router_url}/healthz").json()
    fetched_ago = health.get("snapshot_age_s")
    if fetched_ago is not None and time.monotonic() - float(fetched_ago) < since:
        return -1
    return int(health.get("live_sites", -1))


def steps_of(chunk: int, calibration: Calibration) -> float:
    """How many plain decode gaps a step carrying a chunk of this many prompt tokens lasts."""
    return 1 + chunk * calibration.prompt_token_s / calibration.plain_gap_s


def start_all(stack: ExitStack, model_dir: Path, tmp: Path, args: argparse.Namespace,
              vocab: int) -> tuple[dict, Calibration, int, list]:
    """Every mode's cluster, warmed up; the calibration; the scaled chunk; every cluster started (with
    the calibration's own where no mode has the default chunk)."""
    modes = {m.name: m for m in args.modes}
    clusters = {m.name: start_cluster(stack, model_dir, tmp, m, args.max_batched_tokens, args.site_cpus,
                                       args.frontend_cpus, args.frontend_priority)
                for m in args.modes if not m.scaled_chunk}
    for name, cluster in clusters.items():
        warm_up(cluster, name, args.long_prompt, vocab)
    reference = clusters.get("colocated")
    if reference is None:  # only the scaled mode asked for: calibrate on a default-chunk pair all the same
        reference = start_cluster(stack, model_dir, tmp, MODES[0], args.max_batched_tokens, args.site_cpus,
                                       args.frontend_cpus, args.frontend_priority)
        warm_up(reference, "colocated (for the calibration)", args.long_prompt, vocab)
    calibration = calibrate(reference, clusters["split"], args, vocab)
    chunk = args.scaled_chunk or calibration.scaled_chunk(args.chunk_steps, args.max_batched_tokens)
    log(f"calibration: {calibration_line(calibration, args, chunk)}")
    if "colocated-scaled" in modes:
        clusters["colocated-scaled"] = start_cluster(stack, model_dir, tmp, modes["colocated-scaled"], chunk,
                                                     args.site_cpus, args.frontend_cpus, args.frontend_priority)
        warm_up(clusters["colocated-scaled"], "colocated-scaled", args.long_prompt, vocab)
    return clusters, calibration, chunk, list({id(c): c for c in (*clusters.values(), reference)}.values())


def calibration_line(calibration: Calibration, args: argparse.Namespace, chunk: int) -> str:
    return (f"plain inter-token gap {ms(calibration.plain_gap_s, 1)} (engine decode step "
            f"{ms(calibration.decode_step_s, 1)}), {1e3 * calibration.prompt_token_s:.3f} ms per prompt token: a "
            f"{args.max_batched_tokens}-token chunk step lasts {steps_of(args.max_batched_tokens, calibration):.1f} "
            f"plain gaps, the scaled chunk of {chunk} tokens {steps_of(chunk, calibration):.1f}; a "
            f"{args.long_prompt}-token prompt alone takes {ms(calibration.solo_ttft_s)} to its first token on the "
            f"split prefill site")


@dataclass(slots=True)
class LoadResult:
    load: float
    long_every: float
    figures: dict[str, list[dict[str, float]]]
    sites: dict[str, list[dict]]
    cpu: dict[str, list[dict[str, float]]]
    num_failed: int = 0


def run_load(clusters: dict, load: float, calibration: Calibration, args: argparse.Namespace,
             vocab: int, idle: Idle) -> LoadResult:
    """Every mode at one load, rounds alternating the order of the modes."""
    long_every = calibration.solo_ttft_s / load
    workload = Workload(args.seconds, args.streams, args.stream_prompt, args.stream_tokens, args.long_prompt,
                        args.long_tokens, long_every, vocab)
    log(f"load {load:.2f}: {args.streams} streams of {args.stream_prompt}+{args.stream_tokens} tokens, "
        f"{args.long_prompt}-token prompts ({args.long_tokens} out) every {long_every:.2f} s on average")
    order = [m.name for m in args.modes]
    result = LoadResult(load, long_every, *({name: [] for name in order} for _ in range(3)))
    for index in range(args.rounds):
        for name in order if index % 2 == 0 else order[::-1]:
            idle.resume(clusters[name])
            measured, errors = measure(clusters[name], name, workload, f"{load}/{index}", args.dump)
            idle.stop(clusters[name])
            result.figures[name].append(measured.figures)
            result.sites[name].append(measured.sites)
            result.cpu[name].append(measured.cpu_share)
            result.num_failed += len(errors)
            chunked = ", ".join(f"{s} {pct(r['gaps_on_chunks'])}" for s, r in measured.sites.items())
            log(f"load {load:.2f} round {index + 1} {name}: {summary(measured.figures)}; "
                f"gaps on steps with prompt tokens {chunked}")
            for error in errors[:3]:
                log(f"  error: {error}")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log(f"machine: {machine_line()}")
    args.site_cpus = cpu_for_sites(2)  # before this process is held to one of them
    interference = core_interference(args.site_cpus)
    independence = (f"a one-thread loop on the first site's CPU takes {interference:.2f}x as long while the second "
                    f"site's CPU is busy (1.00x: independent cores)" if interference is not None
                    else "the sites are not held to separate CPUs")
    log(f"core check: {independence}")
    minutes = len(args.prefill_loads) * len(args.modes) * args.rounds * args.seconds / 60
    log(f"measuring {len(args.prefill_loads)} load(s) x {len(args.modes)} modes x {args.rounds} round(s) x "
        f"{args.seconds:.0f} s = {minutes:.1f} min, after about 2 min of start-up and calibration")
    args.frontend_cpus = args.site_cpus[0] if args.frontend_cpu == "first" else []
    if args.frontend_cpu == "first" and not args.frontend_cpus:
        sys.exit("--frontend-cpu first: the sites are not held to CPUs on this machine (Linux with taskset)")
    with tempfile.TemporaryDirectory(prefix="edgefire-disagg-") as tmp, sigterm_as_interrupt(), ExitStack() as stack:
        model_dir = endless_model(Path(tmp) / "model", args.size, args.model)
        vocab = vocab_size(model_dir)
        if args.frontend_cpus:  # each cluster's router and registry, and this process, as the cluster starts
            log(f"the routers, registries and this load generator are held to CPU {args.frontend_cpus[0]}, "
                f"the first site's")
        if args.frontend_priority:
            set_priority(os.getpid(), FRONTEND_NICE)
            log(f"the routers, registries and this load generator run at nice {FRONTEND_NICE}, ahead of the sites")
        clusters, calibration, chunk, started = start_all(stack, model_dir, Path(tmp), args, vocab)
        idle = Idle()
        stack.callback(idle.resume_all)  # before the clusters stop (the stack unwinds last in, first out)
        for cluster in started:
            idle.stop(cluster)
        results = [run_load(clusters, load, calibration, args, vocab, idle) for load in args.prefill_loads]
    print(f"\nMachine: {machine_line()}; {independence}. Calibration: {calibration_line(calibration, args, chunk)}.")
    for result in results:
        print(f"\n### Prefill load {result.load:.2f} on the split prefill site (a long prompt every "
              f"{result.long_every:.2f} s on average)\n")
        print(report(result.figures, result.sites, result.cpu))
    if "split" in results[0].figures and len(results[0].figures) > 1:
        print(f"\n### Summary (targets: ITL p90 >= {ITL_TARGET:g}x lower split, TTFT p90 <= {TTFT_TARGET:g}x worse)\n")
        print(summary_table(results))
    return 1 if any(result.num_failed for result in results) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; clusters stopped", file=sys.stderr)
        sys.exit(130)
