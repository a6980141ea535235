"""Chat templates rendered the way Hugging Face `transformers`' `apply_chat_template` renders them.

A checkpoint's template is written against transformers' rendering environment, so a prompt is
only right when every piece of that environment is the same here:

- jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension
  (`{% break %}`, `{% continue %}`) and the `{% generation %}…{% endgeneration %}` block tag (it
  marks the assistant's text for training masks; rendering just outputs its body);
- globals `raise_exception(message)`, `strftime_now(format)`, a `dict` constructor and a
  `namespace` that refuses underscore-named attributes;
- a `tojson` filter taking `ensure_ascii` (default false), `indent`, `separators` and `sort_keys`,
  without jinja's HTML escaping;
- messages normalised first: keys whose value is None dropped (the OpenAI SDK's `model_dump()`
  writes `"tool_calls": null`), and a turn's reasoning given as `reasoning_content`, `thinking` or
  `reasoning` available under both `reasoning_content` and `thinking`;
- variables: `messages`, `tools`, `documents` (None when not given), `add_generation_prompt`,
  the tokenizer's named special tokens (`bos_token`, `eos_token`, …) and any extra keyword, which
  wins over a special token of the same name.

Checkpoints with several named templates use `tool_use` when tools are given and it exists,
`default` otherwise. Every failure while rendering, of whatever exception type, is a
`TemplateError` naming the problem: the caller answers 400, never 500.

A control token a client writes (a user typing `<|im_end|>` in a message) must reach the model as
the text it is, not as the token that ends a turn, or any user could forge a system turn. Before
rendering for tokenization, `mark_control_tokens` wraps each control token in the inputs' strings
in two private-use markers, as transformers' `apply_chat_template(..., sanitize_control_tokens=True)`
does; the tokenizer then encodes marked tokens as plain text (`engine.tokenizer`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import CheckpointError, InvalidRequestError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
# transformers' markers around a control token written in the inputs (Unicode private use, plane 15)
CONTROL_TOKEN_START, CONTROL_TOKEN_END = "\U000f0000", "\U000f0001"


class TemplateError(InvalidRequestError):
    """The chat template rejected the messages (it called raise_exception) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: outputs its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller) -> str:
        return caller()


def _raise_exception(message):
    raise TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictConstructor:
    """`dict(...)` for templates, without exposing the `dict` type itself to attribute access."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore-named attributes (a way to reach CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 — jinja's signature trick, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictConstructor(),
                       namespace=_Namespace)
    return env


# Statements that load another template by name, and their keyword
_TEMPLATE_FILE_NODES = {jinja2.nodes.Include: "include", jinja2.nodes.Extends: "extends",
                        jinja2.nodes.Import: "import", jinja2.nodes.FromImport: "from ... import"}

_ENV = _environment()  # rendering is thread-safe; compiling shares the environment's caches


def normalize_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template sees them: None-valued keys dropped, reasoning under both names."""
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TemplateError(f"each message must be an object with `role` and `content`, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def control_token_pattern(tokens) -> re.Pattern:
    """A regex matching any of `tokens`, longer ones first (a token wins over the tokens it contains)."""
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")  # (?!) never matches


def marked_token_pattern(tokens) -> re.Pattern:
    """A regex matching a marked token among `tokens` (the token is its group) or a lone marker (no group)."""
    start, end = CONTROL_TOKEN_START, CONTROL_TOKEN_END
    return re.compile(f"{start}({control_token_pattern(tokens).pattern}){end}|[{start}{end}]")


def mark_control_tokens(value, control_tokens: re.Pattern):
    """`value` (a string, or lists and dicts holding strings) with each control token in its strings wrapped in
    the markers; markers already in a string are dropped first, so a client cannot forge a marked token.
    Dict keys are left alone."""
    if isinstance(value, str):
        value = value.replace(CONTROL_TOKEN_START, "").replace(CONTROL_TOKEN_END, "")
        return control_tokens.sub(f"{CONTROL_TOKEN_START}\\g<0>{CONTROL_TOKEN_END}", value)
    if isinstance(value, dict):
        return {key: mark_control_tokens(item, control_tokens) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark_control_tokens(item, control_tokens) for item in value]
    return value


def _literal_text(parsed: jinja2.nodes.Template) -> str:
    """A template's raw text and string constants, joined by NULs so no search matches across two of them."""
    literals = {node.data for node in parsed.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in parsed.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


class ChatTemplate:
    """A checkpoint's chat template(s), compiled once; `render` gives the prompt text."""

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str]) -> None:
        self.sources = {"default": source} if isinstance(source, str) else dict(source)
        self.special_tokens = special_tokens
        self._compiled: dict[str, jinja2.Template] = {}
        self.literals: dict[str, str] = {}  # each template's literal text (where its control tokens are written)
        self.variables: set[str] = set()   # the names any of the templates reads from its context
        for name, text in self.sources.items():
            try:
                parsed = _ENV.parse(text)
                self._compiled[name] = _ENV.from_string(parsed)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"chat template {name!r} does not parse: {exc}") from exc
            self.literals[name] = _literal_text(parsed)
            self.variables |= jinja2.meta.find_undeclared_variables(parsed)
            for node in parsed.find_all(tuple(_TEMPLATE_FILE_NODES)):
                # transformers renders without a template loader too: such a template fails on every request
                raise CheckpointError(f"chat template {name!r} uses {{% {_TEMPLATE_FILE_NODES[type(node)]} %}} "
                                      f"(line {node.lineno}), which reads other template files; a chat template "
                                      f"must be self-contained")

    @property
    def source(self) -> str:
        """The text of the template used without tools (for detecting what a model family does)."""
        return self.sources.get("default") or next(iter(self.sources.values()))

    def select(self, tools) -> str:
        """The name of the template a request with (or without) `tools` renders with."""
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        if "default" in self._compiled:
            return "default"
        raise TemplateError(f"this model has several chat templates ({', '.join(sorted(self._compiled))}) and "
                            f"none named `default`")

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None,
               documents: list | None = None, **kwargs) -> str:
        if not messages:
            raise TemplateError("there are no messages to render; send at least one")
        template = self._compiled[self.select(tools)]
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TemplateError("documents must be objects (with `title` and `text`)")
        variables = {**self.special_tokens, **kwargs, "messages": normalize_messages(messages), "tools": tools,
                     "documents": documents, "add_generation_prompt": add_generation_prompt}
        try:
            return template.render(variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc}") from exc
        except Exception as exc:  # a template is code: TypeError, KeyError, ZeroDivisionError, ... all mean bad input
            raise TemplateError(f"the chat template failed on these messages ({type(exc).__name__}: {exc})") from exc
