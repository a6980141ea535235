"""Running the registry's Alembic migrations from the installed package (no alembic.ini needed), and
checking that a database holds the schema this registry serves.

Several registry replicas may start at once on one empty database: on PostgreSQL the migration
runs under an advisory lock (registry/migrations/env.py), so one replica migrates and the others
find the schema at head. A database from a newer edgefire (a revision this one does not know) is
never migrated nor served: SchemaMismatch says which revisions are involved.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from registry.db import make_engine
from registry.tables import Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


class SchemaMismatch(Exception):
    """The database's schema is not one this registry can serve (or migrate)."""


def alembic_config(db_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not a main option: ConfigParser would read '%' in a URL as interpolation.
    config.attributes["db_url"] = db_url
    return config


def head_revision() -> str:
    return ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()


def refuse_unknown_revisions(current: tuple[str, ...]) -> None:
    """Raises SchemaMismatch when the database is at a revision these migrations do not contain:
    a newer edgefire migrated it, and this one would misread (or, migrating, break) its tables."""
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    known = {revision.revision for revision in script.walk_revisions()}
    unknown = [revision for revision in current if revision not in known]
    if unknown:
        raise SchemaMismatch(
            f"the database's registry schema is at revision {', '.join(unknown)}, newer than this edgefire "
            f"knows (its latest is {script.get_current_head()}): run the edgefire version that migrated it, "
            f"or a newer one")


def upgrade_to_head(db_url: str) -> None:
    command.upgrade(alembic_config(db_url), "head")


def check_serviceable(db_url: str) -> None:
    """Raises SchemaMismatch unless the registry can serve this database: its schema is exactly the
    latest revision (an older one lacks columns the service reads and writes) and, on PostgreSQL,
    the user may read and write every table (a read-only user would start, then refuse every
    heartbeat and change)."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_heads()
            _check_at_head(current)
            if conn.dialect.name == "postgresql":
                _check_privileges(conn)
    finally:
        engine.dispose()


def _check_at_head(current: tuple[str, ...]) -> None:
    refuse_unknown_revisions(current)
    head = head_revision()
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


def downgrade_to_base(db_url: str) -> None:
    command.downgrade(alembic_config(db_url), "base")
