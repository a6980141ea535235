"""Running the registry's Alembic migrations from the installed package (no alembic.ini needed), and
checking that a database holds a schema this registry can serve.

Several registry replicas may start at once on one empty database: on PostgreSQL the migration
runs under an advisory lock (registry/migrations/env.py), so one replica migrates and the others
find the schema at head.

Rolling upgrades (expand, then contract). Every migration declares `backward_compatible`: whether
replicas of the revision before it can still serve the schema after it (it only adds tables, nullable
or defaulted columns, indexes). Each migration run records in `registry_schema_readers` the code
revisions that can serve the schema it left: its own revision and, walking back while each migration
is backward compatible, the revision before each (a compatible migration keeps the readers of the
schema before it; an incompatible one leaves itself alone). A replica meeting a schema from a newer
edgefire (a revision its migrations do not contain) serves it, with a warning, when its own head is
listed there, and refuses it (SchemaMismatch) otherwise. It never migrates, stamps or downgrades such
a schema: only the newer edgefire, or one newer still, does.

Operators read the list in SQL: `SELECT reader_revision FROM registry_schema_readers`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import Column, Connection, MetaData, String, Table, inspect, select, text

from registry.db import make_engine
from registry.tables import Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
READERS_TABLE = "registry_schema_readers"

# Migration bookkeeping beside alembic_version, not a model of the service (registry.tables):
# created by migration 0012_schema_readers and written only by migration runs (record_readers).
schema_readers = Table(
    READERS_TABLE, MetaData(),
    Column("reader_revision", String(64), primary_key=True),  # a code revision that can serve the schema
    Column("schema_revision", String(64), nullable=False),  # the schema revision this row was written for
)

log = logging.getLogger(__name__)


class SchemaMismatch(Exception):
    """The database's schema is not one this registry can serve (or migrate)."""


def alembic_config(db_url: str, migrations_dir: Path = MIGRATIONS_DIR) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir))
    # Passed as an attribute, not a main option: ConfigParser would read '%' in a URL as interpolation.
    config.attributes["db_url"] = db_url
    return config


def head_revision(migrations_dir: Path = MIGRATIONS_DIR) -> str:
    return ScriptDirectory(str(migrations_dir)).get_current_head()


def upgrade_to_head(db_url: str, migrations_dir: Path = MIGRATIONS_DIR) -> None:
    """Migrates the database to the latest revision these migrations know. A database from a newer
    edgefire is left as it is when this version can serve it (with a warning); otherwise SchemaMismatch."""
    command.upgrade(alembic_config(db_url, migrations_dir), "head")


def database_revisions(db_url: str) -> tuple[str, ...]:
    """The revisions the database's schema is at (none for an empty database)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return tuple(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()


def downgrade_to_base(db_url: str) -> None:
    command.downgrade(alembic_config(db_url), "base")


def check_serviceable(db_url: str, migrations_dir: Path = MIGRATIONS_DIR) -> None:
    """Raises SchemaMismatch unless the registry can serve this database: its schema is the latest
    revision (an older one lacks columns the service reads and writes) or a newer one that lists this
    revision among its compatible readers, and, on PostgreSQL, the user may read and write every
    table (a read-only user would start, then refuse every heartbeat and change)."""
    script = ScriptDirectory(str(migrations_dir))
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_heads()
            if newer_revisions(script, current):
                check_readable(conn, script, current)
                log.warning("the database's registry schema is at revision %s, newer than this edgefire's %s, "
                            "which it lists as a compatible reader: serving it as it is; upgrade this replica "
                            "to serve what the newer revision added", ", ".join(current), script.get_current_head())
            else:
                _check_at_head(script, current)
            if conn.dialect.name == "postgresql":
                _check_privileges(conn)
    finally:
        engine.dispose()


def newer_revisions(script: ScriptDirectory, current: tuple[str, ...]) -> list[str]:
    """The database's revisions that these migrations do not contain: a newer edgefire wrote them."""
    known = {revision.revision for revision in script.walk_revisions()}
    return [revision for revision in current if revision not in known]


def check_readable(conn: Connection, script: ScriptDirectory, current: tuple[str, ...]) -> None:
    """Raises SchemaMismatch unless the database, at a revision from a newer edgefire, lists this
    edgefire's head among the code revisions that can serve it."""
    head = script.get_current_head()
    readers = stored_readers(conn, current[0]) if len(current) == 1 else []
    if head not in readers:
        readable_by = ", ".join(readers) or "no older version"
        raise SchemaMismatch(
            f"the database's registry schema is at revision {', '.join(current)}, from a newer edgefire, and is "
            f"not readable by this version (its latest revision is {head}; the schema can be served by "
            f"{readable_by}): upgrade this replica to the edgefire version that migrated the database, or a newer one")


def refuse_to_change_newer(conn: Connection, script: ScriptDirectory, current: tuple[str, ...],
                           destination: str | tuple[str, ...] | None) -> None:
    """Called instead of migrating a database from a newer edgefire (registry/migrations/env.py):
    an upgrade to this version's head is a no-op when this version can serve the schema; a downgrade,
    a stamp elsewhere or an unreadable schema is refused, and nothing is changed either way."""
    head = script.get_current_head()
    if destination not in (head, "head", "heads", (head,)):
        raise SchemaMismatch(
            f"the database's registry schema is at revision {', '.join(current)}, from a newer edgefire: this "
            f"version (latest revision {head}) never downgrades or re-stamps it; run that with the edgefire "
            f"version that migrated the database")
    check_readable(conn, script, current)
    log.warning("the database's registry schema is at revision %s, newer than this edgefire's %s, which it lists "
                "as a compatible reader: left as it is (not migrated)", ", ".join(current), head)


def compatible_readers(script: ScriptDirectory, revision: str) -> list[str]:
    """The code revisions that can serve the schema at `revision`: itself and, walking back while each
    migration is backward compatible, the revision before it. Newest first."""
    readers = [revision]
    pending = [revision]
    while pending:
        migration = script.get_revision(pending.pop())
        if not declared_backward_compatible(migration):
            continue
        for previous in _down_revisions(migration):
            if previous not in readers:
                readers.append(previous)
                pending.append(previous)
    return readers


def declared_backward_compatible(migration: Script) -> bool:
    declared = getattr(migration.module, "backward_compatible", None)
    if not isinstance(declared, bool):
        before = ", ".join(_down_revisions(migration)) or "an empty database"
        raise SchemaMismatch(
            f"migration {migration.revision} ({migration.path}) must declare `backward_compatible = True` or "
            f"`False`: whether replicas of {before} can still serve the schema after it (True only when it adds "
            f"tables, nullable or defaulted columns, or indexes), got {declared!r}")
    return declared


def check_declarations(script: ScriptDirectory) -> None:
    """Raises SchemaMismatch, before anything is migrated, when a migration does not say whether it
    is backward compatible."""
    for migration in script.walk_revisions():
        declared_backward_compatible(migration)


def record_readers(conn: Connection, script: ScriptDirectory, current: tuple[str, ...]) -> None:
    """Writes `registry_schema_readers` for the schema a migration step left, in that step's transaction
    (registry/migrations/env.py), from the migrations' declarations; a schema without the table (older
    than it, or downgraded past it) has nothing to write."""
    if not inspect(conn).has_table(READERS_TABLE):
        return
    if len(current) != 1:
        raise SchemaMismatch(f"the registry's migrations are one line of revisions; the database has heads "
                             f"{', '.join(current) or '(none)'}")
    wanted = {(reader, current[0]) for reader in compatible_readers(script, current[0])}
    stored = {tuple(row) for row in conn.execute(select(schema_readers.c.reader_revision,
                                                        schema_readers.c.schema_revision))}
    if stored != wanted:
        conn.execute(schema_readers.delete())
        conn.execute(schema_readers.insert(), [{"reader_revision": reader, "schema_revision": schema}
                                               for reader, schema in sorted(wanted)])


def stored_readers(conn: Connection, schema_revision: str) -> list[str]:
    """The code revisions the database lists as able to serve its schema at `schema_revision`."""
    if not inspect(conn).has_table(READERS_TABLE):
        return []
    query = select(schema_readers.c.reader_revision).where(schema_readers.c.schema_revision == schema_revision)
    return sorted(conn.execute(query).scalars())


def is_model_table(name: str | None, type_: str, _parent_names) -> bool:
    """Autogenerate's filter: the readers table is bookkeeping, not one of registry.tables' models."""
    return not (type_ == "table" and name == READERS_TABLE)


def _down_revisions(migration: Script) -> tuple[str, ...]:
    down = migration.down_revision
    return (down,) if isinstance(down, str) else tuple(down or ())


def _check_at_head(script: ScriptDirectory, current: tuple[str, ...]) -> None:
    head = script.get_current_head()
    if current != (head,):
        found = f"registry schema revision {', '.join(current)}" if current else "no registry schema"
        raise SchemaMismatch(f"the database holds {found}; this registry serves revision {head}: "
                             f"run `edgefire registry migrate --db URL`, or serve without --no-migrate")


def _check_privileges(conn: Connection) -> None:
    missing = []
    for table in Base.metadata.sorted_tables:
        for privilege in ("SELECT", "INSERT", "UPDATE", "DELETE"):  # several at once: true if ANY is held
            if not conn.execute(text("SELECT has_table_privilege(:t, :p)"), {"t": table.name, "p": privilege}).scalar():
                missing.append(f"{privilege} on {table.name}")
        if "id" in table.c and table.c.id.autoincrement is True:
            sequence = conn.execute(text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": table.name}).scalar()
            if sequence and not conn.execute(text("SELECT has_sequence_privilege(:s, 'USAGE')"),
                                             {"s": sequence}).scalar():
                missing.append(f"USAGE on {sequence}")
    if missing:
        user = conn.execute(text("SELECT current_user")).scalar()
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise SchemaMismatch(f"the database user {user!r} may not write the registry's tables (missing {shown}): "
                             f"grant it SELECT, INSERT, UPDATE, DELETE on the tables and USAGE on their sequences, "
                             f"or use the user that ran `edgefire registry migrate`")
