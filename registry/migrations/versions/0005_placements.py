"""Recent placements reported by routers (prefill site, decode site, requests per window), for the dashboard.

Revision ID: 0005_placements
Revises: 0004_site_model_kv
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_placements"
down_revision = "0004_site_model_kv"
branch_labels = None
depends_on = None
backward_compatible = True  # adds a table and its index


def upgrade() -> None:
    op.create_table(
        "placements",
        sa.Column("prefill_site_id", sa.Integer, sa.ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("decode_site_id", sa.Integer, sa.ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("window_start", sa.Float, primary_key=True),
        sa.Column("num_requests", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_placements_window_start", "placements", ["window_start"])


def downgrade() -> None:
    op.drop_index("ix_placements_window_start", table_name="placements")
    op.drop_table("placements")
