"""The prefill/decode planner: a site's active role (within its allowed roles) and the planner's lease.

Revision ID: 0002_planner
Revises: 0001_initial
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002_planner"
down_revision = "0001_initial"
branch_labels = None
depends_on = None
backward_compatible = True  # adds nullable sites columns (NULL: every allowed role) and a new table


def upgrade() -> None:
    with op.batch_alter_table("sites") as batch:
        batch.add_column(sa.Column("active_role", sa.String(16)))
        batch.add_column(sa.Column("active_role_since", sa.Float))
    op.create_table(
        "leases",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leases")
    with op.batch_alter_table("sites") as batch:
        batch.drop_column("active_role_since")
        batch.drop_column("active_role")
