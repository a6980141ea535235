"""`edgefire registry migrate` builds the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from deploy.cli import main as edgefire
from registry.db import make_engine
from registry.migrate import downgrade_to_base, is_model_table
from registry.tables import Base

REGISTRY_TABLES = {"sites", "site_models", "capacity", "links", "api_keys", "site_tokens", "audit_log",
                   "registry_version", "leases", "placements", "fleet_routers", "rate_usage", "rate_holds",
                   "key_usage", "registry_schema_readers"}



def test_migrate_command_creates_schema_matching_models(empty_db_url):
    assert edgefire(["registry", "migrate", "--db", empty_db_url]) == 0
    assert edgefire(["registry", "migrate", "--db", empty_db_url]) == 0  # a second run is a no-op
    engine = make_engine(empty_db_url)
    try:
        assert REGISTRY_TABLES <= set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            # the readers table is migration bookkeeping (registry/migrate.py), like alembic_version
            context = MigrationContext.configure(conn, opts={"include_name": is_model_table})
            differences = compare_metadata(context, Base.metadata)
        assert differences == []
    finally:
        engine.dispose()


def test_downgrade_removes_everything(empty_db_url):
    assert edgefire(["registry", "migrate", "--db", empty_db_url]) == 0
    downgrade_to_base(empty_db_url)
    engine = make_engine(empty_db_url)
    try:
        assert not REGISTRY_TABLES & set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_sqlite_runs_in_wal_mode_with_busy_timeout(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    assert edgefire(["registry", "migrate", "--db", url]) == 0
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_in_memory_sqlite_is_refused():
    with pytest.raises(ValueError, match="SQLite file"):
        make_engine("sqlite://")


def test_serve_without_tokens_fails_clearly(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("EDGEFIRE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("EDGEFIRE_ROUTER_TOKEN", raising=False)
    assert edgefire(["registry", "serve", "--db", f"sqlite:///{tmp_path / 'r.db'}"]) == 2
    assert "--admin-token" in caplog.text


def test_serve_reads_tokens_from_environment(monkeypatch):
    from deploy.cli import build_parser

    monkeypatch.setenv("EDGEFIRE_ADMIN_TOKEN", "a-tok")
    monkeypatch.setenv("EDGEFIRE_ROUTER_TOKEN", "r-tok")
    args = build_parser().parse_args(["registry", "serve", "--port", "9000"])
    assert (args.admin_token, args.router_token, args.port) == ("a-tok", "r-tok", 9000)
    assert callable(args.func)
