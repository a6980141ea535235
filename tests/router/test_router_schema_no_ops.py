"""JSON schemas as client generators write them, through the official `openai` client and a real engine:
keyword values that constrain nothing (`uniqueItems: false`, `unevaluatedProperties: true`...) and
annotations (`title`, `examples`, `deprecated`, `readOnly`, `$comment`, `default`, OpenAPI's and
pydantic's type formats such as `int32` and `binary`) are accepted in `response_format` and in tool
parameters, and the output still follows every constraint; keywords that do constrain and cannot be
enforced (`uniqueItems: true`, an unknown format) stay a 400 that names them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_router_structured import DEMO, MODEL, QUESTION, model_dir, served, served_demo  # noqa: F401 (fixtures)

from engine.grammar import GrammarSpec, check_grammar, json_schema_spec, lark_json

GENERATED = {
    "type": "object", "title": "Order", "description": "An order", "$comment": "generated",
    "additionalProperties": False, "unevaluatedProperties": True, "propertyNames": {}, "dependentRequired": {},
    "required": ["ids", "blob", "count"],
    "properties": {
        "ids": {"type": "array", "uniqueItems": False, "maxItems": 3, "deprecated": True, "examples": [[1, 2]],
                "items": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 9}},
        "blob": {"type": "string", "format": "binary", "readOnly": True, "writeOnly": False, "default": "x",
                 "maxLength": 4},
        "secret": {"anyOf": [{"type": "string", "format": "password", "maxLength": 3}, {"type": "null"}]},
        "count": {"type": "integer", "format": "int64", "minimum": 1, "maximum": 5, "example": 2},
        # data, not schemas: a property named after a keyword, and a const holding one, stay as they are
        "uniqueItems": {"const": {"uniqueItems": False}},
    },
    "$defs": {"Unused": {"type": "array", "uniqueItems": False}},
}
REFUSED = [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
           ({"type": "string", "format": "colour"}, "colour")]


def test_no_op_keywords_compile_as_a_schema_and_inside_a_tool_call_grammar():
    assert check_grammar(json_schema_spec(GENERATED)) is None
    assert check_grammar(GrammarSpec("lark", f"start: {lark_json(GENERATED)}")) is None
    for schema, keyword in REFUSED:
        assert keyword in check_grammar(json_schema_spec(schema))
        assert keyword in check_grammar(GrammarSpec("lark", f"start: {lark_json(schema)}"))


async def test_generated_schemas_are_followed_through_response_format(served_demo):
    client, _engine = served_demo
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": GENERATED, "strict": True}}
    for seed in range(4):
        completion = await client.chat.completions.create(model=DEMO, messages=QUESTION, seed=seed, max_tokens=120,
                                                          temperature=1.0, response_format=fmt)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), GENERATED)
    for schema, keyword in REFUSED:
        with pytest.raises(openai.BadRequestError, match=keyword):
            await client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "refused", "schema": schema}})


async def test_generated_schemas_are_followed_as_tool_parameters(served):
    client, _engine = served
    tool = {"type": "function", "function": {"name": "order", "parameters": GENERATED}}
    for seed in range(3):
        completion = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[tool], seed=seed,
                                                          tool_choice="required", parallel_tool_calls=False,
                                                          max_tokens=120)
        call, = completion.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), GENERATED)
    refused = {"type": "function", "function": {"name": "order", "parameters": REFUSED[0][0]}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[refused], tool_choice="required",
                                             max_tokens=5)
