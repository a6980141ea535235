"""`POST /v1/responses` (OpenAI's Responses API), served by the chat completion endpoint itself.

A Responses request is translated into the chat request it means (`instructions` and `input` items as
messages, flat function tools as chat tools, `text.format` as `response_format`, `max_output_tokens` as
`max_completion_tokens`) and handed to the chat endpoint's own ASGI handler, so it gets the same
authentication, placement, failover and stream resume, rate limits, usage metering, tool-call parsing,
grammars and reasoning split: there is one pipeline. `ResponsesEdge` does the translation at the ASGI
boundary, both ways: the request body on its way in; the chat answer (a Response object), its stream
(the Responses' semantic events, `sequence_number`ed) and its errors (`param` named as the Responses
request names it) on their way out.

Nothing is stored: `store: true` is accepted as the SDK sends it by default, but `previous_response_id`,
`conversation` and the `GET`/`DELETE /v1/responses/{id}` routes are answered saying that the client sends
the whole conversation as `input` (the earlier output items replay as input items).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field

from router.errors import ApiError, bad_request, too_large
from router.openai_request import SERVICE_TIERS, check_tool_name, decode_json, parse_json
from router.responses import SERVICE_TIER, encode_json

RESPONSES_PATH = "/v1/responses"
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")
# Chat fields a Responses request may carry under their chat names (the router's sampling extensions); the
# chat parser validates them and its errors name them alike.
CHAT_EXTENSIONS = frozenset({"seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                             "logit_bias", "stop", "chat_template_kwargs", "speculative"})
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "stream", "stream_options", "metadata", "user", "prompt_cache_key",
    "reasoning", "store", "truncation", "include", "background", "service_tier", "safety_identifier",
    "prompt_cache_retention", *CHAT_EXTENSIONS})
# `include` values: logprobs are returned; encrypted reasoning is not (the reasoning comes as text), and
# asking for it changes nothing. The rest are hosted tools' or images' outputs, which this server has none of.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_WITHOUT_EFFECT = ("reasoning.encrypted_content",)
REASONING_SUMMARIES = ("auto", "concise", "detailed")
MAX_TOP_LOGPROBS = 20
# OpenAI's limits on `metadata`, which the answer echoes (its SDK reads every value as a string)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# A function tool's fields; `defer_loading` and `allowed_callers` only with the values a plain tool has (there
# is no tool search and no programmatic caller here)
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
TOOL_FIELDS_WITHOUT_EFFECT = ("defer_loading", "allowed_callers")
TEXT_FORMAT_FIELDS = {"text": ("type",), "json_object": ("type",),
                      "json_schema": ("type", "name", "schema", "strict", "description")}
_NO_STORE = ("this server keeps no responses, so a response cannot be continued by its id; send the whole "
             "conversation as `input` (the earlier input items and the output items of earlier responses, then "
             "the new ones)")
_UNSUPPORTED_HINTS = {
    "previous_response_id": _NO_STORE,
    "conversation": "this server keeps no conversations; send the whole conversation as `input`",
    "prompt": "this server keeps no reusable prompts; send `instructions` and `input`",
    "max_tool_calls": "send `parallel_tool_calls: false` to allow one call per response",
    "messages": "/v1/responses takes `input` (and `instructions`); `messages` is /v1/chat/completions'",
    "response_format": "/v1/responses takes `text.format`",
    "max_tokens": "/v1/responses takes `max_output_tokens`",
    "max_completion_tokens": "/v1/responses takes `max_output_tokens`",
    "n": "a response has one output; send several requests",
    "reasoning_effort": "/v1/responses takes `reasoning.effort`",
}


@dataclass(slots=True)
class ResponsesRequest:
    """What the answer echoes of a Responses request, and how its chat translation's parameters map back."""

    model: str
    stream: bool
    instructions: str | None
    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool
    text_format: dict
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_logprobs: int
    metadata: dict
    user: str | None
    reasoning: dict
    # per chat message, the Responses parameter it came from ("instructions", "input", "input[3]")
    sources: list[str] = field(default_factory=list)


def translate(document: dict) -> tuple[dict, ResponsesRequest]:
    """The chat request a Responses request means, and what its answer echoes; a 400 naming the Responses
    field for input that has no chat meaning (the chat parser checks the rest, named back by `chat_param`)."""
    for name, value in document.items():
        if value is None or name in RESPONSES_FIELDS:
            continue
        hint = _UNSUPPORTED_HINTS.get(name, "remove it from the request")
        raise bad_request(f"`{name}` is not supported by /v1/responses; {hint}.", name, "unsupported_parameter")
    chat = {name: document[name] for name in ("model", "temperature", "top_p", "user", "prompt_cache_key",
                                              "safety_identifier", "parallel_tool_calls", *CHAT_EXTENSIONS)
            if document.get(name) is not None}
    _check_accepted(document)
    instructions = document.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string (a system message put before the input).", "instructions")
    messages, sources = [], []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    _input_messages(document.get("input"), messages, sources)
    chat["messages"] = messages
    tools = _tools(document.get("tools"))
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
    tool_choice = _tool_choice(document.get("tool_choice"), bool(tools))
    if tool_choice is not None:  # without tools, a 400 from the chat parser ("needs `tools`")
        chat["tool_choice"] = _chat_tool_choice(tool_choice)
    text_format = _text_format(document.get("text"))
    if text_format["type"] != "text":
        chat["response_format"] = _chat_response_format(text_format)
    if document.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = document["max_output_tokens"]
    reasoning = _reasoning(document.get("reasoning"))
    if reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    top_logprobs = _top_logprobs(document)
    if top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top_logprobs
    stream = document.get("stream")
    if stream is not None:
        chat["stream"] = stream
    if stream is True:  # usage rides on the stream's last chunk, which the final response event carries
        chat["stream_options"] = {"include_usage": True}
    request = ResponsesRequest(
        model=document.get("model"), stream=stream is True, instructions=instructions, tools=tools,
        tool_choice=tool_choice if tool_choice is not None else ("auto" if tools else "none"),
        parallel_tool_calls=document.get("parallel_tool_calls") is not False, text_format=text_format,
        max_output_tokens=document.get("max_output_tokens"), temperature=document.get("temperature"),
        top_p=document.get("top_p"), top_logprobs=top_logprobs or 0, metadata=document.get("metadata") or {},
        user=document.get("user"), reasoning=reasoning, sources=sources)
    return chat, request


def _check_accepted(document: dict) -> None:
    """The fields accepted without a chat counterpart: each only with the values that change nothing here."""
    checks = {
        "metadata": (lambda v: isinstance(v, dict), "an object (it is echoed; nothing is stored)"),
        "store": (lambda v: isinstance(v, bool), "true or false (nothing is stored either way)"),
        "background": (lambda v: v is False, "false: responses are answered while the request waits"),
        "truncation": (lambda v: v == "disabled", "\"disabled\": an input longer than the context is a 400, "
                                                  "never cut; shorten `input` instead"),
        "service_tier": (lambda v: v in SERVICE_TIERS, f"one of {', '.join(SERVICE_TIERS)}; every request is "
                                                       f"served at the one tier there is"),
        "stream_options": (lambda v: isinstance(v, dict) and document.get("stream") is True
                           and set(v) <= {"include_obfuscation"}, "{\"include_obfuscation\": ...} with "
                                                                   "`stream: true`"),
        # the prefix cache lives in the sites' memory, for as long as it is not evicted; never 24 hours
        "prompt_cache_retention": (lambda v: v == "in_memory", "\"in_memory\": sites keep prompts' prefix cache "
                                                               "in memory only, never for 24 hours"),
    }
    for name, (accepted, takes) in checks.items():
        value = document.get(name)
        if value is not None and not accepted(value):
            raise bad_request(f"`{name}` takes {takes}.", name, "unsupported_value")
    _check_metadata(document.get("metadata"))


def _check_metadata(value) -> None:
    """`metadata` within OpenAI's limits: it is echoed, and clients read every value as a string."""
    if value is None:
        return
    if len(value) > MAX_METADATA_PAIRS:
        raise bad_request(f"`metadata` may hold at most {MAX_METADATA_PAIRS} pairs; it has {len(value)}.", "metadata")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"`metadata` keys are at most {MAX_METADATA_KEY} characters; `{key[:80]}` is longer.",
                              "metadata")
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise bad_request(f"`metadata.{key}` must be a string of at most {MAX_METADATA_VALUE} characters.",
                              f"metadata.{key}")


def _input_messages(value, messages: list[dict], sources: list[str]) -> None:
    """`input` as chat messages: a string is one user message; items are messages, function calls (an
    assistant turn's tool calls; consecutive calls are one turn), their outputs (tool messages) and
    reasoning (the next assistant turn's `reasoning_content`, for templates that replay it). OpenAI pairs a call
    and its output by `call_id` wherever the output comes after it; chat wants each output right after its
    calling turn, so that is where its tool message goes, whatever items came between."""
    if value is None:
        raise bad_request("`input` is required: a string or an array of input items.", "input",
                          "missing_required_parameter")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        sources.append("input")
        return
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty array of input items.", "input")
    reasoning, call_names, call_params, answered = None, {}, {}, set()
    call_turns = {}  # call_id -> the index of the assistant message holding the call
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"`{param}` must be an input item object (a message, function_call or "
                              f"function_call_output).", param)
        kind = item.get("type", "message" if "role" in item else None)
        last = messages[-1] if messages else None
        if kind == "message":
            message = _input_message(item, param)
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
            sources.append(param)
        elif kind == "function_call":
            call = _function_call(item, param)
            call_names[call["id"]], call_params[call["id"]] = call["function"]["name"], param
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(param)
            call_turns[call["id"]] = len(messages) - 1
            if reasoning is not None:
                messages[-1].setdefault("reasoning_content", reasoning)
                reasoning = None
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", param)
            if call_id not in call_names:
                raise bad_request(f"`{param}.call_id` is `{call_id}`, but no `function_call` item before it has that "
                                  f"call_id: send the function call (the earlier response's output item) before its "
                                  f"output.", f"{param}.call_id")
            answered.add(call_id)
            at = call_turns[call_id] + 1
            while at < len(messages) and messages[at]["role"] == "tool":
                at += 1
            messages.insert(at, {"role": "tool", "tool_call_id": call_id, "name": call_names[call_id],
                                 "content": _call_output(item.get("output"), param)})
            sources.insert(at, param)
            call_turns = {other: turn + (turn >= at) for other, turn in call_turns.items()}
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, param)
        elif kind == "item_reference":
            raise bad_request(f"`{param}` refers to a stored item, but {_NO_STORE}.", param, "unsupported_value")
        elif isinstance(kind, str):
            raise bad_request(f"`{param}.type` is `{kind}`, which this server does not take: it runs no hosted or "
                              f"custom tools. Input items may be messages, `function_call`, `function_call_output` "
                              f"and `reasoning`.", f"{param}.type", "unsupported_value")
        else:
            raise bad_request(f"`{param}` must have a `type` (message, function_call, function_call_output, "
                              f"reasoning) or a `role`.", param)
    for call_id, param in call_params.items():
        if call_id not in answered:
            raise bad_request(f"`{param}` is a function call (`{call_id}`) with no `function_call_output` item after "
                              f"it: the model would read a call without its result. Send its output, "
                              f"{{\"type\": \"function_call_output\", \"call_id\": \"{call_id}\", \"output\": ...}}.",
                              param)


def _input_message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise bad_request(f"`{param}.role` must be one of {', '.join(INPUT_ROLES)}.", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"`{param}.content` must be a string or an array of content parts.", f"{param}.content")
    texts = []
    for j, part in enumerate(content):
        part_param = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise _part_error(kind, part_param)
    return {"role": role, "content": "".join(texts)}


def _part_error(kind, param: str) -> ApiError:
    if kind == "input_image":
        return bad_request(f"`{param}` is an image, but the models served here read text only. Send "
                           f"`input_text` parts.", param, "image_input_not_supported")
    if isinstance(kind, str) and kind not in (*TEXT_PART_TYPES, "refusal"):
        return bad_request(f"`{param}` is a part of type `{kind}`, but the models served here read text only. "
                           f"Send `input_text` parts.", param, "unsupported_content_type")
    return bad_request(f"`{param}` must be a text part ({{\"type\": \"input_text\", \"text\": ...}}).", param)


def _function_call(item: dict, param: str) -> dict:
    """A function_call item as a chat tool call (its `call_id` the call's id)."""
    call_id, name = _string(item, "call_id", param), _string(item, "name", param)
    arguments = _string(item, "arguments", param)
    if arguments.strip():
        decode_json(arguments, f"`{param}.arguments`", f"{param}.arguments")  # the template reads it as an object
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_output(value, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
                raise _part_error(kind, f"{param}.output[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"`{param}.output` must be a string or an array of `input_text` parts.", f"{param}.output")


def _reasoning_text(item: dict, param: str) -> str:
    """A replayed reasoning item's text: its reasoning text, else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise bad_request(f"`{param}.{key}` must be an array of {{\"type\": \"{kind}\", \"text\": ...}} parts.",
                              f"{param}.{key}")
        if parts:
            return "".join(part["text"] for part in parts)
    return ""


def _string(item: dict, name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"`{param}.{name}` is required and must be a string.", f"{param}.{name}",
                          "missing_required_parameter" if value is None else "invalid_value")
    return value


def _tools(value) -> list[dict]:
    """Responses' flat function tools, with `strict` as OpenAI defaults it (true)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("`tools` must be an array of {\"type\": \"function\", \"name\", \"parameters\"} objects.",
                          "tools")
    tools = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if not isinstance(kind, str):
                raise bad_request(f"`{param}` must be a {{\"type\": \"function\", \"name\", \"parameters\"}} object.",
                                  param)
            raise bad_request(f"`{param}.type` is `{kind}`: this server runs no hosted or custom tools (web search, "
                              f"file search, code interpreter, computer use, MCP, image generation, shell); only "
                              f"function tools ({{\"type\": \"function\", \"name\", \"parameters\"}}) are supported.",
                              f"{param}.type", "unsupported_value")
        if not isinstance(tool.get("name"), str):
            hint = (" (Responses tools are flat: `name` beside `type`, not inside `function`)" if "function" in tool
                    else "")
            raise bad_request(f"`{param}.name` is required and must be a string{hint}.", f"{param}.name",
                              "missing_required_parameter")
        check_tool_name(tool["name"], f"{param}.name", [t["name"] for t in tools])
        for name, kind_name, check in (("description", "a string", str), ("parameters", "a JSON schema object", dict),
                                       ("strict", "true or false", bool)):
            if tool.get(name) is not None and not isinstance(tool[name], check):
                raise bad_request(f"`{param}.{name}` must be {kind_name}.", f"{param}.{name}")
        _check_tool_extras(tool, param)
        tools.append({**tool, "strict": tool.get("strict") is not False})
    return tools


def _check_tool_extras(tool: dict, param: str) -> None:
    """A function tool's fields beyond its name, description, schema and strictness: each only with the value
    that changes nothing (the tool offered to the model up front, called by the model itself)."""
    for name, value in tool.items():
        if value is None or name in TOOL_FIELDS:
            continue
        if name not in TOOL_FIELDS_WITHOUT_EFFECT:
            raise bad_request(f"`{param}.{name}` is not supported; a function tool takes `name`, `description`, "
                              f"`parameters` and `strict`.", f"{param}.{name}", "unsupported_parameter")
        if name == "defer_loading" and value is not False:
            raise bad_request(f"`{param}.defer_loading` can only be false: there is no tool search here, so every "
                              f"tool is offered to the model up front.", f"{param}.defer_loading", "unsupported_value")
        if name == "allowed_callers" and value != ["direct"]:
            raise bad_request(f"`{param}.allowed_callers` can only be [\"direct\"]: only the model calls tools here.",
                              f"{param}.allowed_callers", "unsupported_value")


def _chat_tool(tool: dict) -> dict:
    function = {name: tool[name] for name in ("name", "description", "parameters", "strict")
                if tool.get(name) is not None}
    return {"type": "function", "function": function}


def _tool_choice(value, has_tools: bool):
    """"none" | "auto" | "required" | {"type": "function", "name"} | {"type": "allowed_tools", ...}, or None.
    "auto" and "none" without tools change nothing and are dropped; the rest need tools (the chat parser says so)."""
    if value is None or (value in ("auto", "none") and not has_tools):
        return None
    if value in ("none", "auto", "required"):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function" and isinstance(value.get("name"), str):
        return value
    if kind == "allowed_tools":
        return _allowed_tools(value)
    if isinstance(kind, str) and kind != "function":
        raise bad_request(f"`tool_choice.type` is `{kind}`: this server runs no hosted or custom tools; choose "
                          f"\"none\", \"auto\", \"required\", {{\"type\": \"function\", \"name\"}} or "
                          f"{{\"type\": \"allowed_tools\", \"mode\", \"tools\"}}.", "tool_choice.type",
                          "unsupported_value")
    raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\", {\"type\": \"function\", \"name\": ...} "
                      "or {\"type\": \"allowed_tools\", \"mode\", \"tools\"}.", "tool_choice")


def _allowed_tools(value: dict) -> dict:
    tools = value.get("tools")
    if value.get("mode") not in ("auto", "required") or not isinstance(tools, list) or not tools:
        raise bad_request("`tool_choice` with `type: \"allowed_tools\"` takes `mode` (\"auto\" or \"required\") and "
                          "`tools`, a non-empty array of {\"type\": \"function\", \"name\": ...}.", "tool_choice")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise bad_request(f"`tool_choice.tools[{i}]` must be {{\"type\": \"function\", \"name\": ...}}; only "
                              f"function tools are supported.", f"tool_choice.tools[{i}]")
    return value


def _chat_tool_choice(value):
    if isinstance(value, str):
        return value
    if value["type"] == "function":
        return {"type": "function", "function": {"name": value["name"]}}
    return {"type": "allowed_tools", "allowed_tools": {"mode": value.get("mode"), "tools": value.get("tools")}}


def _text_format(value) -> dict:
    """`text.format`: {"type": "text"} (the default), {"type": "json_object"} or {"type": "json_schema", "name",
    "schema", "strict", "description"}."""
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        raise bad_request("`text` must be an object ({\"format\": ...}).", "text")
    unknown = [name for name in value if name not in ("format", "verbosity") and value[name] is not None]
    if unknown:
        raise bad_request(f"`text.{unknown[0]}` is not supported; `text` takes `format`.", f"text.{unknown[0]}",
                          "unsupported_parameter")
    if value.get("verbosity") not in (None, "medium"):
        raise bad_request("`text.verbosity` is supported only as \"medium\": the models served here have no "
                          "verbosity setting.", "text.verbosity", "unsupported_value")
    fmt = value.get("format")
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("`text.format.type` must be \"text\", \"json_object\" or \"json_schema\".",
                          "text.format.type")
    unknown = [name for name in fmt if name not in TEXT_FORMAT_FIELDS[kind] and fmt[name] is not None]
    if unknown:
        raise bad_request(f"`text.format.{unknown[0]}` is not supported; a `{kind}` format takes "
                          f"{', '.join(f'`{n}`' for n in TEXT_FORMAT_FIELDS[kind])}.", f"text.format.{unknown[0]}",
                          "unsupported_parameter")
    if kind == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise bad_request("`text.format.schema` is required with `type: \"json_schema\"`: a JSON schema object.",
                          "text.format.schema", "missing_required_parameter")
    return fmt


def _chat_response_format(fmt: dict) -> dict:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {name: fmt[name] for name in ("name", "schema", "strict", "description") if fmt.get(name) is not None}
    return {"type": "json_schema", "json_schema": spec}


def _reasoning(value) -> dict:
    """`reasoning`: `effort` reaches the chat template as chat's `reasoning_effort` does; `summary` is accepted
    (the reasoning comes back whole, as reasoning text, not summarised)."""
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise bad_request("`reasoning` must be an object ({\"effort\", \"summary\"}).", "reasoning")
    for name in value:
        if name not in ("effort", "summary", "generate_summary") and value[name] is not None:
            raise bad_request(f"`reasoning.{name}` is not supported; `reasoning` takes `effort` and `summary`.",
                              f"reasoning.{name}", "unsupported_parameter")
    summary = value.get("summary", value.get("generate_summary"))
    if summary is not None and summary not in REASONING_SUMMARIES:
        raise bad_request(f"`reasoning.summary` must be one of {', '.join(REASONING_SUMMARIES)}.", "reasoning.summary")
    return {"effort": value.get("effort"), "summary": summary}


def _top_logprobs(document: dict) -> int | None:
    """The top alternatives per token when the request asks for logprobs (`include` lists
    "message.output_text.logprobs", or `top_logprobs` is given), else None."""
    include = document.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(v, str) for v in include)):
        raise bad_request("`include` must be an array of strings.", "include")
    for value in include or ():
        if value != INCLUDE_LOGPROBS and value not in INCLUDE_WITHOUT_EFFECT:
            raise bad_request(f"`include` lists `{value}`, which this server cannot return; it may list "
                              f"\"{INCLUDE_LOGPROBS}\" and \"reasoning.encrypted_content\" (reasoning comes back as "
                              f"text, never encrypted).", "include", "unsupported_value")
    top = document.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad_request(f"`top_logprobs` must be an integer between 0 and {MAX_TOP_LOGPROBS}.", "top_logprobs")
    if INCLUDE_LOGPROBS in (include or ()) or top is not None:
        return top or 0
    return None


# ---- chat answers as Responses ----

def chat_param(param: str | None, request: ResponsesRequest | None) -> str | None:
    """The Responses parameter a chat parameter of the translated request stands for."""
    if not param:
        return param
    if match := re.fullmatch(r"messages(?:\[(\d+)\].*)?", param):
        index = match.group(1)
        if index is None or request is None or int(index) >= len(request.sources):
            return "input"
        return request.sources[int(index)]
    if match := re.fullmatch(r"tools\[(\d+)\]\.function(\..*)?", param):
        return f"tools[{match.group(1)}]{match.group(2) or ''}"
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format"):].replace(".json_schema", "", 1)
    if param.startswith("tool_choice.allowed_tools"):
        return "tool_choice" + param[len("tool_choice.allowed_tools"):]
    return {"max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort",
            "logprobs": "include", "stream_options": "stream"}.get(param, param)


def responses_error(body: dict, request: ResponsesRequest | None) -> dict:
    """A chat endpoint's error body, its `param` and the parameters its message quotes named as the Responses
    request names them."""
    error = body.get("error")
    if not isinstance(error, dict):
        return body
    message = error.get("message")
    if isinstance(message, str):
        message = re.sub(r"`([^`\s]+)`", lambda m: f"`{chat_param(m.group(1), request)}`", message)
        message = re.sub(r"\bmax_completion_tokens\b", "max_output_tokens", message)
    return {"error": {**error, "message": message, "param": chat_param(error.get("param"), request)}}


def response_object(request: ResponsesRequest, response_id: str, created_at: int, status: str) -> dict:
    """A Response with the request's parameters echoed, its output and usage still to come."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
            "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "model": request.model, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "reasoning": request.reasoning, "store": False, "temperature": request.temperature,
            "text": {"format": request.text_format}, "tool_choice": request.tool_choice, "tools": request.tools,
            "top_logprobs": request.top_logprobs, "top_p": request.top_p, "truncation": "disabled", "usage": None,
            "user": request.user, "metadata": request.metadata, "background": False, "service_tier": SERVICE_TIER}


def _response_id(chat_id: str) -> str:
    """The response's id, from the chat answer's (the same hex, so logs and answers match up)."""
    return "resp_" + chat_id.rpartition("-")[2]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(16).hex()}"


def _usage(usage: dict) -> dict:
    details = usage.get("completion_tokens_details") or {}
    # Sites fill their prefix cache as they prefill, with no write of its own to count: none is reported.
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _reasoning_item(text: str) -> dict:
    # The reasoning is the model's own text (reasoning_text), as open-weight models' is served; no summary.
    return {"id": _item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _message_item(text: str, logprobs: list[dict]) -> dict:
    return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {"id": _item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _finish(body: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    """The response's end: completed, or incomplete (the last item with it) when cut by max_output_tokens."""
    body["output"], body["usage"] = output, _usage(usage)
    body["status"] = "incomplete" if finish_reason == "length" else "completed"
    if body["status"] == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
        if output:
            output[-1]["status"] = "incomplete"
    body["completed_at"] = int(time.time())
    return body


def answer(request: ResponsesRequest, chat: dict) -> dict:
    """The Response for a chat completion: its reasoning, its text (a message; always one without calls)
    and its tool calls (function_call items), in that order."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(_message_item(message.get("content") or "", logprobs))
    output += [_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]) for call in calls]
    body = response_object(request, _response_id(chat["id"]), chat["created"], "completed")
    return _finish(body, output, choice["finish_reason"], chat["usage"])


class ResponseEvents:
    """A chat stream's chunks as the Responses' semantic events: response.created and .in_progress first;
    each output item (reasoning, message, function call) opened (output_item.added, its content part), its
    deltas, and closed (…done events) when the next begins; response.completed or .incomplete last, with the
    whole response; response.failed when the stream breaks for good."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.body: dict | None = None
        self.output: list[dict] = []
        self.item: dict | None = None        # the item being written
        self.calls: dict[int, dict] = {}     # the chat stream's tool-call index -> its function_call item
        self.finish_reason: str | None = None
        self.num_events = 0

    def chunk(self, chunk: dict) -> list[bytes]:
        events = self._begin(chunk.get("id", ""), chunk.get("created"))
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta.get("content") or logprobs:
                events += self._text(delta.get("content") or "", logprobs)
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None:  # the stream's last chunk (include_usage)
            if not any(item["type"] in ("message", "function_call") for item in self.output):
                events += self._open(_message_item("", []))  # the empty message a non-streamed answer has
            events += self._close()
            body = _finish(self.body, self.output, self.finish_reason, chunk["usage"])
            events.append(self._event(f"response.{body['status']}", response=body))
        return events

    def failed(self, error: dict) -> list[bytes]:
        """The stream broke for good (every site tried, or the router's own failure): the response failed,
        with the output written so far."""
        events = self._begin("", None)
        if self.item is not None:  # the item being written when the stream broke: cut short, never done
            self.item["status"] = "incomplete"
        self.body.update(status="failed", output=self.output,
                         error={"code": "server_error", "message": error.get("message") or "The stream failed."})
        return [*events, self._event("response.failed", response=self.body)]

    def _begin(self, chat_id: str, created: int | None) -> list[bytes]:
        if self.body is not None:
            return []
        response_id = _response_id(chat_id) if chat_id else _item_id("resp")
        self.body = response_object(self.request, response_id, created or int(time.time()), "in_progress")
        return [self._event("response.created", response=self.body),
                self._event("response.in_progress", response=self.body)]

    def _event(self, kind: str, **fields) -> bytes:
        """One server-sent event, encoded at once: the items it shows go on changing."""
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), encode_json(event).encode())

    def _open(self, item: dict) -> list[bytes]:
        events = self._close()
        self.item = item
        self.output.append(item)
        if item["type"] == "function_call":
            return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1,
                                         item={**item, "status": "in_progress"})]
        # The item opens empty and its one content part is added next, as the SDK accumulates them.
        added = {**item, "status": "in_progress", "content": []}
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1, item=added),
                self._event("response.content_part.added", **self._where(), part=item["content"][0])]

    def _where(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _reasoning(self, text: str) -> list[bytes]:
        events = [] if self.item is not None and self.item["type"] == "reasoning" else self._open(_reasoning_item(""))
        self.item["content"][0]["text"] += text
        return [*events, self._event("response.reasoning_text.delta", **self._where(), delta=text)]

    def _text(self, text: str, logprobs: list[dict]) -> list[bytes]:
        events = [] if self.item is not None and self.item["type"] == "message" else self._open(_message_item("", []))
        part = self.item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return [*events, self._event("response.output_text.delta", **self._where(), delta=text, logprobs=logprobs)]

    def _call(self, call: dict) -> list[bytes]:
        function = call.get("function") or {}
        index = call.get("index", 0)
        events = []
        if "id" in call:  # a call's first delta: its id and name
            self.calls[index] = _call_item(call["id"], function.get("name", ""), "")
            events = self._open(self.calls[index])
        item = self.calls.get(index)
        arguments = function.get("arguments") or ""
        if item is None or not arguments:
            return events
        item["arguments"] += arguments
        return [*events, self._event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=arguments)]

    def _close(self) -> list[bytes]:
        """The …done events of the item being written (none when none is)."""
        item, self.item = self.item, None
        if item is None:
            return []
        index = self.output.index(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = ({"kind": "response.reasoning_text.done", "text": part["text"]} if item["type"] == "reasoning"
                    else {"kind": "response.output_text.done", "text": part["text"], "logprobs": part["logprobs"]})
            events = [self._event(done.pop("kind"), **where, content_index=0, **done),
                      self._event("response.content_part.done", **where, content_index=0, part=part)]
        if self.finish_reason == "length" and item is self.output[-1]:
            item["status"] = "incomplete"
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]


def stored_response_not_found(response_id: str) -> ApiError:
    """GET or DELETE /v1/responses/{id}: nothing is stored, so no response can be found."""
    return ApiError(404, f"No response `{response_id}` is stored here: this server keeps no responses. A client "
                         f"that continues a conversation sends all of it as `input`.", "invalid_request_error", None,
                    "response_not_found")


# ---- the ASGI edge ----

class ResponsesEdge:
    """The `receive` and `send` a chat completion handler is run with to answer /v1/responses: the first reads
    the Responses body and gives the handler its chat translation; the second turns the handler's answer,
    stream or error back into the Responses' own."""

    def __init__(self, receive, send, max_body_bytes: int) -> None:
        self._receive, self._send, self._max_body_bytes = receive, send, max_body_bytes
        self._translated = False
        self._named = False
        self.request: ResponsesRequest | None = None
        self._start: dict | None = None
        self._mode = ""        # "stream" (events), "json" (a response or an error, rewritten whole)
        self._buffer = b""
        self._events: ResponseEvents | None = None

    async def receive(self) -> dict:
        if self._translated:
            return await self._receive()  # after the body: the client's disconnect, as the handler watches for
        chunks, size = [], 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return message
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body_bytes:
                raise too_large(f"The request body exceeds {self._max_body_bytes} bytes; send a smaller request.")
            if not message.get("more_body", False):
                break
        self._translated = True
        try:
            chat, self.request = translate(parse_json(b"".join(chunks)))
        except ApiError:
            self._named = True  # the error names the Responses fields already
            raise
        return {"type": "http.request", "body": encode_json(chat).encode(), "more_body": False}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            streaming = message["status"] == 200 and (b"content-type", b"text/event-stream") in message["headers"]
            self._mode = "stream" if streaming else "json"
            if streaming:
                self._events = ResponseEvents(self.request)
                await self._send(message)
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        more = message.get("more_body", False)
        self._buffer += message.get("body", b"")
        if self._mode == "stream":
            body = self._stream_events(final=not more)
            if body or not more:
                await self._send({"type": "http.response.body", "body": body, "more_body": more})
            return
        if not more:
            await self._send_json()

    def _stream_events(self, final: bool) -> bytes:
        """The Responses events of the whole chat events buffered (a partial one waits for its end)."""
        frames = self._buffer.split(b"\n\n")
        self._buffer = b"" if final else frames.pop()
        out = []
        for frame in frames:
            if not frame.startswith(b"data: ") or frame == b"data: [DONE]":
                continue
            chunk = json.loads(frame[6:])
            out += (self._events.failed(chunk["error"]) if isinstance(chunk.get("error"), dict)
                    else self._events.chunk(chunk))
        return b"".join(out)

    async def _send_json(self) -> None:
        document = json.loads(self._buffer) if self._buffer else {}
        if self._start["status"] == 200:
            document = answer(self.request, document)
        elif not self._named:
            document = responses_error(document, self.request)
        # ASCII-escaped as the router's error bodies are: a message may quote client text UTF-8 cannot encode
        body = json.dumps(document).encode() if self._start["status"] != 200 else encode_json(document).encode()
        headers = [(k, v) for k, v in self._start["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

