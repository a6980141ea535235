"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}
# True only when replicas of the revision before this one can still serve the schema after it: it only
# adds (tables, nullable or server-defaulted columns, indexes). Renaming, dropping, retyping or a new
# constraint older code would break is False. Recorded in registry_schema_readers (registry/migrate.py).
backward_compatible = False


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
