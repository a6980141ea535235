"""GLM-4.5 / GLM-4.6 tool calls (format `glm45`) at their edges: a strict call's grammar lets no extra key restate a
property (the parser reads a key without its blanks), and an answer that ends after a call's last pair, or after
its name, without `</tool_call>` (an end of sequence, not max_tokens) gives the client arguments that are a JSON
object, whole and streamed alike, as a JSON format's call whose object closed does."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.grammar import GrammarCompiler
from router.tool_calls import FORMATS, ToolCallStream
from tests.engine.chat_checkpoints import TEMPLATES

COUNT = {"type": "function", "function": {"name": "count", "strict": True, "parameters": {
    "type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
NAMES = frozenset({"count", "now"})


def _accepts(tokenizer, spec, text: str) -> bool:
    template = "zai-org-GLM-4.6"
    compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                               [tokenizer.token_to_id(TEMPLATES[template][1])])
    matcher = compiler.matcher(spec)
    return (all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False))
            and matcher.matcher.is_accepting())


def test_an_extra_key_cannot_restate_a_property_with_blanks_around_it(template_tokenizer):
    # `additionalProperties` is open, so more pairs may follow `n`; one keyed ` n` would read back as `n` again,
    # and its value (any text) would replace the integer the schema promised.
    tokenizer = template_tokenizer("zai-org-GLM-4.6")
    spec = FORMATS["glm45"].grammar([COUNT], True, tokenizer)
    call = "<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n{}</tool_call>"
    extra = "<arg_key>{}</arg_key>\n<arg_value>three</arg_value>\n"
    assert _accepts(tokenizer, spec, call.format(extra.format("note")))  # other keys stay allowed
    for key in (" n", "n ", "\tn"):
        text = call.format(extra.format(key))
        assert not _accepts(tokenizer, spec, text), repr(key)
        _content, (read,) = FORMATS["glm45"].with_tools([COUNT]).split(text, NAMES)
        with pytest.raises(jsonschema.ValidationError):  # what the client would get had the grammar let it through
            jsonschema.validate(json.loads(read.arguments), COUNT["function"]["parameters"])


@pytest.mark.parametrize("text, arguments", [
    ("<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n", {"n": 3}),
    ("<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>", {"n": 3}),
    ("<tool_call>now\n", {}),
    ("<tool_call>now", {}),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_an_answer_that_ends_after_a_call_s_last_pair_gives_json_arguments(text, arguments, step):
    fmt = FORMATS["glm45"].with_tools([COUNT, NOW])
    text = "Counting.\n" + text
    content, (whole,) = fmt.split(text, NAMES)
    assert content == "Counting.\n" and json.loads(whole.arguments) == arguments
    stream, sent, deltas = ToolCallStream(fmt, names=NAMES), "", []
    for end in range(step, len(text) + step, step):
        sent += stream.add(text[end - step:end])
        deltas += stream.take_deltas()
    tail, (streamed,) = stream.finish()   # an end of sequence: not cut
    deltas += stream.take_deltas()
    joined = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert sent + tail == "Counting.\n"
    assert joined == streamed.arguments == whole.arguments and json.loads(joined) == arguments
