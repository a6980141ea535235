"""Registry load benchmark: N simulated sites heartbeating at 1 Hz against `edgefire registry serve`,
and snapshot latency with 1,000 and 10,000 sites, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/registry_load.py                      # both backends, defaults
    .venv/bin/python benchmarks/registry_load.py --backend sqlite --sites 2000 --duration 15

The service runs as its own process (`--workers` uvicorn workers, default 1, as
`edgefire registry serve --workers N` runs it), the load generator in this one; both on loopback. The generator speaks minimal HTTP/1.1 over asyncio streams (one keep-alive connection
per simulated site, as agents have) so that it costs far less CPU than the server it measures.
Latency is measured from writing a request to reading its whole response. Every phase has a
fixed duration; the run ends by itself. Each heartbeat row also reports the CPU the service and the
generator used (percent of one core) and the machine's 1-minute load average, since other jobs may
share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import percentile  # noqa: E402
from registry.credentials import hash_secret  # noqa: E402
from registry.db import make_engine  # noqa: E402
from registry.migrate import upgrade_to_head  # noqa: E402
from registry.tables import CapacityRow, LinkRow, SiteModelRow, SiteRow, SiteTokenRow  # noqa: E402

PG_URL = os.environ.get("EDGEFIRE_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
ADMIN_TOKEN = "bench-admin"
ROUTER_TOKEN = "bench-router"
NUM_SUMMARY_HASHES = 16  # prefix-cache hashes per heartbeat (16 hex digits each)
LINKS_PER_SITE = 2


# ---- databases -------------------------------------------------------------------------------

class Database:
    """A fresh, migrated registry database for one phase; removed afterwards."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        if backend == "sqlite":
            self._dir = tempfile.TemporaryDirectory(prefix="edgefire-bench-")
            self.url = f"sqlite:///{self._dir.name}/registry.db"
        else:
            self.schema = f"edgefire_bench_{uuid.uuid4().hex[:10]}"
            with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{self.schema}"')
            self.url = f"{PG_URL}?options={quote(f'-csearch_path={self.schema}')}"
        upgrade_to_head(self.url)

    def close(self) -> None:
        if self.backend == "sqlite":
            self._dir.cleanup()
        else:
            with psycopg.connect(PG_URL.replace("+psycopg", ""), autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def populate(db_url: str, num_sites: int, with_capacity: bool) -> list[str]:
    """Bulk-inserts sites (one model each), their agent tokens and optionally capacity and links."""
    now = time.time()
    tokens = [f"efs-bench-{i}-{secrets.token_hex(8)}" for i in range(num_sites)]
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(SiteRow.__table__.insert(), [{
            "id": i + 1, "name": f"site-{i:05d}", "region": f"region-{i % 20}", "country": "DE",
            "lat": -60 + (i * 7) % 120, "lon": -170 + (i * 13) % 340, "grpc_address": f"10.{i // 250}.{i % 250}.1:50051",
            "state": "active", "roles": '["prefill","decode"]',
            # Snapshot runs keep every site alive throughout (only one site heartbeats there).
            "heartbeat_interval_s": 3600.0 if with_capacity else 1.0,
            "created_at": now, "updated_at": now} for i in range(num_sites)])
        conn.execute(SiteModelRow.__table__.insert(), [
            {"site_id": i + 1, "model": "llama-3-8b-instruct", "role": "both"} for i in range(num_sites)])
        conn.execute(SiteTokenRow.__table__.insert(), [
            {"site_id": i + 1, "token_hash": hash_secret(t), "created_at": now} for i, t in enumerate(tokens)])
        if with_capacity:
            conn.execute(CapacityRow.__table__.insert(), [{"site_id": i + 1, **capacity_row(i), "reported_at": now}
                                                          for i in range(num_sites)])
            conn.execute(LinkRow.__table__.insert(), [
                {"src_site_id": i + 1, "dst_site_id": (i + k) % num_sites + 1, "rtt_ms": 5.0 + k,
                 "bandwidth_mbps": 1000.0, "measured_at": now}
                for i in range(num_sites) for k in range(1, LINKS_PER_SITE + 1)])
    engine.dispose()
    return tokens


def capacity_row(i: int) -> dict:
    return {"kv_blocks_total": 8192, "kv_blocks_free": 4096 - i % 1000, "block_size": 16, "num_running": i % 17,
            "num_waiting": i % 5, "inflight_prefill_tokens": 2048, "inflight_decode_tokens": 64,
            "prefill_tokens_per_s": 12000.5, "decode_tokens_per_s": 950.25,
            "prefix_cache_summary": json.dumps({"block_size": 16, "hashes": [
                f"{(i * 7919 + k) & 0xFFFFFFFFFFFFFFFF:016x}" for k in range(NUM_SUMMARY_HASHES)]}),
            "draining": False}


# ---- the service under test --------------------------------------------------------------------

class Server:
    """`edgefire registry serve` (its registry part) in a child process."""

    def __init__(self, db_url: str, workers: int = 1) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        argv = ["registry", "serve", "--db", db_url, "--port", str(self.port), "--workers", str(workers),
                "--admin-token", ADMIN_TOKEN, "--router-token", ROUTER_TOKEN, "--no-migrate"]
        code = ("import argparse, sys; from registry import cli; parser = argparse.ArgumentParser(); "
                f"cli.add_parser(parser.add_subparsers()); args = parser.parse_args({argv!r}); sys.exit(args.func(args))")
        root = Path(__file__).resolve().parent.parent
        self.process = subprocess.Popen([sys.executable, "-c", code], cwd=root)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).raise_for_status()
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("the registry service did not start")
                time.sleep(0.1)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the service process and its workers."""
        return sum(_cpu_s(pid) for pid in _process_tree(self.process.pid))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _process_tree(root: int) -> list[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---- heartbeat load ----------------------------------------------------------------------------

class Connection:
    """One keep-alive HTTP/1.1 connection; just enough protocol for JSON requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


def heartbeat_request(port: int, token: str, i: int) -> bytes:
    capacity = capacity_row(i)
    capacity["prefix_cache_summary"] = json.loads(capacity["prefix_cache_summary"])
    body = json.dumps(capacity).encode()
    return (f"POST /v1/agent/heartbeat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def heartbeat_load(port: int, tokens: list[str], warmup_s: float, duration_s: float,
                         server_cpu_s=lambda: 0.0) -> dict:
    loop = asyncio.get_running_loop()
    num_sites = len(tokens)
    start = loop.time() + 1.0
    measure_from, stop_at = start + warmup_s, start + warmup_s + duration_s
    latencies: list[float] = []
    counts = {"ok": 0, "errors": 0, "late": 0}

    async def site(i: int) -> None:
        request = heartbeat_request(port, tokens[i], i)
        connection = await Connection.open(port)
        due = start + i / num_sites  # spread the sites evenly over each second
        try:
            while due < stop_at:
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -0.5:
                    counts["late"] += 1  # the generator (or server) fell behind the 1 Hz schedule
                sent = time.perf_counter()
                status = await connection.post(request)
                if due >= measure_from:
                    latencies.append(time.perf_counter() - sent)
                    counts["ok" if status == 200 else "errors"] += 1
                due += 1.0
        finally:
            connection.close()

    async def measure_cpu() -> dict:
        await asyncio.sleep(measure_from - loop.time())
        server0, generator0 = server_cpu_s(), time.process_time()
        await asyncio.sleep(stop_at - loop.time())
        return {"server_cpu": (server_cpu_s() - server0) / duration_s,
                "generator_cpu": (time.process_time() - generator0) / duration_s, "load_1m": os.getloadavg()[0]}

    cpu = asyncio.create_task(measure_cpu())
    tasks = [asyncio.create_task(site(i)) for i in range(num_sites)]
    _, unfinished = await asyncio.wait(tasks, timeout=warmup_s + duration_s + 15)
    for task in unfinished:  # an overloaded server: stop waiting, report what came back
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    counts["errors"] += len(unfinished)
    return {**await cpu, "sites": num_sites, "heartbeats_per_s": counts["ok"] / duration_s, "errors": counts["errors"],
            "late": counts["late"], "p50_ms": percentile(latencies, 0.5) * 1000,
            "p99_ms": percentile(latencies, 0.99) * 1000, "max_ms": max(latencies, default=float("nan")) * 1000}


def run_heartbeats(backend: str, num_sites: int, warmup_s: float, duration_s: float, workers: int) -> dict:
    db = Database(backend)
    try:
        tokens = populate(db.url, num_sites, with_capacity=False)
        server = Server(db.url, workers)
        try:
            return asyncio.run(heartbeat_load(server.port, tokens, warmup_s, duration_s, server.cpu_s))
        finally:
            server.close()
    finally:
        db.close()


# ---- snapshot latency --------------------------------------------------------------------------

def run_snapshot(backend: str, num_sites: int, samples: int, workers: int) -> dict:
    db = Database(backend)
    try:
        tokens = populate(db.url, num_sites, with_capacity=True)
        server = Server(db.url, workers)
        try:
            return measure_snapshot(server.port, tokens[0], samples)
        finally:
            server.close()
    finally:
        db.close()


def measure_snapshot(port: int, site_token: str, samples: int) -> dict:
    base = f"http://127.0.0.1:{port}"
    router = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ROUTER_TOKEN}"}, timeout=30)
    agent = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {site_token}"}, timeout=30)
    heartbeat = json.loads(heartbeat_request(port, site_token, 0).split(b"\r\n\r\n", 1)[1])
    changed, cached, revalidated = [], [], []
    size = 0
    t0 = time.perf_counter()
    router.get("/v1/router/snapshot").raise_for_status()  # the first read after start-up, reported apart
    first_ms = (time.perf_counter() - t0) * 1000
    for _ in range(samples):
        agent.post("/v1/agent/heartbeat", json=heartbeat).raise_for_status()  # a new version: rows re-read
        t0 = time.perf_counter()
        response = router.get("/v1/router/snapshot")
        changed.append(time.perf_counter() - t0)
        size = len(response.content)
        t0 = time.perf_counter()
        router.get("/v1/router/snapshot").raise_for_status()  # same version: cached body
        cached.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        not_modified = router.get("/v1/router/snapshot", headers={"If-None-Match": response.headers["etag"]})
        revalidated.append(time.perf_counter() - t0)
        if not_modified.status_code != 304:
            raise RuntimeError(f"expected 304, got {not_modified.status_code}")
    t0 = time.perf_counter()
    json.loads(response.content)
    parse_ms = (time.perf_counter() - t0) * 1000
    router.close()
    agent.close()
    ms = lambda xs, q: percentile(xs, q) * 1000  # noqa: E731
    return {"sites": num_sites_of(response.content), "body_mb": size / 1e6, "first_ms": first_ms,
            "changed_p50_ms": ms(changed, 0.5), "changed_p99_ms": ms(changed, 0.99),
            "cached_p50_ms": ms(cached, 0.5), "cached_p99_ms": ms(cached, 0.99),
            "not_modified_p50_ms": ms(revalidated, 0.5), "not_modified_p99_ms": ms(revalidated, 0.99),
            "client_json_parse_ms": parse_ms}


def num_sites_of(body: bytes) -> int:
    return len(json.loads(body)["sites"])


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--sites", type=int, nargs="+", default=[250, 500, 1000, 2000],
                        help="simulated sites heartbeating at 1 Hz, one run each (default 250 500 1000 2000)")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per heartbeat run")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each run")
    parser.add_argument("--snapshot-sites", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--snapshot-samples", type=int, default=30)
    parser.add_argument("--workers", type=int, default=1, help="service worker processes (default 1)")
    args = parser.parse_args()
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    print(f"registry load benchmark: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"{NUM_SUMMARY_HASHES} prefix hashes per heartbeat, {LINKS_PER_SITE} links per site in snapshots, "
          f"{args.workers} service worker(s)")
    print("\nheartbeats (1 Hz per site; target: 2000/s sustained with p99 < 50 ms)")
    print("  errors = non-200 answers or requests still unanswered at the end; late = sends > 0.5 s behind schedule;")
    print("  srv/gen cpu = CPU of the service / of this load generator while measuring, % of one core; load = 1-min load")
    print(f"{'backend':<11}{'sites':>7}{'hb/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'errors':>8}{'late':>7}"
          f"{'srv cpu':>9}{'gen cpu':>9}{'load':>6}")
    for backend in backends:
        for num_sites in args.sites:
            r = run_heartbeats(backend, num_sites, args.warmup, args.duration, args.workers)
            print(f"{backend:<11}{r['sites']:>7}{r['heartbeats_per_s']:>9.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
                  f"{r['max_ms']:>9.1f}{r['errors']:>8}{r['late']:>7}{r['server_cpu']:>9.0%}{r['generator_cpu']:>9.0%}"
                  f"{r['load_1m']:>6.1f}", flush=True)
    print("\nsnapshot GET latency (target: 10,000 sites < 100 ms); 'changed' = rows re-read and rendered,"
          " 'cached' = same version, '304' = If-None-Match current; 'first' = the first GET after start-up")
    print(f"{'backend':<11}{'sites':>7}{'MB':>7}{'first ms':>10}{'changed p50/p99 ms':>21}{'cached p50/p99':>17}"
          f"{'304 p50/p99':>15}{'parse ms':>10}")
    for backend in backends:
        for num_sites in args.snapshot_sites:
            r = run_snapshot(backend, num_sites, args.snapshot_samples, args.workers)
            print(f"{backend:<11}{r['sites']:>7}{r['body_mb']:>7.2f}{r['first_ms']:>10.1f}"
                  f"{r['changed_p50_ms']:>12.1f} /{r['changed_p99_ms']:>6.1f}"
                  f"{r['cached_p50_ms']:>9.1f} /{r['cached_p99_ms']:>6.1f}"
                  f"{r['not_modified_p50_ms']:>7.2f} /{r['not_modified_p99_ms']:>6.2f}{r['client_json_parse_ms']:>10.1f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
