"""An agent refuses parallel sizes its models cannot be split by at start, as a configuration error
naming the model and the setting (exit status 2), not as a traceback out of the model load."""

from __future__ import annotations

import logging

import pytest

from deploy.cli import build_parser
from node_agent import cli
from node_agent.config import ConfigError, load_config
from node_agent.models import engine_config
from tests.agent.test_config import site_toml, write


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """A tiny Mixtral: 4 attention heads, 2 KV heads, 2 layers, 4 experts."""
    from engine.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tiny-moe"), size="tiny", arch="mixtral")


def test_agent_command_refuses_sizes_the_model_cannot_take(tmp_path, tiny_model_dir, caplog):
    path = write(tmp_path, site_toml(tiny_model_dir, "tensor_parallel_size = 3"))
    args = build_parser().parse_args(["agent", "--config", str(path), "--metrics-listen", "none",
                                      "--grpc-listen", "127.0.0.1:0", "--device", "cpu"])
    with caplog.at_level(logging.ERROR, logger="node_agent.cli"):
        assert cli.run(args) == 2
    assert "models.tiny: tensor_parallel_size 3 does not divide the model's 4 attention heads" in caplog.text


@pytest.mark.parametrize("settings, message", [
    ("pipeline_parallel_size = 3", "models.tiny: pipeline_parallel_size 3 exceeds the model's 2 layers"),
    ("expert_parallel_size = 2", "models.tiny: expert_parallel_size 2 needs a mixture-of-experts model"),
    ("tensor_parallel_size = 8", "models.tiny: tensor_parallel_size 8 does not divide the model's 4 attention heads"),
])
def test_sizes_a_dense_model_cannot_take_are_refused(tmp_path, tiny_model_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, site_toml(tiny_model_dir, settings)), environ={})


@pytest.mark.parametrize("settings, message", [
    ("expert_parallel_size = 3", "models.tiny: expert_parallel_size 3 does not divide the model's 4 experts"),
    ("tensor_parallel_size = 2", "models.tiny: tensor_parallel_size 2 alone does not split"),
    ("tensor_parallel_size = 4\nexpert_parallel_size = 2", "expert_parallel_size 2 with tensor_parallel_size 4"),
])
def test_sizes_a_mixture_of_experts_cannot_take_are_refused(tmp_path, moe_model_dir, settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, site_toml(moe_model_dir, settings)), environ={})


def test_expert_parallel_sizes_a_mixture_of_experts_takes_reach_the_engine(tmp_path, moe_model_dir):
    for settings, sizes in (("expert_parallel_size = 2\npipeline_parallel_size = 2", (1, 2, 2)),
                            ("tensor_parallel_size = 2\nexpert_parallel_size = 2", (2, 1, 2))):
        config = engine_config(load_config(write(tmp_path, site_toml(moe_model_dir, settings)), environ={}))
        assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.expert_parallel_size) == sizes


def test_a_draft_model_with_several_ranks_is_refused(tmp_path, tiny_model_dir):
    extra = f'tensor_parallel_size = 2\nspeculative_method = "draft"\nspeculative_draft_model = "{tiny_model_dir}"'
    with pytest.raises(ConfigError, match="speculative_method: a draft model runs in one process"):
        load_config(write(tmp_path, site_toml(tiny_model_dir, extra)), environ={})
