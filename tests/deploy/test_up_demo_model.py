"""`edgefire up`'s demo model: made at the size asked for, rewritten (saying so) when it was made at
another, and a model the user names is never written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import build_parser
from deploy.cluster import config_from_args, ensure_model
from engine.demo import DEMO_RECORD, SIZES, demo_record, make_demo_model

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = Path(".edgefire/demo-model")


def up(*argv: str) -> None:
    args = build_parser().parse_args(["up", *argv])
    ensure_model(config_from_args(args), args.demo_size)


def hidden_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["hidden_size"]


def test_the_demo_model_is_rewritten_when_made_at_another_size(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_demo_model(DEMO_DIR, "tiny")
    up("--demo-size", "small")
    assert "rewriting the demo model in .edgefire/demo-model as small: it was made tiny" in capsys.readouterr().out
    assert hidden_size(DEMO_DIR) == SIZES["small"].hidden_size

    up("--demo-size", "small")   # the size asked for: used as it is
    assert capsys.readouterr().out == ""

    (DEMO_DIR / DEMO_RECORD).unlink()   # a demo model from before sizes were recorded, or one cut short
    up("--demo-size", "tiny")
    assert "as tiny: its size was not recorded" in capsys.readouterr().out
    assert hidden_size(DEMO_DIR) == SIZES["tiny"].hidden_size


def test_a_rewrite_keeps_the_architecture_the_demo_model_was_made_with(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_demo_model(DEMO_DIR, "tiny", arch="mixtral")
    assert demo_record(DEMO_DIR) == {"size": "tiny", "arch": "mixtral", "seed": 0}
    # As `make-demo-model --size small --arch mixtral` records it (writing one takes seconds).
    (DEMO_DIR / DEMO_RECORD).write_text(json.dumps({"size": "small", "arch": "mixtral", "seed": 0}))
    up("--demo-size", "tiny")
    assert "as tiny: it was made small" in capsys.readouterr().out
    assert json.loads((DEMO_DIR / "config.json").read_text())["model_type"] == "mixtral"
    assert demo_record(DEMO_DIR)["size"] == "tiny"


@pytest.mark.parametrize("given", ["my-model", ".edgefire/demo-model"])
def test_a_model_the_user_names_is_never_rewritten(tmp_path, monkeypatch, capsys, given):
    monkeypatch.chdir(tmp_path)
    make_demo_model(given, "tiny")
    before = {path.name: path.read_bytes() for path in Path(given).iterdir()}
    up("--model", given, "--demo-size", "small")
    assert capsys.readouterr().out == ""
    assert {path.name: path.read_bytes() for path in Path(given).iterdir()} == before


def test_demo_size_offers_every_size_without_importing_torch():
    assert build_parser().parse_args(["up", "--demo-size", "medium"]).demo_size == "medium"
    up_help = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    assert "{" + ",".join(SIZES) + "}" in up_help
    probe = "import sys, deploy.cli; deploy.cli.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
