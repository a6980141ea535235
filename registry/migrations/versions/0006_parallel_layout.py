"""A site's devices: the GPUs its engines run on and their tensor x pipeline-parallel layout.

Revision ID: 0006_parallel_layout
Revises: 0005_placements
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_parallel_layout"
down_revision = "0005_placements"
branch_labels = None
depends_on = None
backward_compatible = True  # adds capacity columns with server defaults


def upgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("num_gpus", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("tensor_parallel_size", sa.Integer, nullable=False, server_default="1"))
        batch.add_column(sa.Column("pipeline_parallel_size", sa.Integer, nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("pipeline_parallel_size")
        batch.drop_column("tensor_parallel_size")
        batch.drop_column("num_gpus")
