"""Alembic environment for the registry: connects with registry.db's engine factory.

Migrations run in one transaction. On PostgreSQL that transaction first takes an advisory lock, so
replicas starting together on one database migrate one after another (the later ones find the
schema at head) instead of racing to create the same tables. On SQLite the writer's BEGIN IMMEDIATE
serialises them, and foreign keys are off while the migrations run: batch mode rebuilds a table by
copying and dropping it, and dropping `sites` with foreign keys on would cascade-delete every row
that refers to it (models, capacity, links, tokens); the references are checked before the commit.

A database at a revision these migrations do not contain comes from a newer edgefire: it is never
migrated, stamped or downgraded here (registry.migrate.refuse_to_change_newer). Every run that
migrates records which code revisions can serve the schema it left (registry.migrate.record_readers).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import func, select

from registry.db import make_engine, writer
from registry.migrate import (SchemaMismatch, check_declarations, is_model_table, newer_revisions, record_readers,
                              refuse_to_change_newer)
from registry.tables import Base

config = context.config
MIGRATION_LOCK_KEY = 0x6564676566697265  # "edgefire": the advisory lock held while migrating


def _run(connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=sqlite,  # SQLite cannot ALTER most things
        # SQLite's DDL is transactional too (Alembic assumes not, and would commit each step on its own): one
        # transaction, so a step that fails, or leaves references the check below refuses, changes nothing.
        transactional_ddl=True,
        include_name=is_model_table,
        on_version_apply=_record_readers,  # in the run's transaction, with the step's own version change
    )
    with context.begin_transaction():
        if not sqlite:
            connection.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_KEY)))
        script = context.script
        current = context.get_context().get_current_heads()
        if newer_revisions(script, current):
            refuse_to_change_newer(connection, script, current, context.get_revision_argument())
            return
        check_declarations(script)
        context.run_migrations()
        if sqlite:
            _check_foreign_keys(connection)


def _record_readers(ctx, step, heads, run_args) -> None:
    record_readers(ctx.connection, context.script, tuple(heads))


def _check_foreign_keys(connection) -> None:
    broken = connection.exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        tables = sorted({row[0] for row in broken})
        raise SchemaMismatch(f"migrating left rows whose foreign keys point nowhere in {', '.join(tables)}; "
                             f"nothing was changed")


def run_online() -> None:
    db_url = config.attributes.get("db_url") or config.get_main_option("sqlalchemy.url")
    if not db_url:
        raise RuntimeError("no database URL: use registry.migrate.alembic_config(db_url)")
    engine = make_engine(db_url)
    try:
        with writer(engine).connect() as connection:
            if connection.dialect.name == "sqlite":
                # Outside any transaction (inside one SQLite ignores it); this connection is disposed after.
                connection.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported; run `edgefire registry migrate`")
run_online()
