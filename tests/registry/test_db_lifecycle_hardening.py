"""The registry database's life cycle as an operator meets it: replicas migrating one database at once,
a downgrade that keeps every row, a database from a newer edgefire, and database URLs that cannot be
used (each one line and exit status 2, never a traceback)."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import uuid

import psycopg
import pytest
from alembic import command
from sqlalchemy import text
from sqlalchemy.engine import make_url

from deploy.cli import main as edgefire
from registry.db import make_engine
from registry.migrate import alembic_config, head_revision, upgrade_to_head
from registry.records import LinkMeasurement, ModelServed, SiteSpec
from registry.store import RegistryStore

from .conftest import ADMIN_TOKEN, PG_URL, capacity, drop_pg_schema, new_pg_schema, pg_libpq_url, pg_schema_url

NUM_REPLICAS = 3



def _serve(db_url: str, *flags: str) -> int:
    """`edgefire registry serve` on a port already taken: a registry that wrongly went on to serve ends
    at once (uvicorn cannot bind) instead of serving for ever."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        return edgefire(["registry", "serve", "--db", db_url, "--port", port, "--admin-token", "a",
                         "--router-token", "r", *flags])


def _set_revision(db_url: str, revision: str) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    engine.dispose()


def _one_clear_error(caplog) -> str:
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    return errors[0].getMessage()


def _migrate_after(barrier, db_url: str, results) -> None:
    barrier.wait()
    try:
        upgrade_to_head(db_url)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names it
        results.put(f"{type(exc).__name__}: {exc}"[:300])
    else:
        results.put("ok")


def test_replicas_migrating_one_empty_postgres_at_once_all_succeed():
    """Replicas started together on an empty database each migrate before serving: one creates the
    schema, the others find it at head (they raised 'duplicate key ... pg_type_typname_nsp_index')."""
    schema = new_pg_schema()
    db_url = pg_schema_url(schema)
    try:
        fork = multiprocessing.get_context("fork")
        barrier, results = fork.Barrier(NUM_REPLICAS), fork.Queue()
        replicas = [fork.Process(target=_migrate_after, args=(barrier, db_url, results)) for _ in range(NUM_REPLICAS)]
        for replica in replicas:
            replica.start()
        outcomes = [results.get(timeout=60) for _ in replicas]
        for replica in replicas:
            replica.join(10)
        assert outcomes == ["ok"] * NUM_REPLICAS
        engine = make_engine(db_url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head_revision()]
            assert conn.execute(text("SELECT version FROM registry_version")).scalars().all() == [1]
        engine.dispose()
    finally:
        drop_pg_schema(schema)


def test_downgrade_keeps_the_rows_that_refer_to_sites(empty_db_url):
    """Downgrading past 0002 rebuilds `sites` on SQLite; with foreign keys on, dropping the old table
    cascade-deleted every site's models, capacity, links and agent tokens."""
    upgrade_to_head(empty_db_url)
    store = RegistryStore.open(empty_db_url)
    spec = SiteSpec(region="eu-west", country="DE", lat=50.1, lon=8.7, models=[ModelServed("m", "both", 1024, "f")])
    fra = store.sites.create("fra-1", spec, actor="ops")
    ams = store.sites.create("ams-1", spec, actor="ops")
    token = store.access.issue_site_token("fra-1", actor="ops")
    store.telemetry.record_heartbeat(fra.id, capacity(100, 40, 16))
    store.telemetry.record_links(fra.id, [LinkMeasurement("ams-1", rtt_ms=7.0, bandwidth_mbps=900.0)])
    store.close()

    command.downgrade(alembic_config(empty_db_url), "0001_initial")
    engine = make_engine(empty_db_url)
    with engine.connect() as conn:
        counts = {table: conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()
                  for table in ("sites", "site_models", "capacity", "links", "site_tokens")}
    engine.dispose()
    assert counts == {"sites": 2, "site_models": 2, "capacity": 1, "links": 1, "site_tokens": 1}

    upgrade_to_head(empty_db_url)
    store = RegistryStore.open(empty_db_url)
    try:
        assert store.access.site_for_token(token).site_id == fra.id
        assert [m.model for m in store.sites.get("fra-1").models] == ["m"]
        assert store.snapshot().db_version > 0
        store.sites.delete("ams-1", actor="ops", force=True)  # the references still cascade after the rebuild
        engine = store.engine
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM links")).scalar() == 0
            assert conn.execute(text("SELECT count(*) FROM site_models")).scalar() == 1
    finally:
        store.close()
    assert ams.id != fra.id


@pytest.mark.parametrize("flags", [[], ["--no-migrate"]])
def test_database_from_a_newer_edgefire_is_refused(empty_db_url, flags, caplog):
    assert edgefire(["registry", "migrate", "--db", empty_db_url]) == 0
    _set_revision(empty_db_url, "0099_from_the_future")
    caplog.clear()
    assert _serve(empty_db_url, *flags) == 2
    message = _one_clear_error(caplog)
    assert "0099_from_the_future" in message and head_revision() in message and "newer" in message
    caplog.clear()
    assert edgefire(["registry", "migrate", "--db", empty_db_url]) == 2
    assert "0099_from_the_future" in _one_clear_error(caplog)
    engine = make_engine(empty_db_url)
    with engine.connect() as conn:  # left exactly as the newer edgefire wrote it
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == "0099_from_the_future"
    engine.dispose()


def test_serve_no_migrate_refuses_an_older_or_missing_schema(empty_db_url, caplog):
    assert _serve(empty_db_url, "--no-migrate") == 2  # nothing migrated: it failed at start-up with a traceback
    assert "no registry schema" in _one_clear_error(caplog)
    command.upgrade(alembic_config(empty_db_url), "0008_expert_parallel")
    caplog.clear()
    assert _serve(empty_db_url, "--no-migrate") == 2
    message = _one_clear_error(caplog)
    assert "0008_expert_parallel" in message and "edgefire registry migrate" in message


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bad_urls(tmp_path) -> dict[str, str]:
    pg = make_url(PG_URL)
    (tmp_path / "a-file").write_text("not a directory")
    return {
        "host down": pg.set(host="127.0.0.1", port=_closed_port()).render_as_string(hide_password=False),
        "no such database": pg.set(database=f"edgefire_missing_{uuid.uuid4().hex[:8]}").render_as_string(
            hide_password=False),
        "no such user": pg.set(username=f"edgefire_nobody_{uuid.uuid4().hex[:8]}", password="wrong-secret")
                          .render_as_string(hide_password=False),
        "not a URL": "registry.db",
        "mistyped, with a password": "postgresql+psycopg//edgefire:wrong-secret@db.example.net/edgefire",
        "no driver": "mysql://edgefire@db.example.net/edgefire",
        "in memory": "sqlite://",
        "SQLite under a file": f"sqlite:///{tmp_path / 'a-file' / 'registry.db'}",
    }


@pytest.mark.parametrize("case", ["host down", "no such database", "no such user", "not a URL",
                                  "mistyped, with a password", "no driver", "in memory", "SQLite under a file"])
@pytest.mark.parametrize("verb", ["migrate", "serve"])
def test_an_unusable_database_url_is_one_line_and_exit_2(case, verb, tmp_path, caplog, capsys):
    db_url = _bad_urls(tmp_path)[case]
    argv = ["registry", "migrate", "--db", db_url] if verb == "migrate" else None
    assert (edgefire(argv) if argv else _serve(db_url)) == 2
    message = _one_clear_error(caplog)
    assert "registry database" in message and "wrong-secret" not in message
    assert "Traceback" not in capsys.readouterr().err


def test_a_user_that_may_not_write_the_tables_is_refused_before_serving(caplog):
    """A read-only PostgreSQL user served, then answered every heartbeat 422 'permission denied for
    table capacity' and every admin change 500."""
    schema = new_pg_schema()
    role = f"edgefire_reader_{uuid.uuid4().hex[:8]}"
    admin_url = pg_schema_url(schema)
    upgrade_to_head(admin_url)
    with psycopg.connect(pg_libpq_url(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'reader-secret'")
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        conn.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
    reader_url = admin_url.replace(make_url(PG_URL).render_as_string(hide_password=False),
                                   make_url(PG_URL).set(username=role, password="reader-secret")
                                   .render_as_string(hide_password=False))
    try:
        assert _serve(reader_url, "--no-migrate") == 2
        message = _one_clear_error(caplog)
        assert role in message and "INSERT on api_keys" in message and "reader-secret" not in message
    finally:
        drop_pg_schema(schema)
        with psycopg.connect(pg_libpq_url(), autocommit=True) as conn:
            conn.execute(f"DROP ROLE {role}")



async def test_concurrent_puts_of_one_new_site_all_succeed(raw, store):
    """PUT /v1/admin/sites/NAME is idempotent: several at once (two launchers, a retried deploy
    script) all succeed. On PostgreSQL all but one answered 500 (unique violation on sites.name)."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for round_ in range(8):
        name = f"edge-{round_}"
        answers = await asyncio.gather(*[
            raw.put(f"/v1/admin/sites/{name}", headers=headers, json={"region": f"r{i}", "country": "DE"})
            for i in range(4)])
        assert sorted(a.status_code for a in answers) == [200, 200, 200, 201], [a.text for a in answers]
        assert store.sites.get(name).region in {"r0", "r1", "r2", "r3"}
    assert len(store.sites.list(limit=1000).items) == 8
