"""The fleet: routers' reports, global rate-limit windows and holds, per-key usage accounting.

Revision ID: 0007_fleet
Revises: 0006_parallel_layout
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_fleet"
down_revision = "0006_parallel_layout"
branch_labels = None
depends_on = None
# adds tables and an index (older replicas answer no fleet calls: an API difference, not a schema one)
backward_compatible = True


def upgrade() -> None:
    op.create_table(
        "fleet_routers",
        sa.Column("router_id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("first_report_at", sa.Float, nullable=False),
        sa.Column("last_report_at", sa.Float, nullable=False),
    )
    op.create_table(
        "rate_usage",
        sa.Column("key_id", sa.Integer, sa.ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("slot", sa.BigInteger, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "rate_holds",
        sa.Column("key_id", sa.Integer, sa.ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("router_id", sa.String(64), primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("demand_requests", sa.Float, nullable=False),
        sa.Column("demand_tokens", sa.Float, nullable=False),
        sa.Column("reported_at", sa.Float, nullable=False),
    )
    op.create_table(
        "key_usage",
        sa.Column("key_id", sa.Integer, sa.ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("model", sa.String(200), primary_key=True),
        sa.Column("hour", sa.BigInteger, primary_key=True),
        sa.Column("requests", sa.BigInteger, nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger, nullable=False),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_key_usage_hour", "key_usage", ["hour"])


def downgrade() -> None:
    op.drop_index("ix_key_usage_hour", table_name="key_usage")
    op.drop_table("key_usage")
    op.drop_table("rate_holds")
    op.drop_table("rate_usage")
    op.drop_table("fleet_routers")
