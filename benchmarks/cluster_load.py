"""Load on the one-machine cluster: N concurrent streaming clients for T seconds, then the same with one
site killed (SIGKILL) halfway through. Loopback only; stops by itself.

    .venv/bin/python benchmarks/cluster_load.py [--clients 8] [--seconds 20] [--max-tokens 32] [--model DIR]

Starts its own cluster (`deploy.launcher.Cluster`, the same one `edgefire up` runs, on free ports and a
temporary state directory), so it never touches a cluster you have running. Prints one table:
success rate, time to first token p50/p99, inter-token gap p50/p99, and output tokens/s, for the
fault-free run and the run with a site killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import percentile  # noqa: E402
from deploy.cluster_config import ClusterConfig, demo_sites  # noqa: E402
from deploy.launcher import Cluster  # noqa: E402


@dataclass(slots=True)
class RunStats:
    name: str
    num_ok: int = 0
    num_failed: int = 0
    num_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    killed: str = ""
    killed_at: float = 0.0
    num_cut: int = 0      # streams that were decoding on the killed site when it died (and had to resume)


async def one_request(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                      stats: RunStats) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    last, finish, tokens = None, None, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            decode_site = response.headers.get("x-edgefire-decode-site")
            if response.status_code != 200:
                stats.num_failed += 1
                stats.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    stats.num_failed += 1
                    stats.errors.append(event["error"]["message"][:200])
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event["choices"]:
                    now = time.perf_counter()
                    if last is None:
                        stats.ttft_s.append(now - started)
                    else:
                        stats.gaps_s.append(now - last)
                    last = now
                    finish = choice["finish_reason"] or finish
    except httpx.HTTPError as exc:
        stats.num_failed += 1
        stats.errors.append(f"{type(exc).__name__}: {exc}")
        return
    if stats.killed_at and decode_site == stats.killed and started < stats.killed_at < time.perf_counter():
        stats.num_cut += 1
    if finish in ("stop", "length"):
        stats.num_ok += 1
        stats.num_tokens += tokens
    else:
        stats.num_failed += 1
        stats.errors.append(f"stream ended without a finish reason after {tokens} tokens")


async def client_loop(http, model, client_id: int, max_tokens: int, deadline: float, stats: RunStats) -> None:
    i = 0
    while time.perf_counter() < deadline:
        prompt = [(client_id * 131 + i * 17 + 13 * j) % 500 + 5 for j in range(24 + (i % 4) * 8)]
        await one_request(http, model, prompt, max_tokens, stats)
        i += 1


async def run_load(cluster: Cluster, name: str, clients: int, seconds: float, max_tokens: int,
                   kill_at_s: float | None = None) -> RunStats:
    stats = RunStats(name)
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=120.0, limits=limits,
                                 headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
        started = time.perf_counter()
        deadline = started + seconds
        tasks = [asyncio.create_task(client_loop(http, cluster.model, c, max_tokens, deadline, stats))
                 for c in range(clients)]
        if kill_at_s is not None:
            await asyncio.sleep(kill_at_s)
            # The decode-only site: with it gone, in-flight streams there must resume elsewhere.
            stats.killed = cluster.config.sites[1].name
            stats.killed_at = time.perf_counter()
            await asyncio.to_thread(cluster.kill_site, stats.killed)
        await asyncio.gather(*tasks)  # clients stop starting requests at the deadline; in-flight ones finish
        stats.elapsed_s = time.perf_counter() - started
    return stats


def table(runs: list[RunStats]) -> str:
    header = ("run", "requests", "success", "TTFT p50", "TTFT p99", "inter-token p50", "inter-token p99",
              "output tok/s")
    rows = [header]
    for r in runs:
        total = r.num_ok + r.num_failed
        rows.append((r.name, str(total), f"{100 * r.num_ok / max(1, total):.1f}%",
                     f"{1000 * percentile(r.ttft_s, 0.5):.0f} ms", f"{1000 * percentile(r.ttft_s, 0.99):.0f} ms",
                     f"{1000 * percentile(r.gaps_s, 0.5):.1f} ms", f"{1000 * percentile(r.gaps_s, 0.99):.1f} ms",
                     f"{r.num_tokens / r.elapsed_s:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def demo_cluster_config(tmp: Path, model_dir: Path | None, size: str, **agent) -> ClusterConfig:
    """The demo's three sites (prefill-only, decode-only, both) on free ports under `tmp`, CPU float32,
    serving `model_dir` or a fresh demo model of `size`; `agent` settings override the defaults."""
    if model_dir is None:
        from engine.demo import make_demo_model
        model_dir = make_demo_model(tmp / "demo-model", size)
    sites = demo_sites(3)
    for site in sites:
        site.grpc_port = site.metrics_port = 0
    return ClusterConfig(model_dir=model_dir, model_name="demo", sites=sites, state_dir=tmp / "state",
                         router_port=0, registry_port=0, agent={"device": "cpu", "dtype": "float32", **agent})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="checkpoint (default: a fresh small demo model)")
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="edgefire-load-") as tmp:
        config = demo_cluster_config(Path(tmp), args.model, args.size)
        cluster = Cluster(config)
        print(f"starting a 3-site cluster ({', '.join(f'{s.name}:{s.role}' for s in config.sites)}) ...", flush=True)
        cluster.start()
        try:
            print(f"{args.clients} streaming clients x {args.seconds:.0f}s, max_tokens {args.max_tokens}, greedy",
                  flush=True)
            asyncio.run(run_load(cluster, "warm-up", args.clients, 3.0, args.max_tokens))
            clean = asyncio.run(run_load(cluster, "all sites up", args.clients, args.seconds, args.max_tokens))
            faulty = asyncio.run(run_load(cluster, "decode site killed at T/2", args.clients, args.seconds,
                                          args.max_tokens, kill_at_s=args.seconds / 2))
        finally:
            cluster.stop()
    faulty.name = f"{faulty.killed} killed at T/2"
    print()
    print(table([clean, faulty]))
    print(f"\nstreams decoding on {faulty.killed} when it was killed (resumed on another site): {faulty.num_cut}")
    for run in (clean, faulty):
        for error in run.errors[:5]:
            print(f"  {run.name}: {error}")
    return 0 if faulty.num_failed == 0 and clean.num_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
