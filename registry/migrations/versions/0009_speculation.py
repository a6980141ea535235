"""Speculative decoding: the share of proposed tokens a site's engines kept, from its heartbeat.

Revision ID: 0009_speculation
Revises: 0008_expert_parallel
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_speculation"
down_revision = "0008_expert_parallel"
branch_labels = None
depends_on = None
backward_compatible = True  # adds a capacity column with a server default


def upgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("speculative_acceptance", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("speculative_acceptance")
