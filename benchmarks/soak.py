"""Soak: minutes at saturation through the router of a local cluster, with agents killed at random (and
restarted) and the registry restarted, or away for a long outage. Loopback only; stops by itself.

    .venv/bin/python benchmarks/soak.py --minutes 30 [--clients 16] [--max-tokens 32]
    .venv/bin/python benchmarks/soak.py --minutes 13 --registry-outage-minutes 10

Starts its own cluster (`deploy.launcher.Cluster`, what `edgefire up` runs: registry, three demo sites,
one router with its default snapshot_max_age_s of 60 s) on free ports in a temporary directory.
`--clients` streaming clients send requests back to back for the whole run (saturation: on a
small machine the default keeps every core busy; raise it on a bigger one). Every `--kill-every-s` (randomised ±50%) one agent, chosen at
random, is killed with SIGKILL and started again `--down-s` later; one at a time. The registry is
stopped once, in the middle of the run, for `--registry-outage-minutes` (a restart of a few seconds
when 0); an outage longer than the router's snapshot_max_age_s has it serve from its own site checks.

A progress line every `--progress-s`. At the end, once the load has stopped and any lease could
have expired, it reports: requests, failures (non-200, an in-band error event, a stream without a
finish), KV blocks still in use per agent (leaked: must be 0), KV leases left, and the RSS growth of
every process from after the warm-up (an agent restarted during the run: from its last start).
Exit status 0 only when no request failed and nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cluster_load import RunStats, client_loop, demo_cluster_config  # noqa: E402
from deploy.launcher import Cluster  # noqa: E402
from node_agent.client import AgentClient  # noqa: E402

LEASE_TTL_S = 10.0  # the agents' KV lease TTL here: the end-of-run check waits this long for abandoned leases


@dataclass(slots=True)
class Chaos:
    num_kills: int = 0
    site_down: str | None = None
    registry: str = "up"
    rss_start_kb: dict[str, int] = field(default_factory=dict)   # process -> RSS after warm-up / its last start
    restarts: dict[str, int] = field(default_factory=dict)


def rss_kb(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def log(started: float, message: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)


async def agent_health(cluster: Cluster, site: str):
    async with AgentClient(cluster.site_address(site), cluster.config.peer_token) as agent:
        return await agent.health(timeout=5.0)


async def wait_serving(cluster: Cluster, site: str, timeout_s: float = 120.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            await agent_health(cluster, site)
            return
        except Exception:  # not up yet: connection refused, or the engine still loading
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.5)


async def kill_agents(cluster: Cluster, chaos: Chaos, rng: random.Random, every_s: float, down_s: float,
                      deadline: float, started: float) -> None:
    names = [site.name for site in cluster.config.sites]
    while True:
        wait_s = rng.uniform(0.5, 1.5) * every_s
        if time.perf_counter() + wait_s + down_s > deadline:
            return
        await asyncio.sleep(wait_s)
        site = rng.choice(names)
        chaos.site_down = site
        await asyncio.to_thread(cluster.kill_site, site)
        chaos.num_kills += 1
        log(started, f"killed agent {site} (SIGKILL); restarting it in {down_s:.0f}s")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(cluster.start_site, site, False)
        await wait_serving(cluster, site)
        chaos.site_down = None
        chaos.restarts[site] = chaos.restarts.get(site, 0) + 1
        chaos.rss_start_kb[site] = rss_kb(cluster.processes[site].pid)
        log(started, f"agent {site} serves again")


async def registry_outage(cluster: Cluster, chaos: Chaos, at_s: float, outage_s: float, started: float) -> None:
    await asyncio.sleep(at_s)
    await asyncio.to_thread(cluster.stop_registry)
    chaos.registry = "down"
    log(started, f"registry stopped for {outage_s:.0f}s")
    await asyncio.sleep(outage_s)
    await asyncio.to_thread(cluster.start_registry)
    chaos.registry = "up"
    chaos.restarts["registry"] = 1
    chaos.rss_start_kb["registry"] = rss_kb(cluster.processes["registry"].pid)
    log(started, "registry started again")


async def progress(cluster: Cluster, stats: RunStats, chaos: Chaos, every_s: float, started: float) -> None:
    last_total, last_at = 0, time.perf_counter()
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=5.0) as http:
        while True:
            await asyncio.sleep(every_s)
            total, now = stats.num_ok + stats.num_failed, time.perf_counter()
            try:
                health = (await http.get("/healthz")).json()
                router = f"router {health['registry']}/{health['view']}, {health['live_sites']} live sites"
            except (httpx.HTTPError, ValueError) as exc:
                router = f"router health unknown ({type(exc).__name__})"
            rate = (total - last_total) / (now - last_at)
            log(started, f"{total} requests ({stats.num_failed} failed), {rate:.1f} req/s; "
                         f"{chaos.num_kills} agent kills; registry {chaos.registry}; {router}")
            last_total, last_at = total, now


async def soak(cluster: Cluster, args: argparse.Namespace) -> tuple[RunStats, Chaos]:
    started = time.perf_counter()
    stats, chaos = RunStats("soak"), Chaos()
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=cluster.router_url, timeout=300.0, limits=limits,
                                 headers={"Authorization": f"Bearer {cluster.api_key}"}) as http:
        log(started, "warm-up (10 s)")
        warm_up = RunStats("warm-up")
        await asyncio.gather(*(client_loop(http, cluster.model, c, args.max_tokens, time.perf_counter() + 10, warm_up)
                               for c in range(args.clients)))
        chaos.rss_start_kb = {name: rss_kb(p.pid) for name, p in cluster.processes.items()}
        seconds = args.minutes * 60
        outage_s = args.registry_outage_minutes * 60 or args.registry_restart_s
        log(started, f"soak: {args.clients} clients for {args.minutes:g} min, an agent killed every "
                     f"~{args.kill_every_s:.0f}s, registry away {outage_s:.0f}s from {(seconds - outage_s) / 2:.0f}s")
        deadline = time.perf_counter() + seconds
        rng = random.Random(args.seed)
        background = [
            asyncio.create_task(kill_agents(cluster, chaos, rng, args.kill_every_s, args.down_s, deadline, started)),
            asyncio.create_task(registry_outage(cluster, chaos, (seconds - outage_s) / 2, outage_s, started)),
            asyncio.create_task(progress(cluster, stats, chaos, args.progress_s, started)),
        ]
        clients = [client_loop(http, cluster.model, c, args.max_tokens, deadline, stats) for c in range(args.clients)]
        await asyncio.gather(*clients)
        stats.elapsed_s = seconds
        background[-1].cancel()
        await asyncio.gather(*background[:-1])  # an agent down, or the registry away, comes back first
        await asyncio.gather(background[-1], return_exceptions=True)
    log(started, f"load stopped; waiting {LEASE_TTL_S + 5:.0f}s for abandoned leases to expire before counting")
    await asyncio.sleep(LEASE_TTL_S + 5)
    return stats, chaos


async def leftovers(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    """site -> (KV blocks in use, total, leases) once the cluster is idle."""
    result = {}
    for site in cluster.config.sites:
        health = await agent_health(cluster, site.name)
        result[site.name] = (health.kv_blocks_total - health.kv_blocks_free, health.kv_blocks_total,
                             health.num_kv_leases)
    return result


def report(stats: RunStats, chaos: Chaos, left: dict, cluster: Cluster) -> bool:
    total = stats.num_ok + stats.num_failed
    print(f"\nrequests: {total}  served: {stats.num_ok}  failed: {stats.num_failed}  "
          f"output tokens: {stats.num_tokens}  ({total / stats.elapsed_s:.1f} req/s)")
    print(f"agent kills: {chaos.num_kills}  restarts: {chaos.restarts}")
    for error in stats.errors[:10]:
        print(f"  failure: {error}")
    print("\n| site | KV blocks in use (leaked) | KV blocks total | KV leases left |")
    print("|---|---|---|---|")
    for site, (in_use, num_total, leases) in left.items():
        print(f"| {site} | {in_use} | {num_total} | {leases} |")
    print("\n| process | RSS at start (MiB) | RSS at end (MiB) | growth (MiB) | measured from |")
    print("|---|---|---|---|---|")
    for name, process in cluster.processes.items():
        start, end = chaos.rss_start_kb.get(name, 0), rss_kb(process.pid)
        since = "its last restart" if chaos.restarts.get(name) else "after the warm-up"
        print(f"| {name} | {start / 1024:.0f} | {end / 1024:.0f} | {(end - start) / 1024:+.1f} | {since} |")
    leaked = any(in_use or leases for in_use, _total, leases in left.values())
    return stats.num_failed == 0 and not leaked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kill-every-s", type=float, default=60.0, help="mean time between agent kills")
    parser.add_argument("--down-s", type=float, default=10.0, help="how long a killed agent stays down")
    parser.add_argument("--registry-outage-minutes", type=float, default=0.0,
                        help="registry away this long, mid-run (0: a restart of --registry-restart-s)")
    parser.add_argument("--registry-restart-s", type=float, default=5.0)
    parser.add_argument("--progress-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, help="checkpoint (default: a fresh demo model)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    args = parser.parse_args()
    if args.registry_outage_minutes >= args.minutes:
        parser.error("--registry-outage-minutes must be shorter than --minutes (the outage sits mid-run)")

    with tempfile.TemporaryDirectory(prefix="edgefire-soak-") as tmp:
        config = demo_cluster_config(Path(tmp), args.model, args.size, kv_lease_ttl_s=LEASE_TTL_S)
        cluster = Cluster(config)
        print(f"starting a 3-site cluster ({', '.join(f'{s.name}:{s.role}' for s in config.sites)}) ...", flush=True)
        cluster.start()
        try:
            stats, chaos = asyncio.run(soak(cluster, args))
            left = asyncio.run(leftovers(cluster))
            ok = report(stats, chaos, left, cluster)
        finally:
            cluster.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
