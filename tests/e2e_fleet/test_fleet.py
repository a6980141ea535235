"""A fleet on PostgreSQL acts as one: two routers, two registry replicas, three sites (`edgefire up
--routers 2 --registry-replicas 2 --db postgresql+psycopg://...`), in a database of its own.

One key limited to R requests a minute is hammered through both routers for 80 seconds, far beyond
R, at a bounded rate (most answers are cheap 429s). In the second minute's burst, one registry replica
and one router are killed (SIGKILL). What must hold:
- each minute the key is admitted R in total (not 2R): never more, and less only by the part of the
  window the dead router held when it died (registry/allowance.py: a dead router's hold is kept
  until its unreported admissions are out of the window);
- clients of the surviving router see no failure, and agents keep heartbeating through the other replica;
- the usage rows equal the tokens clients saw in `usage`, exactly, but for what the dead router served
  after its last report (at most about a second of its traffic); the test prints how much that was.

A long test by its nature (a minute of traffic and the next minute's burst) but light on CPU: R is small,
max_tokens 4, and clients send 3 requests a second in all. It has a module of its own so it can run beside
the others. The second minute is cut at RUN_S: a minute's admissions come in a burst as the window opens
(the first minute's burst leaves it at 60-70 s), and nothing more can be admitted before 120 s (the burst's
charges fill the window until then, and the dead router's hold outlasts the run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import psycopg
import pytest

from deploy.cluster_config import ClusterConfig, demo_sites
from deploy.launcher import Cluster

PG_URL = os.environ.get("EDGEFIRE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
R = 30                      # requests per minute for the key
RATE_PER_ROUTER = 1.5       # requests a second sent through each router
RUN_S = 80.0
KILL_AT_S = 66.0            # in the second minute's burst: the routers hold grants
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")


@pytest.fixture(scope="module")
def fleet_db():
    """A database of its own on the test PostgreSQL, dropped afterwards."""
    name = f"edgefire_fleet_{uuid.uuid4().hex[:12]}"
    admin_url = PG_URL.replace("postgresql+psycopg://", "postgresql://")
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required for the fleet test and is unreachable at {PG_URL}: {exc}")
    yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory, fleet_db):
    sites = demo_sites(3)
    for site in sites:
        site.grpc_port = site.metrics_port = 0
    config = ClusterConfig(
        model_dir=tiny_model_dir, model_name="tiny", sites=sites, state_dir=tmp_path_factory.mktemp("fleet"),
        router_port=0, registry_port=0, routers=2, registry_replicas=2, db=fleet_db,
        agent={"heartbeat_interval_s": 1.0, "kv_cache_bytes": 8 << 20, "device": "cpu", "dtype": "float32"},
        router={"snapshot_refresh_s": 0.5, "first_token_timeout_s": 20.0, "token_idle_timeout_s": 20.0})
    cluster = Cluster(config)
    cluster.start(timeout_s=240)
    yield cluster
    cluster.stop()


@dataclass(slots=True)
class Outcome:
    router: int
    sent_at: float          # seconds from the start of the run
    ended_at: float = 0.0
    status: int | None = None
    usage: dict | None = None
    error: str | None = None


async def one_request(http: httpx.AsyncClient, router: int, started: float, model: str, i: int) -> Outcome:
    outcome = Outcome(router, time.monotonic() - started)
    body = {"model": model, "prompt": [(7 + 13 * (i + k)) % 500 + 5 for k in range(12 + i % 5)], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            outcome.status = response.status_code
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        outcome.error = f"stream error {event['error']}"
                    elif event.get("usage"):
                        outcome.usage = event["usage"]
            if outcome.status == 200 and outcome.usage is None and outcome.error is None:
                outcome.error = "stream ended without usage"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended_at = time.monotonic() - started
    return outcome


async def hammer(fleet: Cluster, api_key: str, started: float, stop_router_2: threading.Event) -> list[Outcome]:
    clients = [httpx.AsyncClient(base_url=url, timeout=60.0, headers={"Authorization": f"Bearer {api_key}"})
               for url in fleet.router_urls]
    tasks, counter = [], itertools.count()
    try:
        for i in itertools.count():
            due = started + i / (RATE_PER_ROUTER * 2)
            if due - started >= RUN_S:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            router = i % 2
            if router == 1 and stop_router_2.is_set():
                continue   # its clients are gone with it
            tasks.append(asyncio.create_task(one_request(clients[router], router, started, fleet.model,
                                                         next(counter))))
        return list(await asyncio.gather(*tasks))
    finally:
        for client in clients:
            await client.aclose()


def watch_heartbeats(fleet: Cluster, stop: threading.Event, ages: dict[str, float], beats: dict[str, set]) -> None:
    """The oldest heartbeat age each site showed, and the heartbeats seen, sampled every half second
    through any replica."""
    while not stop.wait(0.5):
        try:
            snapshot = fleet.snapshot()
        except (httpx.HTTPError, OSError):
            ages["registry unreachable"] = ages.get("registry unreachable", 0) + 1
            continue
        for site in snapshot["sites"]:
            age = site["heartbeat_age_s"] if site["alive"] else float("inf")
            ages[site["name"]] = max(ages.get(site["name"], 0.0), age if age is not None else float("inf"))
            if site["capacity"]:
                beats.setdefault(site["name"], set()).add(site["capacity"]["reported_at"])


def admitted_in(outcomes: list[Outcome], start: float, end: float) -> int:
    return sum(1 for o in outcomes if o.status == 200 and start <= o.sent_at < end)


def totals(outcomes) -> dict[str, int]:
    out = dict.fromkeys(USAGE_FIELDS, 0)
    for o in outcomes:
        out["requests"] += 1
        out["prompt_tokens"] += o.usage["prompt_tokens"]
        out["cached_prompt_tokens"] += o.usage["prompt_tokens_details"]["cached_tokens"]
        out["completion_tokens"] += o.usage["completion_tokens"]
    return out


def test_two_routers_two_replicas_one_limit_exact_usage_through_kills(fleet, record_property):
    admin = fleet.admin()
    key = admin.create_api_key("fleet-test", requests_per_minute=R)
    stop_router_2, stop_watch, ages_after_kill, beats_after_kill = threading.Event(), threading.Event(), {}, {}
    watcher = threading.Thread(target=watch_heartbeats, args=(fleet, stop_watch, ages_after_kill, beats_after_kill),
                               daemon=True)

    def kill() -> None:
        stop_router_2.set()
        fleet.kill_site("registry")    # the first replica: router 1 and two of the agents were using it
        fleet.kill_site("router-2")
        watcher.start()

    started = time.monotonic()
    timer = threading.Timer(KILL_AT_S, kill)
    timer.start()
    try:
        outcomes = asyncio.run(hammer(fleet, key["key"], started, stop_router_2))
    finally:
        timer.cancel()
        stop_watch.set()
    watcher.join(5)
    killed_at = KILL_AT_S

    # Clients of the surviving router saw no failure: every answer a 200 with its usage, or a 429.
    survivor = [o for o in outcomes if o.router == 0]
    failures = [o for o in survivor if o.error or o.status not in (200, 429)]
    assert not failures, failures[:5]
    assert sum(o.status == 429 for o in survivor) > 2 * R   # hammered well past the limit
    # Agents kept heartbeating through the remaining replica (heartbeat every 1 s; dead after 3).
    assert ages_after_kill and "registry unreachable" not in ages_after_kill, ages_after_kill
    assert max(ages_after_kill.values()) < 3.0, ages_after_kill
    assert {site: len(times) >= (RUN_S - KILL_AT_S) / 4 for site, times in beats_after_kill.items()} == {
        s.name: True for s in fleet.config.sites}, {site: len(times) for site, times in beats_after_kill.items()}

    # R a minute in total, not 2R. The second minute may fall short by what the dead router held.
    first, second = admitted_in(outcomes, 0, 60), admitted_in(outcomes, 60, RUN_S)
    print(f"\nadmitted per minute: {first}, {second} (limit {R}); killed at {killed_at:.0f} s")
    record_property("admitted_per_minute", f"{first}, {second} (limit {R})")
    assert first == R
    assert R // 2 <= second <= R

    # Usage rows equal what clients saw, but for what the dead router served after its last report.
    fleet.wait_for(lambda: all(r["last_seq"] > 0 for r in admin.routers()["items"]), 10, "reports")
    router_1 = next(r for r in admin.routers()["items"] if r["name"] == "router")
    seq = router_1["last_seq"]
    fleet.wait_for(lambda: next(r for r in admin.routers()["items"] if r["name"] == "router")["last_seq"] > seq + 1,
                   10, "router 1 to report twice more")   # everything it served is in by then
    served = [o for o in outcomes if o.status == 200 and o.usage is not None and not o.error]
    seen = totals(served)
    rows = admin.usage(key_id=key["id"], granularity="total")
    recorded = {name: rows["totals"][name] for name in USAGE_FIELDS}
    missing = {name: seen[name] - recorded[name] for name in USAGE_FIELDS}
    # What could be missing: responses of the dead router that ended in its last report interval.
    late = [o for o in served if o.router == 1 and o.ended_at >= killed_at - 2.0]
    print(f"usage: clients saw {seen}; the registry has {recorded}; missing {missing} "
          f"({len(late)} response(s) of the dead router ended in its last 2 s)")
    record_property("usage_missing", f"{missing} of {seen}")
    assert all(value >= 0 for value in missing.values()), (seen, recorded)   # nothing counted twice
    subsets = (totals(combo) for n in range(len(late) + 1) for combo in itertools.combinations(late, n))
    assert missing in list(subsets), (missing, [o.usage for o in late])
