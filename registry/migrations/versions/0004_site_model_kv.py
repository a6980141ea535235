"""A site's own KV figures for each model it serves: bytes per token and the KV format.

Revision ID: 0004_site_model_kv
Revises: 0003_decode_load
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_site_model_kv"
down_revision = "0003_decode_load"
branch_labels = None
depends_on = None
backward_compatible = True  # adds nullable site_models columns (NULL: figures not reported)


def upgrade() -> None:
    with op.batch_alter_table("site_models") as batch:
        batch.add_column(sa.Column("kv_bytes_per_token", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("kv_format", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("site_models") as batch:
        batch.drop_column("kv_format")
        batch.drop_column("kv_bytes_per_token")
