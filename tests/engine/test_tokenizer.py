"""Tokenizer and chat template of the demo checkpoint, and incremental detokenization."""

from __future__ import annotations

import json
import re
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


def test_incremental_detokenizer_flush_ends_the_stream_as_a_full_decode(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    ids = tok.encode("ok 日本", add_special_tokens=False)[:-1]   # the last character cut mid-way
    expected = AutoTokenizer.from_pretrained(str(tiny_model_dir)).decode(ids, skip_special_tokens=True)
    assert expected == "ok 日\ufffd"
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed + detok.flush() == expected
    assert detok.flush() == ""


def test_generate_command_prints_the_full_decode_when_the_last_character_is_cut(tiny_model_dir, capsys):
    from deploy.cli import main
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling import SamplingParams

    tok = ChatTokenizer.from_dir(tiny_model_dir)
    prompt = "The edge network"
    engine = LLMEngine(tiny_model_dir, EngineConfig(show_progress=False))
    engine.add_request("r", tok.encode(prompt), SamplingParams(max_tokens=12, temperature=0))
    ids = []
    while engine.has_work():
        ids += [out.token.token_id for out in engine.step() if out.token is not None]
    engine.shutdown()
    # the first length whose text ends inside a character (this random model emits stray byte tokens)
    cut = next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("\ufffd"))
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", prompt, "--max-tokens", str(cut)]) == 0
    assert capsys.readouterr().out == tok.decode(ids[:cut])


def _tokenizer_copy(tiny_model_dir, tmp_path, **changes):
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return directory


def test_a_special_token_the_chat_template_renders_must_be_a_token(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from engine.engine import EngineConfig, LLMEngine

    # A Mistral-style template closes each assistant turn with {{ eos_token }}.
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    directory = _tokenizer_copy(tiny_model_dir, tmp_path, eos_token="<|not_a_token|>", chat_template=template)
    # transformers appends the text to the vocabulary: an id past the model's 512 embedding rows
    assert AutoTokenizer.from_pretrained(str(directory)).convert_tokens_to_ids("<|not_a_token|>") == 512
    message = re.escape(f"{directory / 'tokenizer_config.json'}: eos_token '<|not_a_token|>' is not a token of "
                        f"tokenizer.json, and the chat template renders it")
    with pytest.raises(CheckpointError, match=message):
        ChatTokenizer.from_dir(directory)
    with pytest.raises(CheckpointError, match=message):   # refused at load, not on every chat request
        LLMEngine(directory, EngineConfig(show_progress=False))


def test_a_special_token_no_template_renders_is_left_alone(tiny_model_dir, tmp_path):
    # The demo template renders bos_token only; the engine stops on generation_config's eos_token_id.
    directory = _tokenizer_copy(tiny_model_dir, tmp_path, eos_token="<|not_a_token|>")
    tok = ChatTokenizer.from_dir(directory)
    assert tok.eos_token == "<|not_a_token|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|begin_of_text|>")


@pytest.mark.parametrize("changes, message", [
    ({"chat_template": 5}, "chat_template must be a template (a string) or a list of named templates, got 5"),
    ({"chat_template": ["{{ messages }}"]},
     'chat_template[0] must be an object with a string "name" and a string "template", got \'{{ messages }}\''),
    ({"chat_template": [{"name": "default", "template": "x"}, {"name": "tool_use"}]},
     'chat_template[1] must be an object with a string "name" and a string "template", got {\'name\': \'tool_use\'}'),
    ({"eos_token": 7}, 'eos_token must be the token\'s text or an object with its "content", got 7'),
    ({"bos_token": {"id": 1}}, 'bos_token must be the token\'s text or an object with its "content", got {\'id\': 1}'),
])
def test_malformed_tokenizer_config_values_name_the_file_and_key(tiny_model_dir, tmp_path, changes, message):
    directory = _tokenizer_copy(tiny_model_dir, tmp_path, **changes)
    with pytest.raises(CheckpointError, match=re.escape(f"{directory / 'tokenizer_config.json'}: {message}")):
        ChatTokenizer.from_dir(directory)
