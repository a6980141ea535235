"""Each `edgefire up` cluster has its own demo model: a second cluster in another state dir, with
another --demo-size, rewrote `.edgefire/demo-model` under the first cluster's running agents."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.cli import build_parser
from deploy.cluster import config_from_args, ensure_model
from deploy.cluster_config import load_cluster_toml
from engine.demo import DEMO_RECORD, SIZES, demo_record, make_demo_model

DEFAULT_DEMO_DIR = Path(".edgefire/demo-model")


def up(*argv: str):
    args = build_parser().parse_args(["up", *argv])
    config = config_from_args(args)
    ensure_model(config, args.demo_size)
    return config


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_a_cluster_in_another_state_dir_leaves_the_running_clusters_demo_model_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_demo_model(DEFAULT_DEMO_DIR, "tiny")
    # The default cluster (`make run`) serves a small demo model; recording the size stands in for writing one.
    (DEFAULT_DEMO_DIR / DEMO_RECORD).write_text(json.dumps({"size": "small", "arch": "llama", "seed": 0}))
    serving = files(DEFAULT_DEMO_DIR)

    second = up("--state-dir", "second", "--demo-size", "tiny")

    assert files(DEFAULT_DEMO_DIR) == serving
    assert second.model_dir == Path("second/demo-model")
    assert "writing a random-weight tiny demo model to second/demo-model" in capsys.readouterr().out
    assert demo_record(second.model_dir)["size"] == "tiny"
    assert second.model_name == "demo-model"   # what clients send, wherever the weights live


def test_two_clusters_in_their_own_state_dirs_keep_their_own_sizes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    first = up("--state-dir", str(tmp_path / "first"), "--demo-size", "tiny")
    made = files(first.model_dir)
    (tmp_path / "cluster.toml").write_text(f'state_dir = "{tmp_path / "second"}"\n'
                                           '[[sites]]\nname = "lisbon"\nregion = "eu-west"\ncountry = "PT"\n'
                                           'lat = 38.7\nlon = -9.1\n')
    second = load_cluster_toml(tmp_path / "cluster.toml")
    assert second.model_dir == tmp_path / "second" / "demo-model" and second.demo_model
    second_small = up("--config", str(tmp_path / "cluster.toml"), "--demo-size", "small")

    assert json.loads((second_small.model_dir / "config.json").read_text())["hidden_size"] == SIZES["small"].hidden_size
    assert files(first.model_dir) == made
    assert not DEFAULT_DEMO_DIR.exists()
    up("--state-dir", str(tmp_path / "first"), "--demo-size", "tiny")   # its own size: used as it is
    assert "rewriting" not in capsys.readouterr().out


def test_the_default_cluster_keeps_the_demo_model_make_run_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_demo_model(DEFAULT_DEMO_DIR, "tiny")
    made = files(DEFAULT_DEMO_DIR)
    for argv in ((), ("--state-dir", ".edgefire/cluster"), ("--state-dir", str(tmp_path / ".edgefire/cluster"))):
        config = up(*argv, "--demo-size", "tiny")
        assert config.model_dir == DEFAULT_DEMO_DIR
    assert capsys.readouterr().out == ""
    assert files(DEFAULT_DEMO_DIR) == made
