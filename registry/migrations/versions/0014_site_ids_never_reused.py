"""Site ids are never reused, on SQLite as on PostgreSQL (whose sequence never goes back).

SQLite gives a new row the largest id + 1, so a site created after the newest one was deleted took the
deleted site's id. A registry replica that still cached the deleted site's token (registry.auth, a few
seconds) then let the old agent's heartbeats, registration and deregistration land on the new site: its
address overwritten, its capacity the old agent's. AUTOINCREMENT makes SQLite never hand out an id again.
The table is rebuilt (batch mode, foreign keys off while migrating: registry/migrations/env.py); nothing
changes on PostgreSQL.

Revision ID: 0014_site_ids_never_reused
Revises: 0013_site_tombstones
Create Date: 2026-11-24
"""

from alembic import op

revision = "0014_site_ids_never_reused"
down_revision = "0013_site_tombstones"
branch_labels = None
depends_on = None
# same columns and constraints: an older replica serves it as before (its new sites' ids never repeat)
backward_compatible = True


def upgrade() -> None:
    _rebuild_sites(autoincrement=True)


def downgrade() -> None:
    _rebuild_sites(autoincrement=False)


def _rebuild_sites(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table("sites", recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
        pass
