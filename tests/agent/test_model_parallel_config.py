"""Each model of an agent may have its own parallel sizes (`[model_parallel] name = "tp=1 ep=2"`): an
agent hosting a dense model and a mixture of experts could split neither's experts, since the one
agent-wide expert_parallel_size was refused for the dense model."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser
from node_agent import cli
from node_agent.config import ConfigError, load_config
from node_agent.models import engine_config


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    """A tiny Mixtral: 4 attention heads, 2 KV heads, 2 layers, 4 experts."""
    from engine.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("tiny-moe"), size="tiny", arch="mixtral")


def two_model_toml(dense_dir, moe_dir, settings: str = "", model_parallel: str = "") -> str:
    return f'''site = "fra-1"
peer_token = "s3cret"
{settings}
[models]
dense = "{dense_dir}"
moe = "{moe_dir}"
[model_parallel]
{model_parallel}
'''


def load(tmp_path, text: str, environ: dict | None = None, overrides: dict | None = None):
    path = tmp_path / "site.toml"
    path.write_text(text)
    return load_config(path, overrides, environ={} if environ is None else environ)


def sizes(config, model: str) -> tuple[int, int, int]:
    engine = engine_config(config, model)
    return engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.expert_parallel_size


def test_a_dense_model_and_a_mixture_of_experts_split_their_own_ways(tmp_path, tiny_model_dir, moe_model_dir):
    # one agent-wide size for both: the dense model refuses expert parallelism
    with pytest.raises(ConfigError, match="models.dense: expert_parallel_size 2 needs a mixture-of-experts model"):
        load(tmp_path, two_model_toml(tiny_model_dir, moe_model_dir, "expert_parallel_size = 2"))

    config = load(tmp_path, two_model_toml(tiny_model_dir, moe_model_dir, model_parallel='moe = "ep=2"'))
    assert sizes(config, "moe") == (1, 1, 2)
    assert sizes(config, "dense") == (1, 1, 1)


def test_sizes_a_model_leaves_out_are_the_agent_wide_ones(tmp_path, tiny_model_dir, moe_model_dir):
    config = load(tmp_path, two_model_toml(tiny_model_dir, moe_model_dir, "pipeline_parallel_size = 2",
                                           'moe = "ep=2"'))
    assert sizes(config, "moe") == (1, 2, 2)
    assert sizes(config, "dense") == (1, 2, 1)
    config = load(tmp_path, two_model_toml(tiny_model_dir, moe_model_dir, "tensor_parallel_size = 2",
                                           'moe = "tp=2 ep=2"'))
    assert (sizes(config, "moe"), sizes(config, "dense")) == ((2, 1, 2), (2, 1, 1))


def test_the_environment_and_a_flag_give_a_models_sizes_too(tmp_path, tiny_model_dir, moe_model_dir):
    text = two_model_toml(tiny_model_dir, moe_model_dir)
    config = load(tmp_path, text, environ={"EDGEFIRE_AGENT_MODEL_PARALLEL": "moe=tp=1 ep=2"})
    assert sizes(config, "moe") == (1, 1, 2)
    (tmp_path / "flags.toml").write_text(text)
    args = build_parser().parse_args(["agent", "--config", str(tmp_path / "flags.toml"), "--model-parallel",
                                      "moe=ep=2,dense=pp=2"])
    config = load_config(args.config, cli.overrides_from_args(args), environ={})
    assert (sizes(config, "moe"), sizes(config, "dense")) == ((1, 1, 2), (1, 2, 1))


@pytest.mark.parametrize("model_parallel, message", [
    ('moe = "ep=3"', "model_parallel.moe: expert_parallel_size 3 does not divide the model's 4 experts"),
    ('moe = "tp=4 ep=2"', "model_parallel.moe: expert_parallel_size 2 with tensor_parallel_size 4"),
    ('dense = "ep=2"', "model_parallel.dense: expert_parallel_size 2 needs a mixture-of-experts model"),
    ('dense = "pp=3"', "model_parallel.dense: pipeline_parallel_size 3 exceeds the model's 2 layers"),
    ('llama = "tp=2"', "model_parallel.llama: no such model in models \\(models: dense, moe\\)"),
    ('moe = "ep=x"', "model_parallel.moe: ep \\(expert_parallel_size\\) must be an integer >= 1, got 'x'"),
    ('moe = "ep=0"', "model_parallel.moe: ep \\(expert_parallel_size\\) must be an integer >= 1, got '0'"),
    ('moe = "ep=2 ep=4"', "model_parallel.moe: ep is given twice in 'ep=2 ep=4'"),
    ('moe = "experts=2"', 'model_parallel.moe: expected sizes such as "tp=1 ep=4" \\(tp, pp and ep'),
    ('moe = "ep2"', 'model_parallel.moe: expected sizes such as "tp=1 ep=4"'),
    ('moe = ""', 'model_parallel.moe: expected sizes such as "tp=1 ep=4"'),
    ("moe = 2", "model_parallel.moe: must be str, got int 2"),
])
def test_sizes_that_cannot_be_used_are_one_line_errors_at_load(tmp_path, tiny_model_dir, moe_model_dir,
                                                              model_parallel, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load(tmp_path, two_model_toml(tiny_model_dir, moe_model_dir, model_parallel=model_parallel))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("speculation, model_parallel, message", [
    ('speculative_method = "ngram"', 'moe = "pp=2"',
     "speculative_method: speculative decoding does not run with pipeline_parallel_size > 1 "
     "\\(model_parallel.moe: tp=1 pp=2\\)"),
    ('speculative_method = "draft"\nspeculative_draft_model = "DENSE"', 'moe = "ep=2"',
     "speculative_method: a draft model runs in one process, not with tp=1 pp=1 ep=2 \\(model_parallel.moe\\)"),
])
def test_speculation_is_checked_against_each_models_sizes(tmp_path, tiny_model_dir, moe_model_dir, speculation,
                                                          model_parallel, message):
    text = two_model_toml(tiny_model_dir, moe_model_dir, speculation.replace("DENSE", str(moe_model_dir)),
                          model_parallel)
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_the_agent_command_refuses_a_models_bad_sizes_with_exit_2(tmp_path, tiny_model_dir, moe_model_dir, caplog):
    (tmp_path / "site.toml").write_text(two_model_toml(tiny_model_dir, moe_model_dir, model_parallel='moe = "ep=3"'))
    args = build_parser().parse_args(["agent", "--config", str(tmp_path / "site.toml"), "--metrics-listen", "none",
                                      "--grpc-listen", "127.0.0.1:0", "--device", "cpu"])
    assert cli.run(args) == 2
    assert "model_parallel.moe: expert_parallel_size 3 does not divide the model's 4 experts" in caplog.text


@pytest.mark.parallel
async def test_an_agent_serves_a_dense_model_on_one_rank_and_its_mixture_of_experts_on_two(
        tiny_model_dir, moe_model_dir, connect):
    """Run with `-m parallel` (the MoE's second rank is a worker process)."""
    from node_agent.daemon import Agent
    from node_agent.proto import agent_pb2
    from tests.agent.conftest import agent_config, collect, prompt, sampling

    models = {"dense": str(tiny_model_dir), "moe": str(moe_model_dir)}
    split = Agent(agent_config(tiny_model_dir, "split", models=models, model_parallel={"moe": "ep=2"}))
    single = Agent(agent_config(tiny_model_dir, "single", models=models))
    try:
        await split.start()
        await single.start()
        assert split.models["moe"].engine.engine.layout.world_size == 2
        assert split.models["dense"].engine.engine.layout.world_size == 1
        report = await split.capacity()
        assert (report.tensor_parallel_size, report.expert_parallel_size) == (1, 2)
        for model in models:
            request = agent_pb2.GenerateRequest(model=model, prompt_ids=prompt(24), sampling=sampling(max_tokens=8))
            assert await collect(connect(split).generate(request)) == await collect(connect(single).generate(request))
    finally:
        await split.stop()
        await single.stop()
