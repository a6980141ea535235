"""Which code revisions can serve the schema: registry_schema_readers, for rolling upgrades of replicas.

Written by every migration run from the migrations' `backward_compatible` declarations
(registry.migrate.record_readers), starting with this one's, which fills it for a database migrated before it.

Revision ID: 0012_schema_readers
Revises: 0011_model_capacity_source
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_schema_readers"
down_revision = "0011_model_capacity_source"
branch_labels = None
depends_on = None
backward_compatible = True  # adds a table that only migrations write


def upgrade() -> None:
    op.create_table(
        "registry_schema_readers",
        sa.Column("reader_revision", sa.String(64), primary_key=True),
        sa.Column("schema_revision", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("registry_schema_readers")
