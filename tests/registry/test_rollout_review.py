"""Rolling upgrades under stress: a newer migration that fails midway leaves the schema, its revision and the
readers recorded for it as they were; an older and a newer replica migrating one empty database at the same
moment end at the newer schema, listing the older one as a reader; a SQLite registry migrated from 0013 keeps
its sites and tokens and never hands a deleted site's id to a new one. On SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from registry.migrate import SchemaMismatch, head_revision, upgrade_to_head
from registry.records import SiteSpec
from registry.store import RegistryStore

from .test_schema_rollout import ADDITIVE, db_url, newer_edgefire, schema_state  # noqa: F401 - db_url: the fixture

REPO = Path(__file__).resolve().parents[2]
FAILS_MIDWAY = ("True", """
    op.create_table("half_done", sa.Column("id", sa.Integer, primary_key=True))
    op.execute("INSERT INTO no_such_table VALUES (1)")
""", """
    op.drop_table("half_done")
""")


def test_a_migration_failing_midway_leaves_schema_revision_and_readers_as_they_were(db_url, tmp_path):
    upgrade_to_head(db_url)
    before = schema_state(db_url)
    migrations, _added = newer_edgefire(tmp_path / "newer", ADDITIVE, FAILS_MIDWAY)
    with pytest.raises(Exception, match="no_such_table"):
        upgrade_to_head(db_url, migrations)
    assert schema_state(db_url) == before
    upgrade_to_head(db_url)   # and this edgefire still serves and migrates it
    assert schema_state(db_url) == before


def test_a_sqlite_migration_that_breaks_references_changes_nothing(tmp_path):
    """Foreign keys are off while SQLite migrates; a step that leaves rows pointing nowhere is refused, and
    "nothing was changed" must hold: the sites, their tokens and the revision are as before."""
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_to_head(url)
    store = RegistryStore.open(url)
    try:
        store.sites.create("fra-1", SiteSpec(region="eu-west"), "ops")
        token = store.access.issue_site_token("fra-1", "ops")
    finally:
        store.close()
    before = schema_state(url)
    drops_sites = ("True", "\n    op.execute('DELETE FROM sites')\n", "\n    pass\n")
    migrations, _added = newer_edgefire(tmp_path / "newer", ADDITIVE, drops_sites)
    with pytest.raises(SchemaMismatch, match="nothing was changed"):
        upgrade_to_head(url, migrations)
    assert schema_state(url) == before
    store = RegistryStore.open(url)
    try:
        assert store.access.site_for_token(token).name == "fra-1"
    finally:
        store.close()


def test_an_older_and_a_newer_replica_migrating_an_empty_database_at_once(db_url, tmp_path):
    """Two replica processes, this edgefire and a newer one, run `edgefire registry migrate` together."""
    migrations, added = newer_edgefire(tmp_path / "newer", ADDITIVE)
    older = [sys.executable, "-c", "import sys; from registry.migrate import upgrade_to_head; upgrade_to_head(sys.argv[1])",
             db_url]
    newer = [sys.executable, "-c", "import sys, pathlib; from registry.migrate import upgrade_to_head; "
             "upgrade_to_head(sys.argv[1], pathlib.Path(sys.argv[2]))", db_url, str(migrations)]
    processes = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for argv in (older, newer)]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    state = schema_state(db_url)
    assert state["revision"] == added
    assert head_revision() in state["readers"] and added[0] in state["readers"]


def test_sqlite_site_ids_are_not_reused_after_migrating_from_0013(tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    from alembic import command

    from registry.migrate import alembic_config
    command.upgrade(alembic_config(url), "0013_site_tombstones")
    store = RegistryStore.open(url)
    try:
        store.sites.create("fra-1", SiteSpec(region="eu-west"), "ops")
        newest = store.sites.create("ams-1", SiteSpec(region="eu-west"), "ops")
        token = store.access.issue_site_token("ams-1", "ops")
    finally:
        store.close()
    upgrade_to_head(url)
    store = RegistryStore.open(url)
    try:
        assert store.access.site_for_token(token).site_id == newest.id   # kept through the rebuild
        store.sites.delete("ams-1", "ops")
        again = store.sites.create("ams-1", SiteSpec(region="eu-west"), "ops")
        assert again.id != newest.id
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM site_tokens")).scalar() == 0   # cascaded with the site
    finally:
        store.close()
