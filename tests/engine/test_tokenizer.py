"""Tokenizer and chat template of the demo checkpoint, and incremental detokenization."""

from __future__ import annotations

import shutil

import pytest

from engine.errors import CheckpointError
from engine.tokenizer import ChatTokenizer, IncrementalDetokenizer, TemplateError


def test_chat_template_renders_and_round_trips(tiny_model_dir):
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    text = tok.apply_chat_template(messages)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.encode_chat(messages)
    assert ids.count(tok.token_to_id("<|begin_of_text|>")) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_incremental_detokenizer_equals_full_decode(tiny_model_dir):
    tok = ChatTokenizer.from_dir(tiny_model_dir)
    text = "Snow in Oslo — 3°C, naïve café ☃ and 東京 weather."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_template_errors_are_request_errors():
    tok = ChatTokenizer('{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}', {
        "chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"})
    with pytest.raises(TemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTokenizer('{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}', {}).apply_chat_template([])


@pytest.mark.parametrize("file_name", ["tokenizer.json", "chat_template.jinja"])
def test_tokenizer_files_that_are_not_utf8_name_the_file(tiny_model_dir, tmp_path, file_name):
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    (directory / file_name).write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=f"{file_name}: not UTF-8 text"):
        ChatTokenizer.from_dir(directory)
