"""Draft checkpoints an operator may point speculation at: one with a shorter context than the model's
decodes on past it, one with another tokenizer is refused at start."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.speculative_config import SpeculativeConfig
from tests.engine.test_speculative import assert_no_leak, greedy, make_engine, random_ids, run

DRAFT_CONTEXT = 40


@pytest.fixture(scope="module")
def short_context_draft(llama_checkpoint, tmp_path_factory):
    """The model itself as its draft (every greedy proposal is kept), but with a 40-token context."""
    directory = tmp_path_factory.mktemp("short-context-draft")
    shutil.copytree(llama_checkpoint[0], directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = DRAFT_CONTEXT
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_sequences_outgrowing_the_drafts_context_decode_on_without_proposals(llama_checkpoint, short_context_draft):
    ckpt = llama_checkpoint[0]
    requests = {
        "crosses": (random_ids(30, 11), greedy(30)),                # proposes until the draft's 40th position
        "longer": (random_ids(DRAFT_CONTEXT + 5, 12), greedy(12)),  # a prompt the draft cannot even read
        "inside": (random_ids(10, 13), greedy(20)),
    }
    plain = run(make_engine(ckpt), requests)
    engine = make_engine(ckpt, SpeculativeConfig("draft", 4, draft_model=str(short_context_draft)))
    assert run(engine, requests, check_blocks=True) == plain
    assert engine.stats().num_accepted_draft_tokens > 0
    assert_no_leak(engine)


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(tiny_model_dir, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100], list(vocab)[200]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer than the model") as failure:
        make_engine(tiny_model_dir, SpeculativeConfig("draft", 3, draft_model=str(draft)))
    assert repr(first) in str(failure.value) or repr(second) in str(failure.value)


def _padded(source, directory, extra: int):
    """`source` with its vocabulary padded by `extra` ids (zero rows in the embedding and output layer), as a
    family's larger model often pads its embedding further than its smaller one on the same tokenizer."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] += extra
    (directory / "config.json").write_text(json.dumps(config))
    for path in directory.glob("*.safetensors"):
        tensors = load_file(path)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = torch.cat([tensors[name], tensors[name].new_zeros(extra, tensors[name].shape[1])])
        save_file(tensors, path, metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("padded", ["draft", "model"])
def test_a_draft_padded_otherwise_on_the_same_tokenizer_drafts(tiny_model_dir, tmp_path, padded):
    """Drafts of a family pad their vocabulary otherwise than the model (a Qwen2.5 0.5B has 151,936 ids, its 7B
    152,064, on one tokenizer): the draft's logits are cut or padded to the model's ids, its padding never
    proposed; the tokens are the plain engine's and the proposals are kept."""
    grown = _padded(tiny_model_dir, tmp_path / "padded", 64)
    model, draft = (tiny_model_dir, grown) if padded == "draft" else (grown, tiny_model_dir)
    requests = {f"r{i}": (random_ids(12 + i, 40 + i, vocab=500), greedy(16)) for i in range(3)}
    plain = run(make_engine(model), requests)
    engine = make_engine(model, SpeculativeConfig("draft", 3, draft_model=str(draft)))
    assert run(engine, requests, check_blocks=True) == plain
    stats = engine.stats()
    assert stats.num_accepted_draft_tokens > 0.8 * stats.num_draft_tokens  # the model as its own draft
    assert_no_leak(engine)


def test_a_draft_too_small_for_the_tokenizer_is_refused(tiny_model_dir, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_model_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] = 200  # the demo tokenizer's ids reach past it
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a draft model must hold every id of the model's tokenizer"):
        make_engine(tiny_model_dir, SpeculativeConfig("draft", 3, draft_model=str(draft)))
