"""Initial registry schema: sites, site_models, capacity, links, api_keys, site_tokens, audit_log.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-21
"""

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None
backward_compatible = False  # the first schema: no earlier revision exists to serve it


def _site_fk(column: str) -> sa.Column:
    return sa.Column(column, sa.Integer, sa.ForeignKey("sites.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "sites",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("region", sa.String(63)),
        sa.Column("country", sa.String(2)),
        sa.Column("lat", sa.Float),
        sa.Column("lon", sa.Float),
        sa.Column("grpc_address", sa.String(300)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("drain_deadline", sa.Float),
        sa.Column("roles", sa.Text, nullable=False),
        sa.Column("heartbeat_interval_s", sa.Float, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "site_models",
        _site_fk("site_id"),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("site_id", "model"),
    )
    op.create_table(
        "capacity",
        sa.Column("site_id", sa.Integer, sa.ForeignKey("sites.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("kv_blocks_total", sa.BigInteger, nullable=False),
        sa.Column("kv_blocks_free", sa.BigInteger, nullable=False),
        sa.Column("block_size", sa.Integer, nullable=False),
        sa.Column("num_running", sa.Integer, nullable=False),
        sa.Column("num_waiting", sa.Integer, nullable=False),
        sa.Column("inflight_prefill_tokens", sa.BigInteger, nullable=False),
        sa.Column("inflight_decode_tokens", sa.BigInteger, nullable=False),
        sa.Column("prefill_tokens_per_s", sa.Float, nullable=False),
        sa.Column("decode_tokens_per_s", sa.Float, nullable=False),
        sa.Column("prefix_cache_summary", sa.Text),
        sa.Column("draining", sa.Boolean, nullable=False),
        sa.Column("reported_at", sa.Float, nullable=False),
    )
    op.create_table(
        "links",
        _site_fk("src_site_id"),
        _site_fk("dst_site_id"),
        sa.Column("rtt_ms", sa.Float, nullable=False),
        sa.Column("bandwidth_mbps", sa.Float, nullable=False),
        sa.Column("measured_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("src_site_id", "dst_site_id"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("allowed_regions", sa.Text, nullable=False),
        sa.Column("requests_per_minute", sa.Integer),
        sa.Column("tokens_per_minute", sa.Integer),
        sa.Column("revoked", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "site_tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        _site_fk("site_id"),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_site_tokens_site_id", "site_tokens", ["site_id"])
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("actor", sa.String(200), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    version = op.create_table(
        "registry_version",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    op.bulk_insert(version, [{"id": 1, "version": 1}])


def downgrade() -> None:
    for table in ("registry_version", "audit_log", "site_tokens", "api_keys", "links", "capacity", "site_models", "sites"):
        op.drop_table(table)
