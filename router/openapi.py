"""The OpenAPI description of the completion (and Responses) request bodies, for clients and schema-driven fuzzers.

The bodies are parsed by hand (`router.openai_request`), so FastAPI cannot derive their schema; this
module states it from the same limits. The parser stays the authority: a body this schema allows
is accepted, and one it refuses gets a 400 naming the field. Fields not listed are refused with a 400
(`additionalProperties: false`): a parameter the router does not implement is never silently dropped;
the few accepted without effect (`metadata`, `store: false`, ...) are listed with what they take.
"""

from __future__ import annotations

from router.openai_request import (MAX_CHOICES, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS_COMPLETIONS,
                                   MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_SEED, MAX_STOP_STRINGS, MIN_SEED,
                                   MAX_TOP_LOGPROBS_CHAT, MAX_UINT32, REASONING_EFFORTS, ROLES, SERVICE_TIERS,
                                   TOOL_CHOICES)


def _nullable(schema: dict) -> dict:
    """An optional parameter: null means "not given", as OpenAI clients send it."""
    return {"anyOf": [schema, {"type": "null"}]}


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_CALL = {"type": "object", "required": ["function"],
              "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                             "function": {"type": "object", "required": ["name"],
                                          "properties": {"name": {"type": "string"},
                                                         "arguments": {"type": ["string", "object"]}}}}}
_MESSAGE = {"type": "object", "required": ["role"],
            "properties": {"role": {"enum": list(ROLES)},
                           "content": _nullable({"anyOf": [{"type": "string"},
                                                           {"type": "array", "items": _TEXT_PART}]}),
                           "name": {"type": "string"},
                           "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL}),
                           "tool_call_id": {"type": "string"}},
            # Only an assistant turn may leave out its text (a turn of tool calls alone).
            "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}}
_TOOL = {"type": "object", "required": ["function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$",
                                                             "description": "each tool's own"},
                                                    "description": {"type": "string"},
                                                    "parameters": {"type": "object"}}}}}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = _nullable({"anyOf": [{"type": "string"},
                             {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}]})

_SAMPLING = {
    "model": {"type": "string", "minLength": 1, "description": "a model from GET /v1/models"},
    "max_tokens": _nullable({"type": "integer", "minimum": 1,
                             "description": "at most the model's context less the prompt; unset: up to the context"}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_UINT32, "description": "0 or -1: off"}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY}),
    "seed": _nullable({"type": "integer", "minimum": MIN_SEED, "maximum": MAX_SEED}),
    "stop": _STOP,
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                    "description": "completions of the prompt; the later ones read it from the prefix cache"}),
    "presence_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
    "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                             "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                             "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                      "maximum": MAX_LOGIT_BIAS},
                             "description": "token id -> bias added to its logit (ids within the vocabulary)"}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                                 "description": "only with stream: true"}),
    "user": _nullable({"type": "string", "description": "names the session (prefix-cache affinity)"}),
    "prompt_cache_key": _nullable({"type": "string", "description": "names the session, as `user` does"}),
    "speculative": _nullable({"type": "boolean", "description": "false: no speculative decoding for this request "
                                                                "(see the README: what speculation guarantees)"}),
    # Accepted without effect (router.openai_request.ACCEPTED_WITHOUT_EFFECT):
    "metadata": _nullable({"type": "object", "description": "accepted; nothing is stored"}),
    "store": _nullable({"const": False, "description": "false only; nothing is stored"}),
    "service_tier": _nullable({"enum": list(SERVICE_TIERS),
                               "description": "accepted; every request is served at the one tier there is, and the "
                                              "answer says \"default\""}),
    "modalities": _nullable({"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}),
    "safety_identifier": _nullable({"type": "string", "description": "accepted; no moderation runs here"}),
}

_RESPONSE_FORMAT = _nullable({"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"],
     "properties": {"type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "required": ["name"],
                                    "properties": {"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                                   "description": {"type": "string"},
                                                   "schema": {"type": "object"},
                                                   "strict": _nullable({"type": "boolean"})}}}}]})
_TOOL_CHOICE = _nullable({"anyOf": [
    {"enum": list(TOOL_CHOICES)},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "object", "required": ["type", "allowed_tools"],
     "properties": {"type": {"const": "allowed_tools"},
                    "allowed_tools": {"type": "object", "required": ["mode", "tools"],
                                      "properties": {"mode": {"enum": ["auto", "required"]},
                                                     "tools": {"type": "array", "minItems": 1, "items": {
                                                         "type": "object", "required": ["type", "function"],
                                                         "properties": {"type": {"const": "function"},
                                                                        "function": {"type": "object",
                                                                                     "required": ["name"],
                                                                                     "properties": {"name": {
                                                                                         "type": "string"}}}}}}}}}}],
    "description": "needs `tools`; a named function (or each allowed tool) must be one of them"})

CHAT_COMPLETION_REQUEST = {
    "title": "ChatCompletionRequest", "type": "object", "required": ["model", "messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS_CHAT,
                                   "description": "only with logprobs: true"}),
        "tools": _nullable({"type": "array", "items": _TOOL}),
        "documents": _nullable({"type": "array", "items": {"type": "object"}}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "extra chat template variables"}),
        "reasoning_effort": _nullable({"enum": list(REASONING_EFFORTS)}),
        "response_format": _RESPONSE_FORMAT,
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "prediction": _nullable({
            "type": "object", "required": ["type", "content"],
            "properties": {"type": {"const": "content"},
                           "content": {"anyOf": [{"type": "string"},
                                                 {"type": "array", "minItems": 1, "items": {
                                                     "type": "object", "required": ["type", "text"],
                                                     "properties": {"type": {"const": "text"},
                                                                    "text": {"type": "string"}}}}]}},
            "description": "predicted output: its tokens are proposed for speculative decoding and verified, so "
                           "the answer is the one without it; usage.completion_tokens_details counts accepted and "
                           "rejected prediction tokens. Not with a grammar (response_format json, a required or "
                           "named tool call, strict tools) or speculative: false"}),
    },
    "additionalProperties": False,
}

COMPLETION_REQUEST = {
    "title": "CompletionRequest", "type": "object", "required": ["model", "prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                             _TOKEN_IDS,
                             {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
                   "description": "one prompt or several, each text or token ids; each gets `n` choices, indexed "
                                  "prompt-major (prompts times n at most the router's `max_choices`, 128 by "
                                  "default)"},
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS_COMPLETIONS}),
        "echo": _nullable({"type": "boolean", "description": "true: each choice's text begins with its prompt's "
                                                             "text; not with `logprobs` (prompt logprobs are not "
                                                             "returned)"}),
        "best_of": _nullable({"const": 1, "description": "1 only; use n"}),
        "suffix": {"type": "null", "description": "not supported"},
    },
    "additionalProperties": False,
}

_INPUT_TEXT = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}
_INPUT_ITEM = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
                    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _INPUT_TEXT}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"],
     "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "the call's arguments as JSON text"}}},
    {"type": "object", "required": ["type", "call_id", "output"],
     "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string"},
                    "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _INPUT_TEXT}]}}},
    {"type": "object", "required": ["type"],
     "properties": {"type": {"const": "reasoning"},
                    "content": {"type": "array", "items": {"type": "object", "required": ["text"],
                                                           "properties": {"text": {"type": "string"}}}},
                    "summary": {"type": "array", "items": {"type": "object", "required": ["text"],
                                                           "properties": {"text": {"type": "string"}}}}},
     "description": "replayed reasoning: the next assistant turn's reasoning, for templates that write it back"}]}
_RESPONSES_TOOL = {"type": "object", "required": ["type", "name"],
                   "properties": {"type": {"const": "function"}, "name": {"type": "string"},
                                  "description": _nullable({"type": "string"}),
                                  "parameters": _nullable({"type": "object"}),
                                  "strict": _nullable({"type": "boolean", "description": "unset: true"})}}
_TEXT_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "name", "schema"],
     "properties": {"type": {"const": "json_schema"}, "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                    "description": {"type": "string"}, "schema": {"type": "object"},
                    "strict": _nullable({"type": "boolean"})}}]}
RESPONSES_REQUEST = {
    "title": "ResponsesRequest", "type": "object", "required": ["model", "input"],
    "description": "OpenAI's Responses API, served by the chat completion endpoint (router/responses_api.py). "
                   "Nothing is stored: `previous_response_id` is a 400; send the whole conversation as `input`.",
    "properties": {
        **{name: _SAMPLING[name] for name in ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                             "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                                             "stream", "user", "prompt_cache_key", "speculative", "metadata",
                                             "service_tier", "safety_identifier")},
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]},
        "instructions": _nullable({"type": "string", "description": "a system message before the input"}),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1}),
        "tools": _nullable({"type": "array", "items": _RESPONSES_TOOL,
                            "description": "function tools only; hosted tools (web_search, file_search, ...) "
                                           "are a 400"}),
        "tool_choice": _nullable({"anyOf": [
            {"enum": list(TOOL_CHOICES)},
            {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"const": "function"}, "name": {"type": "string"}}},
            {"type": "object", "required": ["type", "mode", "tools"],
             "properties": {"type": {"const": "allowed_tools"}, "mode": {"enum": ["auto", "required"]},
                            "tools": {"type": "array", "minItems": 1, "items": {
                                "type": "object", "required": ["type", "name"],
                                "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}}}}]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "text": _nullable({"type": "object", "properties": {"format": _nullable(_TEXT_FORMAT),
                                                            "verbosity": _nullable({"const": "medium"})}}),
        "reasoning": _nullable({"type": "object",
                                "properties": {"effort": _nullable({"enum": list(REASONING_EFFORTS)}),
                                               "summary": _nullable({"enum": ["auto", "concise", "detailed"]})}}),
        "include": _nullable({"type": "array", "items": {"enum": ["message.output_text.logprobs",
                                                                  "reasoning.encrypted_content"]}}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS_CHAT}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "extra chat template variables"}),
        "store": _nullable({"type": "boolean", "description": "accepted; nothing is stored"}),
        "truncation": _nullable({"const": "disabled"}),
        "background": _nullable({"const": False}),
    },
    "additionalProperties": False,
}

_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
EMBEDDINGS_REQUEST = {
    "title": "EmbeddingsRequest", "type": "object", "required": ["model", "input"], "additionalProperties": False,
    "description": "Each input's final hidden state, pooled as the checkpoint says (router/embeddings.py, "
                   "engine/pooling.py).",
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "input": {"anyOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "maxItems": 2048,
                             "items": {"type": "string", "minLength": 1}},
                            _TOKEN_IDS,
                            {"type": "array", "minItems": 1, "maxItems": 2048, "items": _TOKEN_IDS}]},
        "encoding_format": _nullable({"enum": ["float", "base64"]}),
        "dimensions": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_UINT32,
                                 "description": "the first values, re-normalized when the model normalizes"}),
        "user": _nullable({"type": "string"}),
    },
}
_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                   "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                  "param": {"type": ["string", "null"]},
                                                  "code": {"type": ["string", "null"]}}}}}
_ERRORS = {str(status): {"description": meaning, "content": {"application/json": {"schema": _ERROR}}}
           for status, meaning in ((400, "a parameter is invalid (`param` names it), or the prompt does not fit "
                                         "the context (`context_length_exceeded`)"),
                                   (401, "missing or unknown API key"), (404, "no live site serves the model"),
                                   (413, "the body is too large"), (429, "rate limited (Retry-After)"),
                                   (503, "no site has capacity now (Retry-After)"))}


def describe_completions(spec: dict) -> dict:
    """FastAPI's spec with the completion routes' request bodies and error answers filled in.

    Added to the finished spec rather than through `openapi_extra`, which would pass the schemas
    through FastAPI's models and turn large integer bounds (the seed's) into floats."""
    completion = "the completion; `text/event-stream` chunks with stream: true"
    for path, body_schema, answer in (
            ("/v1/chat/completions", CHAT_COMPLETION_REQUEST, completion),
            ("/v1/completions", COMPLETION_REQUEST, completion),
            ("/v1/responses", RESPONSES_REQUEST, "a Response object; with stream: true, `text/event-stream` events "
                                                 "(response.created ... response.completed, .incomplete or .failed)"),
            ("/v1/embeddings", EMBEDDINGS_REQUEST, "a list of embeddings, one per input, in order")):
        operation = spec["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
        operation["responses"] = {"200": {"description": answer}, **_ERRORS}
    return spec
