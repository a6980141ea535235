"""Alembic environment for the registry: connects with registry.db's engine factory."""

from __future__ import annotations

from alembic import context

from registry.db import make_engine, writer
from registry.tables import Base

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    db_url = config.attributes.get("db_url") or config.get_main_option("sqlalchemy.url")
    if not db_url:
        raise RuntimeError("no database URL: use registry.migrate.alembic_config(db_url)")
    engine = make_engine(db_url)
    try:
        with writer(engine).connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (--sql) migrations are not supported; run `edgefire registry migrate`")
run_online()
