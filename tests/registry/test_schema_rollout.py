"""Rolling upgrades of registry replicas, on SQLite and PostgreSQL.

A newer edgefire is simulated by a copy of this one's migrations with migrations added after its head;
this edgefire, unchanged, plays the older replica that restarts after the newer one migrated the database.
Behind a migration that only adds, the older replica serves (a real CLI start, then agents' and routers'
calls through the service and its store); behind one that is not backward compatible it refuses with one
clear line. Either way it never migrates, stamps or downgrades the newer database.
"""

from __future__ import annotations

import logging

import asyncio
import shutil
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest
import uvicorn
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from deploy.cli import main as edgefire
from registry.client import RegistryClient
from registry.db import make_engine
from registry.migrate import (MIGRATIONS_DIR, SchemaMismatch, alembic_config, check_serviceable, downgrade_to_base,
                              head_revision, upgrade_to_head)
from registry.records import SiteSpec
from registry.store import RegistryStore

from .conftest import ADMIN_TOKEN, ROUTER_TOKEN, capacity, pg_libpq_url, pg_schema_url

CAPACITY = {"kv_blocks_total": 4096, "kv_blocks_free": 1024, "block_size": 16, "num_running": 3, "num_waiting": 1,
            "inflight_prefill_tokens": 900, "inflight_decode_tokens": 40, "prefill_tokens_per_s": 8000.0,
            "decode_tokens_per_s": 300.0, "prefix_cache_summary": None, "draining": False}

# A newer edgefire's migrations: (backward_compatible as written, upgrade body, downgrade body).
ADDITIVE = ("True", """
    op.create_table("site_notes",
                    sa.Column("site_id", sa.Integer, sa.ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True),
                    sa.Column("note", sa.Text, nullable=False))
    with op.batch_alter_table("sites") as batch:
        batch.add_column(sa.Column("tier", sa.String(16), nullable=True))
    op.create_index("ix_sites_tier", "sites", ["tier"])
""", """
    op.drop_index("ix_sites_tier", table_name="sites")
    with op.batch_alter_table("sites") as batch:
        batch.drop_column("tier")
    op.drop_table("site_notes")
""")
INCOMPATIBLE = ("False", """
    with op.batch_alter_table("sites") as batch:
        batch.alter_column("grpc_address", new_column_name="agent_address", existing_type=sa.String(300))
""", """
    with op.batch_alter_table("sites") as batch:
        batch.alter_column("agent_address", new_column_name="grpc_address", existing_type=sa.String(300))
""")
UNDECLARED = (None, "\n    op.create_table('unmarked', sa.Column('id', sa.Integer, primary_key=True))\n",
              "\n    op.drop_table('unmarked')\n")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """An empty database: a SQLite file, or a PostgreSQL schema of this test's own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
        return
    schema = f"rollout_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_libpq_url(), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield pg_schema_url(schema)
    with psycopg.connect(pg_libpq_url(), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def newer_edgefire(directory: Path, *migrations: tuple) -> tuple[Path, list[str]]:
    """(migrations dir, added revisions): this edgefire's migrations followed by `migrations`, in order."""
    shutil.copytree(MIGRATIONS_DIR, directory, ignore=shutil.ignore_patterns("__pycache__"))
    previous, added = head_revision(), []
    for number, (compatible, upgrade, downgrade) in enumerate(migrations, start=9001):
        revision = f"{number}_rollout"
        declaration = "" if compatible is None else f"backward_compatible = {compatible}\n"
        (directory / "versions" / f"{revision}.py").write_text(
            f'"""A newer edgefire\'s migration."""\n\nimport sqlalchemy as sa\nfrom alembic import op\n\n'
            f"revision = {revision!r}\ndown_revision = {previous!r}\nbranch_labels = None\ndepends_on = None\n"
            f"{declaration}\n\ndef upgrade() -> None:{upgrade}\n\ndef downgrade() -> None:{downgrade}")
        previous = revision
        added.append(revision)
    return directory, added


def schema_state(db_url: str) -> dict:
    """What a migration could change: tables, columns, indexes, the revision and the readers recorded."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            inspector = inspect(conn)
            tables = sorted(inspector.get_table_names())
            return {
                "columns": {t: sorted(c["name"] for c in inspector.get_columns(t)) for t in tables},
                "indexes": {t: sorted(i["name"] for i in inspector.get_indexes(t)) for t in tables},
                "revision": conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all(),
                "readers": readers(conn) if "registry_schema_readers" in tables else None,
            }
    finally:
        engine.dispose()


def readers(conn) -> list[str]:
    """The compatible readers as an operator reads them in SQL, for the schema's current revision."""
    return conn.execute(text("SELECT reader_revision FROM registry_schema_readers WHERE schema_revision = "
                             "(SELECT version_num FROM alembic_version) ORDER BY reader_revision")).scalars().all()


def readers_of(db_url: str) -> list[str]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return readers(conn)
    finally:
        engine.dispose()


def every_revision_of_this_edgefire() -> list[str]:
    return sorted(r.revision for r in ScriptDirectory(str(MIGRATIONS_DIR)).walk_revisions())


def serve(db_url: str, monkeypatch, *flags: str) -> tuple[int, dict | None]:
    """`edgefire registry serve` as this (older) edgefire: (exit status, the router snapshot after an
    operator, an agent and a router used the service it would have served; None when it did not serve)."""
    served = {}

    def run_instead_of_listening(app, **_options) -> None:
        served["snapshot"] = asyncio.run(use_the_service(app))

    monkeypatch.setattr(uvicorn, "run", run_instead_of_listening)
    status = edgefire(["registry", "serve", "--db", db_url, "--admin-token", ADMIN_TOKEN,
                       "--router-token", ROUTER_TOKEN, *flags])
    return status, served.get("snapshot")


async def use_the_service(app) -> dict:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with RegistryClient("http://registry", ADMIN_TOKEN, actor="ops", transport=transport) as admin:
            await admin.create_site("ams-1", region="eu-west", country="NL", lat=52.4, lon=4.9)
            token = (await admin.issue_site_token("ams-1"))["token"]
            async with RegistryClient("http://registry", token, transport=transport) as agent:
                await agent.register_site("ams-1", "10.0.0.2:50051", [{"model": "m", "role": "both"}])
                await agent.heartbeat(CAPACITY)
            await admin.cordon("fra-1")
        async with RegistryClient("http://registry", ROUTER_TOKEN, transport=transport) as router:
            snapshot, _etag = await router.snapshot(packed=False)
    return snapshot


def seed_and_migrate_as_newer(db_url: str, migrations_dir: Path) -> None:
    """A fleet at this edgefire with one site; then a newer replica migrates it."""
    upgrade_to_head(db_url)
    store = RegistryStore.open(db_url)
    try:
        site = store.sites.create("fra-1", SiteSpec(region="eu-central", country="DE", lat=50.1, lon=8.7), actor="ops")
        store.telemetry.record_heartbeat(site.id, capacity(100, 40, 16))
    finally:
        store.close()
    upgrade_to_head(db_url, migrations_dir)


def error_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]


def test_the_schema_lists_every_revision_that_can_serve_it(db_url):
    """Every existing migration only adds, so this edgefire's schema can be served by all of its revisions;
    a database migrated before the readers table existed gets it filled by the migration that creates it."""
    command.upgrade(alembic_config(db_url), "0011_model_capacity_source")
    assert "registry_schema_readers" not in schema_state(db_url)["columns"]
    upgrade_to_head(db_url)
    assert readers_of(db_url) == every_revision_of_this_edgefire()
    check_serviceable(db_url)


@pytest.mark.parametrize("flags", [[], ["--no-migrate"]])
def test_an_older_replica_serves_a_schema_a_newer_migration_only_added_to(db_url, tmp_path, monkeypatch, caplog,
                                                                          flags):
    newer, (added,) = newer_edgefire(tmp_path / "newer", ADDITIVE)
    seed_and_migrate_as_newer(db_url, newer)
    engine = make_engine(db_url)
    with engine.begin() as conn:  # what the newer replica stores in what it added
        conn.execute(text("UPDATE sites SET tier = 'gold' WHERE name = 'fra-1'"))
        conn.execute(text("INSERT INTO site_notes (site_id, note) SELECT id, 'newer' FROM sites"))
    engine.dispose()
    assert readers_of(db_url) == sorted([*every_revision_of_this_edgefire(), added])
    before = schema_state(db_url)

    caplog.clear()
    status, snapshot = serve(db_url, monkeypatch, *flags)
    assert status == 0 and error_lines(caplog) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(added in w and head_revision() in w for w in warnings), warnings
    sites = {site["name"]: site for site in snapshot["sites"]}
    assert set(sites) == {"fra-1", "ams-1"} and sites["ams-1"]["grpc_address"] == "10.0.0.2:50051"
    assert sites["ams-1"]["capacity"]["kv_blocks_free"] == 1024

    assert schema_state(db_url) == before  # not migrated, stamped nor re-recorded
    engine = make_engine(db_url)
    with engine.connect() as conn:  # what the newer replica wrote is still there beside the older one's writes
        assert conn.execute(text("SELECT state, tier FROM sites WHERE name = 'fra-1'")).one() == ("cordoned", "gold")
        assert conn.execute(text("SELECT note FROM site_notes")).scalars().all() == ["newer"]
    engine.dispose()


def test_an_older_replica_never_changes_a_newer_schema_it_can_serve(db_url, tmp_path, caplog):
    newer, (added,) = newer_edgefire(tmp_path / "newer", ADDITIVE)
    seed_and_migrate_as_newer(db_url, newer)
    before = schema_state(db_url)
    with caplog.at_level(logging.INFO):
        assert edgefire(["registry", "migrate", "--db", db_url]) == 0
    assert f"left at the newer revision {added}" in caplog.text and "schema at head" not in caplog.text
    command.stamp(alembic_config(db_url), "head")
    with pytest.raises(SchemaMismatch, match=f"{added}.*never downgrades"):
        downgrade_to_base(db_url)
    with pytest.raises(SchemaMismatch, match="never downgrades"):
        command.stamp(alembic_config(db_url), "0001_initial")
    assert schema_state(db_url) == before


@pytest.mark.parametrize("flags", [[], ["--no-migrate"]])
def test_an_older_replica_refuses_a_schema_it_cannot_serve(db_url, tmp_path, monkeypatch, caplog, flags):
    newer, (added,) = newer_edgefire(tmp_path / "newer", INCOMPATIBLE)
    seed_and_migrate_as_newer(db_url, newer)
    assert readers_of(db_url) == [added]
    before = schema_state(db_url)

    caplog.clear()
    assert serve(db_url, monkeypatch, *flags) == (2, None)
    (message,) = error_lines(caplog)
    assert f"at revision {added}" in message and "not readable by this version" in message
    assert head_revision() in message and "upgrade this replica" in message
    caplog.clear()
    assert edgefire(["registry", "migrate", "--db", db_url]) == 2
    (message,) = error_lines(caplog)
    assert "not readable by this version" in message
    assert schema_state(db_url) == before


def test_readers_follow_the_chain_of_migrations(db_url, tmp_path):
    """An incompatible migration leaves only itself; a compatible one after it adds itself to that; going
    back down restores what each schema had."""
    newest, (breaking, adding) = newer_edgefire(tmp_path / "newest", INCOMPATIBLE, ADDITIVE)
    middle, _ = newer_edgefire(tmp_path / "middle", INCOMPATIBLE)
    upgrade_to_head(db_url, newest)
    assert readers_of(db_url) == [breaking, adding]
    check_serviceable(db_url, middle)  # a replica at the incompatible revision serves the newest schema
    with pytest.raises(SchemaMismatch, match="not readable by this version"):
        check_serviceable(db_url)
    command.downgrade(alembic_config(db_url, newest), breaking)
    assert readers_of(db_url) == [breaking]
    command.downgrade(alembic_config(db_url, newest), head_revision())
    assert readers_of(db_url) == every_revision_of_this_edgefire()
    check_serviceable(db_url)


def test_a_migration_that_does_not_declare_compatibility_is_refused_before_it_runs(db_url, tmp_path):
    newer, (added,) = newer_edgefire(tmp_path / "newer", UNDECLARED)
    upgrade_to_head(db_url)
    with pytest.raises(SchemaMismatch, match=f"migration {added} .*must declare `backward_compatible"):
        upgrade_to_head(db_url, newer)
    assert schema_state(db_url)["revision"] == [head_revision()]
    assert "unmarked" not in schema_state(db_url)["columns"]
