"""A fleet of routers on one machine: 1 → 2 → 4 routers in front of the same fake site, in one run.

    .venv/bin/python benchmarks/fleet.py [--routers 1,2,4] [--seconds 5] [--concurrency 32] [--limit 300]
                                         [--limit-seconds 10] [--db postgresql+psycopg://...]

Processes on loopback: the registry (`edgefire registry serve`, SQLite unless --db), a fake agent
that answers at once (tests/router/router_fake_agent.py, as benchmarks/router_overhead.py uses),
N routers (uvicorn + uvloop, as `edgefire router` runs them) and this load generator, which spreads
`--concurrency` keep-alive connections over the routers round robin. For each N:
- throughput: streamed chat completions of `--tokens` tokens per second, over all routers, for
  `--seconds`, with a key without limits;
- the limit's error: a fresh key limited to `--limit` requests a minute, hammered through all routers
  for `--limit-seconds` (under a minute: every admission falls in one window); admitted ÷ limit − 1;
- the registry's CPU per fleet report: the registry process's CPU time over the whole step divided by
  the reports it applied (every router reports each second, and at once when a key's budget runs out),
  beside the routers' CPU per request.
Before the runs it also times `apply_report` alone in this process (one router, three keys): the
registry's own work per report, without HTTP, snapshot polls or heartbeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "router"), str(ROOT / "benchmarks")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from harness import log, machine_line  # noqa: E402
from router_overhead import HttpConnection, router_cpu_s, run_router  # noqa: E402

ADMIN, ROUTER_TOKEN = "bench-admin", "bench-router"
MESSAGES = [{"role": "user", "content": "What is the nearest edge site to Frankfurt?"}]


def run_agent(model_dir: str, conn) -> None:
    import uvloop
    uvloop.run(_agent(model_dir, conn))


async def _agent(model_dir: str, conn) -> None:
    """The fake site, heartbeating every second (routers drop a site whose heartbeat is 15 s old)."""
    from router_fake_agent import FakeAgent, model_info_from_dir, word_token_ids

    from registry.client import RegistryClient

    info = model_info_from_dir(model_dir)
    agent = await FakeAgent("bench", info, word_token_ids(info)).start()
    conn.send({"agent": agent.address, "model": info.model})
    loop = asyncio.get_running_loop()
    registry_url, site_token = await loop.run_in_executor(None, conn.recv)
    stop = loop.run_in_executor(None, conn.recv)  # until told to stop
    async with RegistryClient(registry_url, site_token) as site:
        while not stop.done():
            await site.heartbeat({"kv_blocks_total": 100000, "kv_blocks_free": 100000, "block_size": 16})
            await asyncio.wait([stop], timeout=1.0)
    await agent.stop()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_apply_report(db_url: str | None, num_reports: int = 300) -> float:
    """CPU ms of one `apply_report` in this process (one router, three limited keys with usage), on
    `db_url` (migrated here) or a temporary SQLite file."""
    from registry.fleet import FleetReport, KeyDemand, RateCharge, UsageCount
    from registry.migrate import upgrade_to_head
    from registry.records import ApiKeySpec
    from registry.store import RegistryStore

    with tempfile.TemporaryDirectory() as tmp:
        url = db_url or f"sqlite:///{tmp}/r.db"
        upgrade_to_head(url)
        store = RegistryStore.open(url)
        keys = [store.access.create_api_key(ApiKeySpec(f"k{i}", requests_per_minute=600, tokens_per_minute=10**6),
                                            "bench")[0].id for i in range(3)]
        router_id = f"timing-{time.monotonic_ns()}"
        start = time.process_time()
        for seq in range(1, num_reports + 1):
            now = int(time.time())
            store.fleet.apply_report(FleetReport(router_id, seq, "bench", [RateCharge(k, now, 2, 300) for k in keys],
                                                 [UsageCount(k, "m", now // 3600 * 3600, 2, 20, 5, 30) for k in keys],
                                                 [KeyDemand(k, 2, 300, 1, 100) for k in keys]))
        cpu_ms = (time.process_time() - start) * 1000 / num_reports
        store.close()
    return cpu_ms


class Fleet:
    """The registry process, the fake agent process and the routers, started and stopped together."""

    def __init__(self, args, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.ctx = mp.get_context("spawn")
        self.routers: list[tuple] = []   # (process, conn, url)

    def start(self) -> dict:
        from deploy.processes import free_port
        from registry.migrate import upgrade_to_head

        db = self.args.db or f"sqlite:///{self.tmp / 'registry.db'}"
        upgrade_to_head(db)
        port = free_port()
        self.registry_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "EDGEFIRE_ADMIN_TOKEN": ADMIN, "EDGEFIRE_ROUTER_TOKEN": ROUTER_TOKEN}
        self.registry = subprocess.Popen([sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "registry",
                                          "serve", "--db", db, "--port", str(port), "--no-migrate"], env=env, cwd=ROOT)
        self.agent_conn, child = self.ctx.Pipe()
        self.agent = self.ctx.Process(target=run_agent, args=(self.args.model_dir, child))
        self.agent.start()
        agent = self.agent_conn.recv()
        return asyncio.run(self._seed(agent))

    async def _seed(self, agent: dict) -> dict:
        import httpx

        from registry.client import RegistryClient

        async with RegistryClient(self.registry_url, ADMIN) as admin:
            for _ in range(300):
                try:
                    await admin.list_sites()
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            await admin.create_site("bench", region="eu", country="DE", lat=50.1, lon=8.7,
                                    grpc_address=agent["agent"], models=[{"model": agent["model"], "role": "both"}],
                                    heartbeat_interval_s=1.0)
            site_token = (await admin.issue_site_token("bench"))["token"]
            api_key = (await admin.create_api_key("bench"))["key"]
        self.agent_conn.send((self.registry_url, site_token))
        while not await self._site_alive():
            await asyncio.sleep(0.1)
        return {**agent, "api_key": api_key}

    async def _site_alive(self) -> bool:
        from registry.client import RegistryClient

        async with RegistryClient(self.registry_url, ADMIN) as admin:
            return all(site["alive"] for site in (await admin.admin_snapshot())["sites"])

    def scale_to(self, num_routers: int) -> list[str]:
        while len(self.routers) < num_routers:
            conn, child = self.ctx.Pipe()
            process = self.ctx.Process(target=run_router, args=(self.registry_url, child))
            process.start()
            self.routers.append((process, conn, conn.recv()))
        return [url for _p, _c, url in self.routers]

    def routers_cpu_s(self) -> float:
        return sum(router_cpu_s(conn) for _p, conn, _u in self.routers)

    async def limited_key(self, limit: int) -> str:
        from registry.client import RegistryClient

        async with RegistryClient(self.registry_url, ADMIN) as admin:
            return (await admin.create_api_key(f"limited-{time.monotonic_ns()}", requests_per_minute=limit))["key"]

    async def reports_applied(self) -> int:
        from registry.client import RegistryClient

        async with RegistryClient(self.registry_url, ADMIN) as admin:
            return sum(r["last_seq"] for r in (await admin.routers())["items"])

    def stop(self) -> None:
        for process, conn, _url in self.routers:
            conn.send("stop")
            process.join(20)
        self.agent_conn.send("stop")
        self.agent.join(20)
        self.registry.terminate()
        self.registry.wait(20)


async def run_step(fleet: Fleet, cluster: dict, urls: list[str], args) -> dict:
    body = json.dumps({"model": cluster["model"], "messages": MESSAGES, "max_tokens": args.tokens,
                       "temperature": 0, "stream": True}).encode()

    def connections(api_key: str) -> list[HttpConnection]:
        out = []
        for i in range(args.concurrency):
            host, port = urls[i % len(urls)].removeprefix("http://").split(":")
            out.append(HttpConnection(host, int(port), api_key, body))
        return out

    async def drive(conns: list[HttpConnection], seconds: float) -> dict[int, int]:
        statuses: dict[int, int] = {}
        deadline = time.perf_counter() + seconds

        async def worker(conn: HttpConnection) -> None:
            while time.perf_counter() < deadline:
                status = await conn.status()
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(worker(c) for c in conns))
        return statuses

    def close(conns: list[HttpConnection]) -> None:
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()

    registry_cpu, reports, router_cpu = process_cpu_s(fleet.registry.pid), await fleet.reports_applied(), \
        fleet.routers_cpu_s()
    open_conns = connections(cluster["api_key"])
    await drive(open_conns, 1.0)   # warm up: connections, tokenizer assets
    start = time.perf_counter()
    statuses = await drive(open_conns, args.seconds)
    rps = statuses.get(200, 0) / (time.perf_counter() - start)
    close(open_conns)
    if set(statuses) != {200}:
        raise RuntimeError(f"unlimited key answered {statuses}")
    key = await fleet.limited_key(args.limit)
    limited_conns = connections(key)
    limited = await drive(limited_conns, args.limit_seconds)
    close(limited_conns)
    admitted = limited.get(200, 0)
    if set(limited) - {200, 429}:
        raise RuntimeError(f"limited key answered {limited}")
    await asyncio.sleep(1.5 * 1.0)   # the routers' next reports
    registry_cpu = process_cpu_s(fleet.registry.pid) - registry_cpu
    reports = await fleet.reports_applied() - reports
    router_cpu = fleet.routers_cpu_s() - router_cpu
    served = statuses[200] + sum(limited.values())
    return {"rps": rps, "admitted": admitted, "refused": limited.get(429, 0), "error": admitted / args.limit - 1,
            "reports": reports, "registry_cpu_ms_per_report": registry_cpu * 1000 / max(1, reports),
            "router_cpu_ms_per_request": router_cpu * 1000 / max(1, served)}


def main() -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routers", default="1,2,4", help="router counts to step through")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    parser.add_argument("--concurrency", type=int, default=32, help="connections, spread over the routers")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per streamed completion")
    parser.add_argument("--limit", type=int, default=300, help="requests per minute of the limited key")
    parser.add_argument("--limit-seconds", type=float, default=10.0, help="how long the limited key is hammered")
    parser.add_argument("--db", help="registry database URL (default: a SQLite file)")
    args = parser.parse_args()
    counts = [int(n) for n in args.routers.split(",")]
    apply_ms = time_apply_report(args.db)
    log(f"apply_report alone: {apply_ms:.2f} ms CPU per report in this process (1 router, 3 limited keys, "
        f"{'PostgreSQL' if args.db else 'SQLite'})")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        from engine.demo import make_demo_model
        args.model_dir = str(make_demo_model(Path(tmp) / "model", size="tiny"))
        fleet = Fleet(args, Path(tmp))
        try:
            cluster = fleet.start()
            for n in counts:
                urls = fleet.scale_to(n)
                log(f"{n} router(s): throughput {args.seconds:g} s, then a key limited to {args.limit}/min "
                    f"for {args.limit_seconds:g} s")
                results[n] = uvloop.run(run_step(fleet, cluster, urls, args))
        finally:
            fleet.stop()
    print(f"\n{machine_line()}")
    print(f"streamed chat completions of {args.tokens} tokens, concurrency {args.concurrency} over the routers; "
          f"limit {args.limit}/min hammered for {args.limit_seconds:g} s; registry on "
          f"{'PostgreSQL' if args.db else 'SQLite'}; apply_report alone {apply_ms:.2f} ms CPU")
    print(f"{'routers':>7} {'req/s':>8} {'admitted':>9} {'refused':>8} {'limit error':>12} {'reports':>8} "
          f"{'registry CPU ms/report':>23} {'router CPU ms/req':>18}")
    for n, r in results.items():
        print(f"{n:>7} {r['rps']:8.1f} {r['admitted']:9d} {r['refused']:8d} {r['error']:+12.1%} {r['reports']:8d} "
              f"{r['registry_cpu_ms_per_report']:23.2f} {r['router_cpu_ms_per_request']:18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
