"""The load a site's decode rate was measured under (sequences per step, KV tokens they held).

Revision ID: 0003_decode_load
Revises: 0002_planner
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_decode_load"
down_revision = "0002_planner"
branch_labels = None
depends_on = None
backward_compatible = True  # adds capacity columns with server defaults; older heartbeats leave them as they were


def upgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.add_column(sa.Column("decode_batch_size", sa.Float, nullable=False, server_default="0"))
        batch.add_column(sa.Column("decode_kv_tokens", sa.Float, nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("capacity") as batch:
        batch.drop_column("decode_kv_tokens")
        batch.drop_column("decode_batch_size")
