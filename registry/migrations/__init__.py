"""Alembic migrations of the registry schema (a package so that it ships with the wheel)."""
