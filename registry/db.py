"""Opening the registry database: one engine factory for SQLite and PostgreSQL.

SQLite is the embedded default and must be a file (several threads share it). Each SQLite
connection runs in WAL mode (readers never block the writer) with a busy timeout, and write
transactions start with BEGIN IMMEDIATE: a deferred transaction that later upgrades to a writer can
fail with SQLITE_BUSY at once, without waiting out the busy timeout.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 10_000
WRITE_OPTION = "edgefire_write"  # execution option marking an engine whose transactions write


def make_engine(db_url: str) -> Engine:
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(db_url)
    return create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)


def writer(engine: Engine) -> Engine:
    """The same engine, but its transactions take the write lock up front on SQLite."""
    return engine.execution_options(**{WRITE_OPTION: True})


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def _sqlite_engine(db_url: str) -> Engine:
    url = make_url(db_url)
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:"):
        raise ValueError("the registry needs a SQLite file, e.g. sqlite:///var/edgefire/registry.db")
    directory = Path(database).expanduser().parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the directory {directory} for the SQLite database: "
                         f"{exc.strerror or exc}") from None
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=8,
        max_overflow=8,
    )
    event.listen(engine, "connect", _configure_sqlite_connection)
    event.listen(engine, "begin", _begin_sqlite_transaction)
    return engine


def _configure_sqlite_connection(dbapi_connection, _record) -> None:
    # The driver's own implicit BEGIN would defeat BEGIN IMMEDIATE; _begin_sqlite_transaction
    # emits BEGIN itself.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA foreign_keys=ON")
    # NORMAL is durable across process crashes in WAL mode; only a power loss can drop the
    # last commits, which agents resend within one heartbeat interval anyway.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _begin_sqlite_transaction(connection) -> None:
    if connection.get_execution_options().get(WRITE_OPTION):
        connection.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        connection.exec_driver_sql("BEGIN")
