"""An agent with a draft model checks it once per start: its config check (a bad draft is a one-line
configuration error) and the engine starting the draft parsed both tokenizer.json files twice."""

from __future__ import annotations

import json
import shutil

import pytest

import engine.tokenizer
from node_agent.errors import ModelLoadError
from node_agent.models import load_model
from tests.agent.conftest import MODEL, agent_config


@pytest.fixture
def draft_dir(tiny_model_dir, tmp_path):
    """The model's own copy as its draft, in a directory of its own."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, draft)
    return draft


@pytest.fixture
def draft_parses(draft_dir, monkeypatch) -> list:
    """Every parse of the draft's tokenizer.json, as it happens."""
    parses = []
    read_tokenizer = engine.tokenizer.read_tokenizer

    def counted(path):
        if path.resolve() == (draft_dir / "tokenizer.json").resolve():
            parses.append(path)
        return read_tokenizer(path)

    monkeypatch.setattr(engine.tokenizer, "read_tokenizer", counted)
    return parses


async def test_an_agent_start_parses_the_drafts_tokenizer_once(tiny_model_dir, draft_dir, draft_parses):
    config = agent_config(tiny_model_dir, speculative_method="draft", speculative_draft_model=str(draft_dir))
    assert len(draft_parses) == 1   # the config check, at load
    hosted = await load_model(MODEL, str(tiny_model_dir), config)
    try:
        assert hosted.engine.engine.speculator is not None
        assert len(draft_parses) == 1
    finally:
        hosted.engine.shutdown()


async def test_a_draft_changed_after_the_config_check_is_checked_again(tiny_model_dir, draft_dir, draft_parses):
    config = agent_config(tiny_model_dir, speculative_method="draft", speculative_draft_model=str(draft_dir))
    tokenizer = json.loads((draft_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100], list(vocab)[200]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match="has another tokenizer than the model"):
        await load_model(MODEL, str(tiny_model_dir), config)
    assert len(draft_parses) == 2
