"""A site's expert-parallel size (how many ranks per stage split a mixture of experts' experts),
next to its tensor x pipeline-parallel layout.

Revision ID: 0008_expert_parallel
Revises: 0007_fleet
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_expert_parallel"
down_revision = "0007_fleet"
branch_labels = None
depends_on = None
backward_compatible = True  # adds a capacity column with a server default


def upgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("expert_parallel_size", sa.Integer, nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("expert_parallel_size")
