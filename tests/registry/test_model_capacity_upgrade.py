"""Per-model capacity during a rolling registry upgrade, on SQLite and PostgreSQL.

A replica older than per-model figures (before migration 0010), or one at 0010 (before their source was
recorded), still stores some heartbeats: it rewrites a site's capacity row and leaves `models` as a newer
replica last wrote it. Routers and operators must then get the site's own figures, fresh, never per-model
ones older than them, until a heartbeat through a current replica brings per-model figures back. The
older replicas' writes are the statements their code ran (registry/telemetry.py at those revisions).
"""

from __future__ import annotations

import json

import pytest
from alembic import command
from sqlalchemy import Engine, inspect, text

from node_agent.heartbeat import ModelFigures, site_capacity_report
from registry.db import make_engine
from registry.migrate import alembic_config
from registry.records import ModelServed, SiteSpec
from registry.sql import bump_version
from registry.store import RegistryStore
from registry.wire import CapacityReport
from router.snapshot import parse_snapshot
from tests.agent.test_heartbeat_model_capacity import stats

from .test_model_capacity import AMSTERDAM, FRANKFURT, PROMPT, agent_site, hashes_of, placed

# The capacity columns each older registry wrote on every heartbeat, in its order.
BEFORE_0010 = ["kv_blocks_total", "kv_blocks_free", "block_size", "num_running", "num_waiting",
               "inflight_prefill_tokens", "inflight_decode_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
               "decode_batch_size", "decode_kv_tokens", "prefix_cache_summary", "draining", "reported_at", "num_gpus",
               "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "speculative_acceptance"]
AT_0010 = [*BEFORE_0010, "models"]
OLDER_REGISTRIES = {"before 0010": BEFORE_0010, "at 0010": AT_0010}
_PG_TYPES = {"site_id": "integer", "block_size": "integer", "num_running": "integer", "num_waiting": "integer",
             "draining": "boolean", "kv_blocks_total": "bigint", "kv_blocks_free": "bigint",
             "inflight_prefill_tokens": "bigint", "inflight_decode_tokens": "bigint", "num_gpus": "integer",
             "tensor_parallel_size": "integer", "pipeline_parallel_size": "integer", "expert_parallel_size": "integer"}
_JSON_TEXT = ("prefix_cache_summary", "models")


def older_upsert(dialect: str, fields: list[str]):
    """The capacity upsert of a registry that knew only `fields`, as its code built it for `dialect`."""
    columns = ["site_id", *fields]
    update = ", ".join(f"{c} = excluded.{c}" for c in fields)
    if dialect != "postgresql":  # SQLAlchemy's sqlite insert(...).on_conflict_do_update over those columns
        return text(f"INSERT INTO capacity ({', '.join(columns)}) VALUES ({', '.join(f':{c}' for c in columns)}) "
                    f"ON CONFLICT (site_id) DO UPDATE SET {update}")
    json_text = [c for c in columns if c in _JSON_TEXT]
    arrays = [c for c in columns if c not in _JSON_TEXT]
    return text(
        f"INSERT INTO capacity ({', '.join(columns)}) "
        f"SELECT {', '.join(f'{c}.v' if c in _JSON_TEXT else f'u.{c}' for c in columns)} FROM unnest("
        + ", ".join(f"CAST(:{c} AS {_PG_TYPES.get(c, 'double precision')}[])" for c in arrays)
        + f") WITH ORDINALITY AS u({', '.join(arrays)}, ord)"
        + "".join(f" JOIN json_array_elements_text(CAST(:{c} AS json)) WITH ORDINALITY AS {c}(v, ord) USING (ord)"
                  for c in json_text)
        + f" ON CONFLICT (site_id) DO UPDATE SET {update}")


def older_heartbeat(engine: Engine, fields: list[str], site_id: int, report: dict, reported_at: float) -> None:
    """One heartbeat stored by an older replica: its upsert, then the snapshot version's bump. The agent sends a
    registry before 0010 no `models` (their hashes folded into the site's summary), as it does once refused."""
    sent = CapacityReport.model_validate(report)
    body = sent.to_json(left_out=() if "models" in fields else ("models",))
    summary, models = body.get("prefix_cache_summary"), body.get("models")
    row = {**body, "site_id": site_id, "reported_at": reported_at,
           "prefix_cache_summary": None if summary is None else json.dumps(summary, separators=(",", ":")),
           "models": None if models is None else json.dumps(models, separators=(",", ":"))}
    row = {c: row[c] for c in ["site_id", *fields]}
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            row = {c: json.dumps([v]) if c in _JSON_TEXT else [v] for c, v in row.items()}
        conn.execute(older_upsert(conn.dialect.name, fields), row)
        bump_version(conn)


def two_models(a: ModelFigures, b: ModelFigures) -> dict:
    return site_capacity_report(16, False, {"a": a, "b": b}).to_json()


def capacity_of(snapshot: dict, name: str) -> dict:
    return next(site["capacity"] for site in snapshot["sites"] if site["name"] == name)


@pytest.mark.parametrize("older", OLDER_REGISTRIES)
async def test_an_older_replicas_heartbeat_makes_the_site_figures_stand_for_every_model(
        older, admin, connect, router_client, store, clock):
    ams = await agent_site(admin, connect, "ams-1", AMSTERDAM)
    await (await agent_site(admin, connect, "fra-1", FRANKFURT)).heartbeat(
        two_models(ModelFigures(stats(1000, 500)), ModelFigures(stats(1000, 500))))
    # through this replica: at ams, nearer the client, a's own pool is full
    await ams.heartbeat(two_models(ModelFigures(stats(1000, 0)), ModelFigures(stats(1000, 1000))))
    assert (await placed(router_client, "a"))[0].site_names == ("fra-1", "fra-1")

    # a's requests at ams end; the heartbeat saying so lands on an older replica
    clock.advance(1.0)
    older_heartbeat(store.engine, OLDER_REGISTRIES[older], store.sites.get("ams-1").id,
                    two_models(ModelFigures(stats(1000, 1000)), ModelFigures(stats(1000, 1000))), clock.now)
    for snapshot in ((await router_client.snapshot(packed=False))[0], await admin.admin_snapshot()):
        cap = capacity_of(snapshot, "ams-1")
        assert "models" not in cap and (cap["kv_blocks_free"], cap["reported_at"]) == (2000, clock.now)
    assert (await placed(router_client, "a"))[0].site_names == ("ams-1", "ams-1")  # stale figures kept it away

    # the next heartbeat through a current replica brings the models' own figures back
    clock.advance(1.0)
    await ams.heartbeat(two_models(ModelFigures(stats(1000, 0)), ModelFigures(stats(1000, 1000))))
    cap = capacity_of((await router_client.snapshot(packed=False))[0], "ams-1")
    assert {name: own["kv_blocks_free"] for name, own in cap["models"].items()} == {"a": 0, "b": 1000}
    assert (await placed(router_client, "a"))[0].site_names == ("fra-1", "fra-1")


@pytest.mark.parametrize("older", OLDER_REGISTRIES)
async def test_a_prefix_one_model_no_longer_caches_draws_nothing_after_an_older_replicas_heartbeat(
        older, admin, connect, router_client, store, clock):
    fra = await agent_site(admin, connect, "fra-1", FRANKFURT)
    await fra.heartbeat(two_models(ModelFigures(stats(1000, 1000), hashes_of(PROMPT)), ModelFigures(stats(1000, 1000))))
    # the engine reuses the whole blocks before the one holding the prompt's last token: 124 of 16
    assert (await placed(router_client, "a"))[0].num_cached_tokens == 1984

    # fra's engine restarted with an empty cache; an older replica stores the heartbeat saying so
    clock.advance(1.0)
    older_heartbeat(store.engine, OLDER_REGISTRIES[older], store.sites.get("fra-1").id,
                    two_models(ModelFigures(stats(1000, 1000)), ModelFigures(stats(1000, 1000))), clock.now)
    snapshot = parse_snapshot((await router_client.snapshot())[0])
    assert snapshot.sites[0].capacity.own("a").cached_hashes == frozenset()
    assert (await placed(router_client, "a"))[0].num_cached_tokens == 0


@pytest.mark.parametrize("older", OLDER_REGISTRIES)
async def test_an_older_replica_stores_a_sites_first_heartbeat(older, admin, connect, router_client, store, clock):
    """The column this registry added takes no value from an older one's insert; its row reads as the site's."""
    await agent_site(admin, connect, "fra-1", FRANKFURT)
    report = two_models(ModelFigures(stats(1000, 1000)), ModelFigures(stats(1000, 500)))
    older_heartbeat(store.engine, OLDER_REGISTRIES[older], store.sites.get("fra-1").id, report, clock.now)
    site = (await router_client.snapshot(packed=False))[0]["sites"][0]
    assert site["alive"] and site["capacity"]["kv_blocks_free"] == 1500 and "models" not in site["capacity"]


def snapshot_capacity(store: RegistryStore, name: str) -> dict:
    return capacity_of(json.loads(store.snapshot().render(store.telemetry.now())), name)


def test_upgrade_and_downgrade_with_per_model_figures_stored(empty_db_url):
    config = alembic_config(empty_db_url)
    command.upgrade(config, "0010_model_capacity")
    store = RegistryStore(make_engine(empty_db_url))
    store.sites.create("fra-1", SiteSpec(models=[ModelServed("a"), ModelServed("b")]), "alice")
    site_id = store.sites.get("fra-1").id
    stored = two_models(ModelFigures(stats(1000, 0)), ModelFigures(stats(1000, 500)))
    older_heartbeat(store.engine, AT_0010, site_id, stored, store.telemetry.now())
    store.close()

    command.upgrade(config, "head")
    store = RegistryStore(make_engine(empty_db_url))
    # which heartbeat wrote the stored figures is unknown, so the site's own stand until the next one
    assert "models" not in snapshot_capacity(store, "fra-1")
    assert snapshot_capacity(store, "fra-1")["kv_blocks_free"] == 500
    store.telemetry.record_heartbeat(site_id, CapacityReport.model_validate(stored))
    assert snapshot_capacity(store, "fra-1")["models"]["b"]["kv_blocks_free"] == 500
    store.close()

    command.downgrade(config, "0010_model_capacity")
    engine = make_engine(empty_db_url)
    try:
        assert "models_reported_at" not in {c["name"] for c in inspect(engine).get_columns("capacity")}
        with engine.connect() as conn:
            kept = conn.execute(text("SELECT kv_blocks_free, models FROM capacity")).one()
        assert kept.kv_blocks_free == 500 and json.loads(kept.models)["a"]["kv_blocks_free"] == 0
    finally:
        engine.dispose()
    command.upgrade(config, "head")
    store = RegistryStore(make_engine(empty_db_url))
    try:
        assert "models" not in snapshot_capacity(store, "fra-1")
    finally:
        store.close()
