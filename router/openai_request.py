"""OpenAI request bodies to a plain `CompletionRequest`, with a 400 naming the field for bad input.

Parsed by hand rather than with pydantic: the messages name the OpenAI parameter and say what to
send instead, and this is on every request's path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from engine.grammar import GrammarSpec, check_grammar, json_schema_spec
from router.errors import bad_request
from router.tool_calls import has_strict_tool

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5
MAX_SEED = 2 ** 63 - 1  # the agent API carries a uint64, but engines take seeds in [0, 2**63) (int64 tensors)
# OpenAI takes any int64 seed; a negative one is folded into the engines' range (router.completions
# sampling_params), so it is as reproducible as any other.
MIN_SEED = -2 ** 63
MAX_UINT32 = 2 ** 32 - 1  # the agent API's top_k
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's reasoning efforts, least to most; each model's template takes them as router.reasoning.template_effort says.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# Variables the router itself gives the chat template; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0        # presence_penalty and frequency_penalty: OpenAI's [-2, 2]
MAX_LOGIT_BIAS = 100.0   # OpenAI's [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
MAX_CHOICES = 16
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's rule for the name of a function tool (chat and Responses alike) and of a response format.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
IMAGE_PART_TYPES = ("image_url", "input_image", "image")
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale")
# The longest predicted output a site takes (engine.ngram.MAX_PREDICTION_TOKENS, which this module cannot import):
# refused here first, with a 400 saying so.
MAX_PREDICTION_TOKENS = 32768
# Every field a request may carry. Each is implemented, except ACCEPTED_WITHOUT_EFFECT.
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "n", "stream",
    "stream_options", "logprobs", "top_logprobs", "user", "prompt_cache_key", "tools", "tool_choice",
    "parallel_tool_calls",
    "response_format", "documents", "chat_template_kwargs", "reasoning_effort", "speculative", "prediction"})
COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "n", "stream", "stream_options",
    "logprobs", "user", "prompt_cache_key", "echo", "best_of", "suffix", "speculative"})
# Fields clients send that change nothing a model returns here, accepted as OpenAI accepts them:
# `metadata` (tags for OpenAI's stored completions; nothing is stored), `store` (false only: nothing is
# stored), `service_tier` (any of OpenAI's tiers: every request is served at the one tier there is, and the
# response says "default", the tier used), `modalities`
# (["text"] only), `safety_identifier` (an end-user id for abuse reports; no moderation runs here).
# Completions' `best_of: 1` and `suffix: null` are the defaults. (`user` and
# `prompt_cache_key` do take effect: they name the session whose sites hold its prefix cache.)
ACCEPTED_WITHOUT_EFFECT = {
    "metadata": lambda v: isinstance(v, dict), "store": lambda v: v is False,
    "service_tier": lambda v: v in SERVICE_TIERS, "modalities": lambda v: v == ["text"],
    "safety_identifier": lambda v: isinstance(v, str),
}


@dataclass(slots=True)
class CompletionRequest:
    chat: bool                       # /v1/chat/completions (else /v1/completions)
    model: str
    messages: list[dict] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: each is text or token ids
    echo: bool = False                       # completions: each choice's text begins with its prompt's
    tools: list[dict] | None = None          # passed to the chat template
    documents: list[dict] | None = None      # passed to the chat template (RAG templates read it)
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, plus reasoning_effort
    max_tokens: int | None = None            # None: up to the model's context
    max_tokens_param: str = "max_tokens"     # the parameter that set it (chat: or max_completion_tokens)
    # Sampling left None is taken from the checkpoint's generation_config.json, else the OpenAI default.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None      # None: off; n: the sampled token's logprob plus the top n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float | None = None
    n: int = 1
    grammar: GrammarSpec | None = None       # response_format json_object / json_schema
    tool_choice: str | None = None           # none | auto | required | a function's name; None: no tools
    parallel_tool_calls: bool = True
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None      # names the session, as `user` does (prefix-cache affinity)
    no_speculation: bool = False             # `speculative: false`: the site verifies no proposed tokens for it
    prediction: str | None = None            # chat: the predicted output's text (`prediction`)
    prediction_ids: list[int] = field(default_factory=list)  # ... tokenized (router.completions)

    @property
    def num_prompts(self) -> int:
        """A chat request's one prompt (its messages), or the completion's prompts."""
        return 1 if self.chat else len(self.prompts)

    @property
    def num_choices(self) -> int:
        """The choices the request asks for: `n` of each prompt."""
        return self.n * self.num_prompts

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice if self.tool_choice not in (None, *TOOL_CHOICES) else None


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why it is not one (see `decode_json`)."""
    document = decode_json(body, "The request body")
    if not isinstance(document, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    return document


def decode_json(text: bytes | str, what: str, param: str | None = None):
    """JSON text as Python values, or a 400 naming `what` (and `param`) that says why it is not usable.

    Beyond syntax this refuses what Python's json accepts but nothing downstream can use: nesting
    past the interpreter's recursion limit, integers past its digit limit, and lone UTF-16
    surrogates (from a `\\ud800` escape or raw bytes), which no tokenizer or encoder takes.
    """
    try:
        document = json.loads(text)
    except RecursionError:
        raise bad_request(f"{what} nests arrays or objects too deeply; send flatter JSON.", param,
                          "invalid_json") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}).", param,
                          "invalid_json") from None
    except UnicodeDecodeError:
        raise bad_request(f"{what} is not valid UTF-8; send JSON encoded as UTF-8.", param, "invalid_json") from None
    except ValueError:  # Python's limit on the digits of an integer (sys.get_int_max_str_digits)
        raise bad_request(f"{what} holds an integer with too many digits; no parameter takes more than 20.",
                          param, "invalid_json") from None
    pattern = _MAY_HOLD_SURROGATE if isinstance(text, bytes) else _MAY_HOLD_SURROGATE_TEXT
    if pattern.search(text):  # a cheap scan first: nearly every body has none
        _refuse_lone_surrogates(document, param)
    return document


# A \uD800-\uDFFF escape, or a surrogate encoded as (invalid) UTF-8 bytes, which json.loads lets through.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_MAY_HOLD_SURROGATE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(document, param: str | None = None) -> None:
    """A 400 naming the first field (or `param`) holding a lone surrogate (json.loads joins valid pairs)."""
    stack: list[tuple[tuple, object]] = [((), document)]
    while stack:  # iterative: the document may nest as deep as json.loads allowed
        path, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                name = param or _param(path)
                raise bad_request(f"`{name}` holds a lone UTF-16 surrogate, which is not text; send valid Unicode.",
                                  name)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_surrogate(key):
                    name = param or _param(path) or None
                    raise bad_request(f"`{name or 'the body'}` has a key holding a lone UTF-16 surrogate; send "
                                      f"valid Unicode.", name)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))


def _has_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _param(path: tuple) -> str:
    """The OpenAI parameter a path points into: `prompt`, `stop`, `messages[2].content`, ..."""
    if not path:
        return ""
    if len(path) >= 3 and isinstance(path[1], int) and isinstance(path[2], str):
        return f"{path[0]}[{path[1]}].{path[2]}"
    return str(path[0])


def parse_request(document: dict, chat: bool) -> CompletionRequest:
    _refuse_unimplemented(document, chat)
    request = CompletionRequest(chat=chat, model=_string(document, "model", required=True))
    if chat:
        request.messages = _messages(document.get("messages"), request.model)
        _check_tool_replies(request.messages)
        request.tools = _tools(document.get("tools"))
        request.tool_choice, request.tools = _tool_choice(document.get("tool_choice"), request.tools)
        parallel = document.get("parallel_tool_calls")
        request.parallel_tool_calls = True if parallel is None else _bool(parallel, "parallel_tool_calls")
        request.documents = _documents(document.get("documents"))
        request.template_kwargs = _template_kwargs(document)
        request.grammar = _response_format(document.get("response_format"))
        if request.tool_choice == "required" or request.named_tool:
            if request.grammar is not None:
                raise bad_request("`response_format` cannot be combined with a required tool call; the call's "
                                  "arguments already follow the function's schema.", "response_format")
            _check_tool_schemas(request.tools, request.named_tool)
        elif request.tool_choice == "auto":
            _check_tool_schemas(request.tools, None, strict_only=True)
    else:
        request.prompts = _prompts(document.get("prompt"))
    request.max_tokens, request.max_tokens_param = _max_tokens(document, chat)
    request.temperature = _number(document.get("temperature"), "temperature", 0.0, 2.0)
    request.top_p = _number(document.get("top_p"), "top_p", 0.0, 1.0)
    if request.top_p is not None and request.top_p <= 0.0:
        raise bad_request("top_p must be greater than 0 and at most 1.", "top_p")
    top_k = _int(document.get("top_k"), "top_k", -1, MAX_UINT32)
    request.top_k = 0 if top_k == -1 else top_k  # -1 and 0 both mean off (vLLM spells it -1)
    request.repetition_penalty = _number(document.get("repetition_penalty"), "repetition_penalty", 0.0,
                                         MAX_REPETITION_PENALTY)
    if request.repetition_penalty is not None and request.repetition_penalty <= 0.0:
        raise bad_request("`repetition_penalty` must be greater than 0 (1 means off).", "repetition_penalty")
    request.seed = _int(document.get("seed"), "seed", MIN_SEED, MAX_SEED)
    request.stop = _stop(document.get("stop"))
    request.n = _int(document.get("n"), "n", 1, MAX_CHOICES) or 1
    request.presence_penalty = _number(document.get("presence_penalty"), "presence_penalty", -MAX_PENALTY,
                                       MAX_PENALTY) or 0.0
    request.frequency_penalty = _number(document.get("frequency_penalty"), "frequency_penalty", -MAX_PENALTY,
                                        MAX_PENALTY) or 0.0
    request.logit_bias = _logit_bias(document.get("logit_bias"))
    request.min_p = _number(document.get("min_p"), "min_p", 0.0, 1.0)
    request.logprobs = _logprobs(document, chat)
    request.stream = _bool(document.get("stream"), "stream")
    request.include_usage = _stream_options(document.get("stream_options"), request.stream)
    request.user = _string(document, "user")
    request.prompt_cache_key = _string(document, "prompt_cache_key")
    speculative = document.get("speculative")
    request.no_speculation = speculative is not None and not _bool(speculative, "speculative")
    if chat:
        request.prediction = _prediction(document.get("prediction"), request)
    else:
        _refuse_completion_options(document)
        request.echo = _bool(document.get("echo"), "echo")
        if request.echo and request.logprobs is not None:
            raise bad_request("`echo` cannot be combined with `logprobs`: the logprobs of prompt tokens are not "
                              "returned (a site computes logits only where it samples). Send one or the other.",
                              "logprobs", "unsupported_value")
    return request


def _prediction(value, request: CompletionRequest) -> str | None:
    """The text of OpenAI's predicted output, `{"type": "content", "content": text or [text parts]}`. Sites
    use it as speculative proposals, so it needs speculation, and output free of a grammar (constrained
    output is never speculated: the prediction would go unused)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content":
        raise bad_request("`prediction` must be {\"type\": \"content\", \"content\": the predicted answer as a "
                          "string or an array of text parts}.", "prediction.type" if isinstance(value, dict)
                          else "prediction")
    content = value.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise bad_request("`prediction.content` must be a string or an array of text parts "
                          "({\"type\": \"text\", \"text\": ...}).", "prediction.content")
    if request.no_speculation:
        raise bad_request("`prediction` is served by speculative decoding, which `speculative: false` turns off; "
                          "send one or the other.", "prediction", "invalid_parameter_combination")
    constrained = (request.grammar is not None or request.tool_choice == "required" or request.named_tool
                   or (request.tool_choice == "auto" and has_strict_tool(request.tools)))
    if constrained:
        raise bad_request("`prediction` cannot be combined with output that follows a grammar (`response_format` "
                          "json_object or json_schema, a required or named tool call, `strict` tools): constrained "
                          "output is never speculated, so the prediction would go unused. Send one or the other.",
                          "prediction", "invalid_parameter_combination")
    return content


def _max_tokens(document: dict, chat: bool) -> tuple[int | None, str]:
    """The completion's token limit and the parameter that set it. Chat's `max_completion_tokens` is the
    current name of `max_tokens`; both at different values is a 400, as OpenAI's, rather than one of them
    silently winning."""
    legacy = _int(document.get("max_tokens"), "max_tokens", minimum=1)
    current = _int(document.get("max_completion_tokens"), "max_completion_tokens", minimum=1) if chat else None
    if current is None:
        return legacy, "max_tokens"
    if legacy is not None and legacy != current:
        raise bad_request(f"`max_tokens` ({legacy}) and `max_completion_tokens` ({current}) disagree; send only "
                          f"`max_completion_tokens` (`max_tokens` is its deprecated name).", "max_tokens",
                          "invalid_parameter_combination")
    return current, "max_completion_tokens"


def _string(document: dict, name: str, required: bool = False) -> str | None:
    value = document.get(name)
    if value is None:
        if required:
            raise bad_request(f"`{name}` is required.", name, "missing_required_parameter")
        return None
    if not isinstance(value, str) or (required and not value):
        raise bad_request(f"`{name}` must be a {'non-empty ' if required else ''}string.", name)
    return value


def _bool(value, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"`{name}` must be true or false.", name)
    return value


def _int(value, name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer.", name)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise bad_request(f"`{name}` must be {bounds}; got {value}.", name)
    return value


def _number(value, name: str, minimum: float, maximum: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"`{name}` must be a number.", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"`{name}` must be a finite number; got {value}.", name)
    if not minimum <= value <= maximum:
        raise bad_request(f"`{name}` must be between {minimum:g} and {maximum:g}; got {value}.", name)
    return float(value)


def _refuse_unimplemented(document: dict, chat: bool) -> None:
    """A 400 naming the first field this router does not implement: a parameter silently dropped would
    change what the client gets without telling it. Null means "not given" (clients send it so)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name, value in document.items():
        if value is None or name in known:
            continue
        accepted = ACCEPTED_WITHOUT_EFFECT.get(name)
        if accepted is not None:
            if accepted(value):
                continue
            raise bad_request(f"`{name}` is accepted only with the value that changes nothing here "
                              f"({_WITHOUT_EFFECT_HINTS[name]}).", name, "unsupported_value")
        hint = _UNIMPLEMENTED_HINTS.get(name, "remove it from the request")
        raise bad_request(f"`{name}` is not supported by this endpoint; {hint}.", name, "unsupported_parameter")


def _refuse_completion_options(document: dict) -> None:
    """The legacy completions options this router takes only at their defaults."""
    if document.get("best_of") not in (None, 1):
        raise bad_request("`best_of` is supported only as 1; `n` asks for several completions.", "best_of",
                          "unsupported_value")
    if document.get("suffix") is not None:
        raise bad_request("`suffix` (insertion) is not supported; send the prompt only.", "suffix",
                          "unsupported_value")


_WITHOUT_EFFECT_HINTS = {"metadata": "an object", "store": "false; nothing is stored",
                         "service_tier": f"{', '.join(map(json.dumps, SERVICE_TIERS[:-1]))} or "
                                         f"{json.dumps(SERVICE_TIERS[-1])}; every request is served at the one "
                                         f"tier there is, answered as \"default\"",
                         "modalities": "[\"text\"]",
                         "safety_identifier": "a string"}
_UNIMPLEMENTED_HINTS = {
    "functions": "send `tools` instead (the deprecated `functions` form is not accepted)",
    "function_call": "send `tool_choice` instead (the deprecated `function_call` form is not accepted)",
    "audio": "this endpoint returns text only",
    "prediction": "predicted outputs are taken by /v1/chat/completions only",
    "web_search_options": "this endpoint has no web search",
}


def _messages(value, model: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("`messages` must be a non-empty array of {role, content} objects.", "messages")
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"`{param}` must be an object with `role` and `content`.", param)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"`{param}.role` must be one of {', '.join(ROLES)}.", f"{param}.role")
        if message.get("content") is None and role != "assistant":  # only an assistant turn may be calls alone
            raise bad_request(f"`{param}.content` is required for a {role} message (send \"\" for empty text).",
                              f"{param}.content", "missing_required_parameter")
        if message.get("function_call") is not None:
            raise bad_request(f"`{param}.function_call` is the deprecated form of a tool call, which this endpoint "
                              f"does not read; send it as `tool_calls` ([{{\"id\", \"type\": \"function\", "
                              f"\"function\": {{\"name\", \"arguments\"}}}}]) and its result as a `tool` message.",
                              f"{param}.function_call", "unsupported_parameter")
        normalized = {**message, "role": "system" if role == "developer" else role,
                      "content": _content(_turn_content(message, role), f"{param}.content", model, role)}
        calls = message.get("tool_calls")
        if calls == []:  # no calls, as if absent: templates test for the key (Llama 3.x then wants exactly one call)
            del normalized["tool_calls"]
        elif calls is not None:
            normalized["tool_calls"] = _tool_calls(calls, f"{param}.tool_calls")
        messages.append(normalized)
    return messages


def _tool_calls(value, param: str) -> list[dict]:
    """OpenAI tool calls carry their arguments as a JSON string; chat templates expect the object."""
    if not isinstance(value, list):
        raise bad_request(f"`{param}` must be an array of tool calls.", param)
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"`{param}[{j}]` must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}.", f"{param}[{j}]")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            name = f"{param}[{j}].function.arguments"
            arguments = decode_json(arguments, f"`{name}`", name) if arguments.strip() else {}
        calls.append({**call, "function": {**function, "arguments": arguments}})
    return calls


def _check_tool_replies(messages: list[dict]) -> None:
    """As OpenAI requires: every call of an assistant message is answered by a `tool` message (its `tool_call_id`
    the call's `id`) before the next user or assistant turn, and every tool message answers a call of the calling
    turn before it. A result without its call, or a call without its result, would give the model a conversation
    neither side had."""
    calling, unanswered = None, []  # the open calling turn's index, and the ids of its calls not yet answered
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            call_id = _reply_call_id(message, i, messages, calling)
            unanswered = [other for other in unanswered if other != call_id]
        elif role in ("user", "assistant"):
            if unanswered:
                raise _unanswered_calls(calling, unanswered, f"before `messages[{i}]`")
            calling = None
            if role == "assistant" and message.get("tool_calls"):
                calling, unanswered = i, _call_ids(message["tool_calls"], f"messages[{i}].tool_calls")
    if unanswered:
        raise _unanswered_calls(calling, unanswered, "before the conversation ends")


def _call_ids(calls: list[dict], param: str) -> list[str]:
    """The ids of a turn's calls, which the tool messages answering them name: each present and its own."""
    ids = []
    for j, call in enumerate(calls):
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"`{param}[{j}].id` is required (a non-empty string): the tool message answering the "
                              f"call names it as its `tool_call_id`.", f"{param}[{j}].id",
                              "missing_required_parameter" if call_id is None else "invalid_value")
        if call_id in ids:
            raise bad_request(f"`{param}[{j}].id` repeats `{call_id}`: each call needs its own id, so that its "
                              f"result can name it.", f"{param}[{j}].id")
        ids.append(call_id)
    return ids


def _reply_call_id(message: dict, i: int, messages: list[dict], calling: int | None) -> str:
    """The id of the call a tool message answers: one of the calling turn's before it."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad_request(f"`messages[{i}].tool_call_id` is required (a non-empty string): a tool message answers "
                          f"a call of the assistant message before it, named by the call's `id`.",
                          f"messages[{i}].tool_call_id",
                          "missing_required_parameter" if call_id is None else "invalid_value")
    if calling is None:
        raise bad_request(f"`messages[{i}]` is a tool message answering `{call_id}`, but no assistant message with "
                          f"`tool_calls` comes before it since the last user or assistant turn: messages with role "
                          f"'tool' must be a response to a preceding message with 'tool_calls'. Send the assistant "
                          f"message that made the call before its result.", f"messages[{i}]")
    ids = [call["id"] for call in messages[calling]["tool_calls"]]
    if call_id not in ids:
        raise bad_request(f"`messages[{i}]` is a tool message answering `{call_id}`, but `messages[{calling}]` made "
                          f"no call with that id (its calls are {', '.join(f'`{c}`' for c in ids)}): messages with "
                          f"role 'tool' must be a response to a preceding message with 'tool_calls'. Set "
                          f"`tool_call_id` to the id of the call it answers.", f"messages[{i}]")
    return call_id


def _unanswered_calls(calling: int, unanswered: list[str], where: str):
    listed = ", ".join(f"`{call_id}`" for call_id in unanswered)
    return bad_request(f"`messages[{calling}]` has `tool_calls` that no tool message answers {where} ({listed}): "
                       f"an assistant message with 'tool_calls' must be followed by tool messages responding to "
                       f"each 'tool_call_id'. Send each call's result as {{\"role\": \"tool\", \"tool_call_id\": "
                       f"..., \"content\": ...}} right after it.", f"messages[{calling}]")


def _tools(value) -> list[dict] | None:
    """Function tools only: another type (OpenAI's `custom` tools) is a 400 naming it, never read as a function."""
    if value is None:
        return None
    shape = "{\"type\": \"function\", \"function\": {\"name\", \"description\", \"parameters\"}}"
    if not isinstance(value, list):
        raise bad_request(f"`tools` must be an array of {shape} objects.", "tools")
    for i, tool in enumerate(value):
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise bad_request(f"`tools[{i}].type` must be \"function\"; only function tools are supported.",
                              f"tools[{i}].type", "unsupported_value")
        if not (isinstance(tool, dict) and isinstance(tool.get("function"), dict)
                and isinstance(tool["function"].get("name"), str)):
            raise bad_request(f"`tools[{i}]` must be a {shape} object.", f"tools[{i}]")
        _bool(tool["function"].get("strict"), f"tools[{i}].function.strict")
        check_tool_name(tool["function"]["name"], f"tools[{i}].function.name",
                        [earlier["function"]["name"] for earlier in value[:i]])
    return value


def check_tool_name(name: str, param: str, earlier: list[str]) -> None:
    """OpenAI's rule for a function tool's name: 1-64 letters, digits, `_` or `-`, and no two tools alike (the
    model could not say which one it calls)."""
    if not FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"`{param}` must be 1-64 letters, digits, underscores or dashes.", param)
    if name in earlier:
        raise bad_request(f"`{param}` repeats `{name}`: each function needs its own name.", param)


def _documents(value) -> list[dict] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise bad_request("`documents` must be an array of objects (with `title` and `text`).", "documents")
    return value


def _template_kwargs(document: dict) -> dict:
    """`chat_template_kwargs` (e.g. enable_thinking) and `reasoning_effort`, as chat template variables."""
    value = document.get("chat_template_kwargs")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise bad_request("`chat_template_kwargs` must be an object of template variables, e.g. "
                          "{\"enable_thinking\": false}.", "chat_template_kwargs")
    reserved = [name for name in RESERVED_TEMPLATE_KWARGS if name in value]
    if reserved:
        raise bad_request(f"`chat_template_kwargs` may not set {', '.join(reserved)}; send them as request fields.",
                          "chat_template_kwargs")
    effort = document.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"`reasoning_effort` must be one of {', '.join(REASONING_EFFORTS)}.",
                              "reasoning_effort")
        value = {"reasoning_effort": effort, **value}
    return value


def _turn_content(message: dict, role: str):
    """The content of a turn; an assistant turn that refused (content null, `refusal` set) said its refusal,
    and the model reads it as that turn's text."""
    content = message.get("content")
    if content is None and role == "assistant" and isinstance(message.get("refusal"), str):
        return message["refusal"]
    return content


def _content(value, param: str, model: str, role: str = "user") -> str:
    if value is None:
        # An assistant turn with only tool calls. Templates index `message.content` (Qwen3 tests
        # `'</think>' in message.content`), so it is an empty string, as vLLM sends it, not a missing key.
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: only text (and an assistant's refusal) is supported
        return "".join(_part_text(part, param, model, role) for part in value)
    raise bad_request(f"`{param}` must be a string or an array of text parts.", param)


def _part_text(part, param: str, model: str, role: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
        return part["refusal"]  # what the assistant said when it refused, as OpenAI's replies carry it
    if kind in IMAGE_PART_TYPES:
        raise bad_request(f"`{param}` holds an image, but the model `{model}` has no vision: it reads text "
                          f"only. Send text parts ({{\"type\": \"text\", \"text\": ...}}).", param,
                          "image_input_not_supported")
    if isinstance(kind, str) and kind not in ("text", "refusal"):
        raise bad_request(f"`{param}` holds a part of type `{kind}`, but the model `{model}` reads text only. Send "
                          f"text parts ({{\"type\": \"text\", \"text\": ...}}).", param, "unsupported_content_type")
    raise bad_request(f"`{param}` may hold only text parts ({{\"type\": \"text\", \"text\": ...}}).", param)


def _prompts(value) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (a string, an array of strings, an array of token ids, an array of
    arrays of token ids) as a list of prompts, each text or token ids."""
    if isinstance(value, str):
        return [_prompt(value, "prompt")]
    if not isinstance(value, list) or not value:
        raise bad_request("`prompt` must be a non-empty string, an array of strings, an array of token ids or an "
                          "array of arrays of token ids.", "prompt")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [_prompt(value, "prompt")]
    return [_prompt(item, f"prompt[{i}]") for i, item in enumerate(value)]


def _prompt(value, param: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad_request(f"`{param}` must not be empty.", param)
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return list(value)
    raise bad_request(f"`{param}` must be a non-empty string or a non-empty array of token ids (non-negative "
                      f"integers).", param)


def _stop(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and len(value) <= MAX_STOP_STRINGS and all(isinstance(s, str) for s in value):
        return list(value)
    raise bad_request(f"`stop` must be a string or an array of at most {MAX_STOP_STRINGS} strings.", "stop")


def _logprobs(document: dict, chat: bool) -> int | None:
    if chat:
        if not _bool(document.get("logprobs"), "logprobs"):
            if document.get("top_logprobs") is not None:
                raise bad_request("`top_logprobs` needs `logprobs: true`.", "top_logprobs")
            return None
        top = _int(document.get("top_logprobs"), "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)
        return top or 0
    return _int(document.get("logprobs"), "logprobs", 0, MAX_LOGPROBS_COMPLETIONS)


def _stream_options(value, stream: bool) -> bool:
    if value is None:
        return False
    if not isinstance(value, dict):
        raise bad_request("`stream_options` must be an object.", "stream_options")
    if not stream:
        raise bad_request("`stream_options` is only allowed with `stream: true`.", "stream_options")
    return _bool(value.get("include_usage"), "stream_options.include_usage")


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON object keys (strings), biases in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("`logit_bias` must be an object mapping token ids to biases in [-100, 100].", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"`logit_bias` may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.", "logit_bias")
    bias = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"`logit_bias` keys must be token ids (non-negative integers); got {key!r}.",
                              "logit_bias")
        bias[int(key)] = _number(amount, f"logit_bias.{key}", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if bias[int(key)] is None:
            raise bad_request(f"`logit_bias.{key}` must be a number in [-100, 100].", "logit_bias")
    return bias


def _response_format(value) -> GrammarSpec | None:
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {name, schema,
    strict}}` as the grammar the output must follow (a schema the grammar library refuses is a 400)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_spec({"type": "object"})
    if kind != "json_schema":
        raise bad_request("`response_format.type` must be \"text\", \"json_object\" or \"json_schema\".",
                          "response_format")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"`{param}` must be an object with `name` and `schema`.", param)
    name = spec.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad_request(f"`{param}.name` must be 1-64 letters, digits, underscores or dashes.", f"{param}.name")
    if spec.get("strict") is not None:
        _bool(spec.get("strict"), f"{param}.strict")  # strict or not, the output follows the schema
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(f"`{param}.schema` must be a JSON schema object.", f"{param}.schema")
    return _checked(json_schema_spec(schema), f"{param}.schema")


def _checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    problem = check_grammar(spec)
    if problem is not None:
        raise bad_request(f"`{param}` cannot be enforced: {problem.strip()}", param, "invalid_schema")
    return spec


def _check_tool_schemas(tools: list[dict], named: str | None, strict_only: bool = False) -> None:
    """The parameters of every function a call's grammar constrains must compile: those a required call may
    use, or (`strict_only`, tool_choice auto) those of the `strict` functions."""
    for i, tool in enumerate(tools):
        function = tool["function"]
        if named is not None and function["name"] != named:
            continue
        if strict_only and function.get("strict") is not True:
            continue
        parameters = function.get("parameters")
        param = f"tools[{i}].function.parameters"
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"`{param}` must be a JSON schema object.", param)
        if parameters:
            _checked(json_schema_spec(parameters), param)


def _tool_choice(value, tools: list[dict] | None) -> tuple[str | None, list[dict] | None]:
    """"none" | "auto" | "required" | a function's name (None without tools: "auto" is OpenAI's default
    then), and the tools the model is offered: `allowed_tools` narrows them to the ones it names."""
    if value is None:
        return ("auto" if tools else None), tools
    if not tools:
        raise bad_request("`tool_choice` needs `tools`.", "tool_choice")
    if value in TOOL_CHOICES:
        return value, tools
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        return _allowed_tools(value.get("allowed_tools"), tools)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\", {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}} or {\"type\": \"allowed_tools\", \"allowed_tools\": "
                          "{\"mode\", \"tools\"}}.", "tool_choice")
    if name not in _tool_names(tools):
        raise bad_request(f"`tool_choice` names the function `{name}`, which is not in `tools`.", "tool_choice")
    return name, tools


def _allowed_tools(value, tools: list[dict]) -> tuple[str, list[dict]]:
    """OpenAI's `allowed_tools`: the model may call only the named tools (`mode` "required": must call
    one). The model is offered only those, so it cannot call another; the rest of `tools` stays unread."""
    param = "tool_choice.allowed_tools"
    if not isinstance(value, dict) or value.get("mode") not in ("auto", "required") or \
            not isinstance(value.get("tools"), list) or not value["tools"]:
        raise bad_request(f"`{param}` must be {{\"mode\": \"auto\" or \"required\", \"tools\": [{{\"type\": "
                          f"\"function\", \"function\": {{\"name\": ...}}}}, ...]}}.", param)
    names = set()
    for i, tool in enumerate(value["tools"]):
        name = _allowed_tool_name(tool)
        if name is None:
            raise bad_request(f"`{param}.tools[{i}]` must be {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}; only function tools are supported.", f"{param}.tools[{i}]")
        if name not in _tool_names(tools):
            raise bad_request(f"`{param}.tools[{i}]` names the function `{name}`, which is not in `tools`.",
                              f"{param}.tools[{i}]")
        names.add(name)
    return value["mode"], [tool for tool in tools if tool["function"]["name"] in names]


def _allowed_tool_name(tool) -> str | None:
    """The function an allowed tool names: Chat's {"type", "function": {"name"}} or Responses' {"type", "name"}."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else None


def _tool_names(tools: list[dict]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]
