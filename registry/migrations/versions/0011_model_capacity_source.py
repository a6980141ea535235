"""Which heartbeat a site's per-model figures came from, so figures left by a registry older than them are not read.

Revision ID: 0011_model_capacity_source
Revises: 0010_model_capacity
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_model_capacity_source"
down_revision = "0010_model_capacity"
branch_labels = None
depends_on = None
backward_compatible = True  # adds a nullable capacity column, so figures older replicas leave behind are not read


def upgrade() -> None:
    # Left NULL: which heartbeat wrote a stored `models` is unknown (a registry older than it may have
    # updated the row since), so it is not read until the site's next heartbeat rewrites it.
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("models_reported_at", sa.Float, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("models_reported_at")
