"""Each model's own KV pool and prefix cache at a site hosting several models, from its heartbeat.

Revision ID: 0010_model_capacity
Revises: 0009_speculation
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_model_capacity"
down_revision = "0009_speculation"
branch_labels = None
depends_on = None
# adds a nullable capacity column; the per-model figures older replicas leave stale are not read since 0011
backward_compatible = True


def upgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("models", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("models")
