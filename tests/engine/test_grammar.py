"""Grammar-constrained output in the engine, on the random-weight demo model (free output is noise).

The constrained output must parse and validate; it must be the same tokens after a resume from
generated ids, after a KV import on another engine and after preemption; max_tokens before the
JSON closes ends with `length`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer

from engine.engine import EngineConfig, LLMEngine
from engine.errors import InvalidRequestError
from engine.grammar import GrammarSpec, check_grammar, json_schema_spec
from engine.sampling import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
                         "score": {"type": "integer", "minimum": 0, "maximum": 5}}}


def make_engine(directory, **overrides) -> LLMEngine:
    config = dict(kv_cache_bytes=8 << 20, show_progress=False, block_size=8)
    return LLMEngine(directory, EngineConfig(**{**config, **overrides}))


def drain(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, str]]:
    tokens, reasons = {}, {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token.token_id)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return tokens, reasons


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def constrained(seed: int, max_tokens: int = 120, schema=SCHEMA) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, grammar=json_schema_spec(schema))


def test_constrained_rows_validate_beside_free_rows(engine, tokenizer):
    prompt = tokenizer.encode("Describe the weather as JSON").ids
    for seed in range(4):
        engine.add_request(f"json{seed}", prompt, constrained(seed))
    engine.add_request("free", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True))
    tokens, reasons = drain(engine)
    for seed in range(4):
        document = json.loads(tokenizer.decode(tokens[f"json{seed}"]))
        jsonschema.validate(document, SCHEMA)
        assert reasons[f"json{seed}"] == "stop"
    assert len(tokens["free"]) == 20


def test_constrained_output_survives_resume_import_and_preemption(tiny_model_dir, engine, tokenizer):
    prompt = tokenizer.encode("Give me a record").ids
    params = constrained(seed=7)
    full, _ = drain_one(engine, prompt, params)
    # Resume on a fresh engine with the first tokens already generated: the matcher is rebuilt from them.
    fresh = make_engine(tiny_model_dir)
    fresh.add_request("r", prompt, params, generated_ids=full[:6])
    assert full[:6] + drain(fresh)[0]["r"] == full
    # Prefill on one engine, KV import on another.
    engine.add_request("p", prompt, params, prefill_only=True)
    (first,) = engine.step()
    payload = engine.export_kv(first.kv_handle)
    engine.release_kv(first.kv_handle)
    fresh.import_kv("d", payload, params, [first.token.token_id])
    assert [first.token.token_id] + drain(fresh)[0]["d"] == full
    # A pool too small for four growing sequences at once preempts and recomputes.
    small = make_engine(tiny_model_dir, kv_cache_bytes=14 * 2 * 2 * 8 * 2 * 16 * 4)
    for i in range(4):
        small.add_request(f"s{i}", prompt, params)
    tokens, _ = drain(small)
    assert small.scheduler.num_preemptions > 0
    assert all(tokens[f"s{i}"] == full for i in range(4))


def drain_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    engine.add_request("one", prompt, params)
    tokens, reasons = drain(engine)
    return tokens["one"], reasons["one"]


def test_max_tokens_before_the_json_closes_is_length(engine, tokenizer):
    tokens, reason = drain_one(engine, tokenizer.encode("x").ids, constrained(seed=3, max_tokens=4))
    assert reason == "length" and len(tokens) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(tokens))


def test_bad_grammars_are_refused_with_the_problem_named(engine):
    assert "frob" in check_grammar(json_schema_spec({"type": "frob"}))
    assert check_grammar(GrammarSpec("json_schema", "[1, 2")) is not None
    assert check_grammar(json_schema_spec(SCHEMA)) is None
    with pytest.raises(InvalidRequestError, match="frob"):
        engine.add_request("bad", [1, 2, 3], constrained(0, schema={"type": "frob"}))
    with pytest.raises(InvalidRequestError, match="do not follow"):
        engine.add_request("bad", [1, 2, 3], constrained(0), generated_ids=[2, 2, 2])
    assert not engine.has_work()


def test_unsupported_keywords_are_named_with_where_they_are_in_the_schema():
    """A big schema (pydantic's, a tool's) with one keyword the library cannot enforce: the refusal says
    which keyword and where, and never asks for a library option a client has no way to set."""
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    schema = {"type": "object", "$defs": {"Item": {"type": "object", "properties": {"not": {"type": "integer"},
                                                                                    "tags/all": tags}}},
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}}}
    problem = check_grammar(json_schema_spec(schema))
    assert "uniqueItems" in problem and "/$defs/Item/properties/tags~1all" in problem
    colour = {"type": "object",
              "properties": {"a": {"anyOf": [{"type": "null"}, {"type": "string", "format": "colour"}]}}}
    assert "/properties/a/anyOf/1" in check_grammar(json_schema_spec(colour))
    overlapping = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    problem = check_grammar(json_schema_spec(overlapping))
    assert "anyOf" in problem and "/properties/n" in problem and "coerce_one_of" not in problem
    deep = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    assert "too deeply" in check_grammar(json_schema_spec(deep))
