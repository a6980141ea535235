"""Running the registry's Alembic migrations from the installed package (no alembic.ini needed)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(db_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Passed as an attribute, not a main option: ConfigParser would read '%' in a URL as interpolation.
    config.attributes["db_url"] = db_url
    return config


def upgrade_to_head(db_url: str) -> None:
    command.upgrade(alembic_config(db_url), "head")


def downgrade_to_base(db_url: str) -> None:
    command.downgrade(alembic_config(db_url), "base")
