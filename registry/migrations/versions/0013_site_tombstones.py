"""Tombstones of deleted sites: each token a deleted site had (its hash), with the site's name, when and by whom.

Revision ID: 0013_site_tombstones
Revises: 0012_schema_readers
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_site_tombstones"
down_revision = "0012_schema_readers"
branch_labels = None
depends_on = None
# adds a table (an older replica deletes sites without leaving tombstones: their agents get 401, as before)
backward_compatible = True


def upgrade() -> None:
    op.create_table(
        "site_tombstones",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("site_name", sa.String(63), nullable=False),
        sa.Column("deleted_at", sa.Float, nullable=False),
        sa.Column("deleted_by", sa.String(200), nullable=False),
    )
    op.create_index("ix_site_tombstones_deleted_at", "site_tombstones", ["deleted_at"])


def downgrade() -> None:
    op.drop_index("ix_site_tombstones_deleted_at", table_name="site_tombstones")
    op.drop_table("site_tombstones")
