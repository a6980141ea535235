"""Tool calls in the model's own format: recognised from the chat template, parsed from the output,
and forced by a grammar when the request requires a call.

Each model family writes tool calls its own way, and its chat template shows how (it renders the
assistant's earlier calls, and usually tells the model the format). Which format a model uses is
decided once per model, never guessed from the text it writes: an operator setting
(`tool_call_parsers` in the router config: model -> format name, or "none"), else the template.
Recognised formats (the stored templates in tests/engine/chat_templates use all of them):

| format | a call as the model writes it | templates |
|---|---|---|
| hermes | `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>` | Qwen2.5, Qwen3, Hermes 3 |
| llama3_json | `{"name": N, "parameters": A}` (one call) | Llama 3.1, 3.2 |
| mistral | `[TOOL_CALLS][{"name": N, "arguments": A}, ...]` | Mistral Nemo |
| mistral_v11 | `[TOOL_CALLS]N[ARGS]A` per call | Mistral Small 3.2 |
| granite | `<|tool_call|>[{"name": N, "arguments": A}, ...]` | Granite 3.x |
| command_r7b | `<|START_ACTION|>[{"tool_call_id": I, "tool_name": N, "parameters": A}]<|END_ACTION|>` | Command R7B |
| deepseek_v3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>A<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` | DeepSeek V3.1 |
| kimi_k2 | `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>A<|tool_call_end|>...` | Kimi K2 |

Templates not in this table (gpt-oss's harmony channels, Command R+'s `Action:` blocks, DeepSeek-R1's
fenced calls) are not recognised: their requests with `tool_choice: required` get a 400, and their
output is plain content.

With `tool_choice: required` or a named function the output is constrained (engine.grammar) to
exactly the format wrapping arguments that match the function's JSON schema, so it always parses.
With `auto` the output is parsed: text before the format's opening marker is content, and calls
that do not parse leave the whole output as content. With `auto` and a `strict` function (OpenAI's
promise that its calls follow its schema) the output is constrained too, but loosely: free text, in
which the marker's text cannot appear, or from the marker on calls of the offered functions (strict
ones' arguments follow their schema, the others' are any JSON object), like xgrammar's structural
tags: the grammar lets text run until the trigger, then shapes the call. Its cost, measured on this
project's 2-core CPU machine with a 128k-token vocabulary and four strict tools (one row, the engine's
CPU path): a free-text token's mask takes about 6 us (the library caches the mask of a state that
repeats), the first two steps about 0.9 ms each, the step that opens a call up to 10 ms once, and
the call itself about 10 us a token, as a required call does. Without a strict function there is no
grammar at all. With `auto` and a `response_format` (an OpenAI Agents SDK agent with an output type and
tools) the output is constrained to the final answer, JSON following the response format, or calls of the
offered functions from its first token on (strict or not, as above), and the parser looks for calls at
the start only, so JSON that holds the marker's text, or (Llama 3's bare JSON) has a `name`, stays the
answer. A reasoning model's block comes in front of each of these grammars (router.reasoning).
Markers that the grammar library
reads as special tokens are matched by token id, so the model writes them as the tokens it was
trained on and text cannot spell them out byte by byte.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

import llguidance

from engine.grammar import GrammarSpec, lark_json
from engine.tokenizer import ChatTokenizer

NO_PARSER = "none"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str   # JSON text, as OpenAI sends it
    id: str

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(short: bool = False) -> str:
    """OpenAI's shape; `short`: the 9 alphanumerics Mistral's templates require of replayed call ids."""
    return os.urandom(5).hex()[:9] if short else "call_" + os.urandom(12).hex()


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One family's way of writing calls. A call is either one JSON object (`name_key`, `args_key`) or,
    when `name_key` is empty, `call_begin` NAME `name_sep` ARGUMENTS `call_end`."""

    name: str
    detect: tuple[str, ...]      # all of these in the template text identify the format
    section_begin: str = ""      # opens the calls (the marker `auto` looks for, unless call_begin does)
    section_end: str = ""
    call_begin: str = ""
    call_end: str = ""
    separator: str = ""          # between calls
    array: bool = False          # calls form one JSON array
    name_key: str = "name"
    args_key: str = "arguments"
    name_prefix: str = ""        # name-prefixed calls: written before the name (kimi: "functions.")
    name_suffix_regex: str = ""  # what may follow the name when parsing (kimi: ":<index>")
    name_suffix_lark: str = ""   # and what the grammar of a required call writes there
    name_sep: str = ""
    parallel: bool = True        # the template can show several calls in one turn
    short_ids: bool = False      # call ids of 9 alphanumerics (the template refuses others when replayed)

    @property
    def marker(self) -> str:
        return self.section_begin or self.call_begin

    # -- parsing `auto` output ---------------------------------------------------------------

    def split(self, text: str, names: frozenset[str] | None = None) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, calls) when the text holds calls that parse, else None. `names`: the
        offered functions, where text that is no call of theirs is an answer (a JSON object with a `name`):
        a call must then name one and, as a JSON object, hold nothing but its name and arguments."""
        if self.marker:
            start = text.find(self.marker)
            if start < 0:
                return None
            content, body = text[:start], text[start:]
        else:  # a bare JSON call: the whole answer is the call
            content, body = "", text.strip()
            if not body.startswith("{"):
                return None
        try:
            calls = self._parse_calls(body, names)
        except (ValueError, KeyError, TypeError):
            return None
        return (content, calls) if calls else None

    def _parse_calls(self, body: str, names: frozenset[str] | None) -> list[ToolCall]:
        pos = _expect(body, 0, self.section_begin)
        if self.array:
            items, pos = _DECODER.raw_decode(body, pos)
            if not isinstance(items, list):
                raise ValueError("the calls are not a JSON array")
            calls = [self._object_call(item, names) for item in items]
        else:
            calls = []
            begin, separator = self.call_begin.strip(), self.separator.strip()
            while True:
                call, pos = self._one_call(body, pos, names)
                calls.append(call)
                pos = _skip_space(body, pos)
                following = _skip_space(body, pos + len(separator)) if separator and body.startswith(separator, pos) else pos
                if not begin or not body.startswith(begin, following):
                    break
                pos = following
        _expect(body.rstrip(), _skip_space(body, pos), self.section_end)
        return calls

    def _one_call(self, body: str, pos: int, names: frozenset[str] | None) -> tuple[ToolCall, int]:
        pos = _expect(body, _skip_space(body, pos), self.call_begin)
        if self.name_key:
            item, pos = _DECODER.raw_decode(body, _skip_space(body, pos))
            call = self._object_call(item, names)
        else:
            pattern = re.compile(re.escape(self.name_prefix) + r"([^\s\"'<>\[\]{}]+?)" + self.name_suffix_regex
                                 + re.escape(self.name_sep))
            match = pattern.match(body, pos)
            if match is None:
                raise ValueError("no function name")
            arguments, pos = _DECODER.raw_decode(body, _skip_space(body, match.end()))
            if not isinstance(arguments, dict):
                raise ValueError("arguments are not an object")
            if names is not None and match.group(1) not in names:
                raise ValueError("not an offered function")
            call = ToolCall(match.group(1), json.dumps(arguments, ensure_ascii=False), new_call_id(self.short_ids))
        return call, _expect(body, _skip_space(body, pos), self.call_end)

    def _object_call(self, item, names: frozenset[str] | None = None) -> ToolCall:
        name, arguments = item[self.name_key], item.get(self.args_key, {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError("a call needs a string name and object arguments")
        if names is not None and (name not in names or item.keys() - {self.name_key, self.args_key}):
            raise ValueError("not a call of an offered function")
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id(self.short_ids))

    # -- grammars: a required call, and `auto` with strict tools ----------------------------------

    def grammar(self, tools: list[dict], parallel: bool, tokenizer: ChatTokenizer) -> GrammarSpec:
        """Lark (llguidance's dialect) for one call, or one or more with `parallel`, of these tools."""
        lit = _Literals(tokenizer)
        rules = self._calls_rules(tools, parallel and self.parallel, lit)
        return GrammarSpec("lark", "\n".join([f"start: {lit(self.marker)} calls", *rules]))

    def auto_grammar(self, tools: list[dict], parallel: bool, tokenizer: ChatTokenizer) -> GrammarSpec:
        """Lark for `tool_choice: auto` with strict tools: free text, or (from the format's marker on, text
        before it kept) calls of these tools, to the end of the answer. Arguments follow the function's
        schema where the tool is `strict`, and are any JSON object where it is not. Free text cannot hold
        the marker without a call that parses following it, so whatever the parser takes for calls parses.
        A reasoning model's block goes in front as for any grammar (router.reasoning.with_reasoning)."""
        lit = _Literals(tokenizer)
        rules = [*self._free_text_rules(lit), *self._calls_rules(_as_enforced(tools), parallel and self.parallel, lit)]
        return GrammarSpec("lark", "\n".join(rules))

    def answer_or_calls_grammar(self, answer: GrammarSpec, tools: list[dict], parallel: bool,
                                tokenizer: ChatTokenizer) -> GrammarSpec:
        """Lark for `tool_choice: auto` with a response format (the Agents SDK's agent with an output type and
        tools): the final answer, JSON following `answer`'s schema, or calls of these tools from the first
        token on (strict tools' arguments following their schema, the others' any JSON object). Nothing comes
        before the calls, so the parser looks for them at the start only (ToolCallStream's `answer_names`):
        the JSON may hold the marker's text in a string. The answer cannot begin with a marker: compact JSON
        opens with `{`, `[`, `"`, a digit, `-` or a literal, and no marker of text does (`<...>`, `[TOOL_CALLS]`,
        where `[T` is no JSON); a bare JSON call (Llama 3) is told from an answer by its shape and name."""
        lit = _Literals(tokenizer)
        rules = [f"start: final_answer | {lit(self.marker)} calls",
                 f"final_answer: {lark_json(json.loads(answer.source))}",
                 *self._calls_rules(_as_enforced(tools), parallel and self.parallel, lit)]
        return GrammarSpec("lark", "\n".join(rules))

    def _free_text_rules(self, lit: _Literals) -> list[str]:
        """The `start` rule of an `auto` answer: text, or text up to the marker and then `calls`."""
        if not self.marker:  # bare JSON: the answer is a call exactly when it starts with "{" (after spaces)
            return ["start: TEXT | calls", r"TEXT: /\s*([^{\s](.|\n)*)?/"]
        # Text never holds the marker's text: the parser would read a call there that the grammar never shaped.
        trigger = self.marker.rstrip()
        text = [f"TEXT: ANY & ~(ANY {json.dumps(trigger)} ANY)", r"ANY: /(.|\n)*/"]
        opening = lit(self.marker)
        if opening.startswith("<["):  # the marker opens with a special token, which text cannot hold
            return [f"start: TEXT ({opening} calls)?", *text]
        # A marker in plain text: the lazy lexeme ends at its first occurrence.
        return [f"start: TEXT | head {lit(self.marker[len(trigger):])} calls",
                f"head[lazy]: ANY {json.dumps(trigger)}", *text]

    def _calls_rules(self, tools: list[dict], several: bool, lit: _Literals) -> list[str]:
        """Lark rules for `calls`: what follows the format's marker, to the end of the last call."""
        end = lit(self.section_end)
        if self.array:
            schema = {"type": "array", "minItems": 1,
                      "items": {"anyOf": [self._call_schema(t, i) for i, t in enumerate(tools)]}}
            if not several:
                schema["maxItems"] = 1
            return [f"calls: {lark_json(schema)} {end}"]
        # The marker opens the section, or (no section) it is the first call's own opening.
        first = "call" if self.section_begin else "call_body"
        more = f"({lit(self.separator)} call)*" if several else ""
        return [f"calls: {first} {more} {end}",
                f"call: {lit(self.call_begin)} call_body",
                "call_body: " + " | ".join(self._call_body(tool, i, lit) for i, tool in enumerate(tools))]

    def _call_schema(self, tool: dict, index: int) -> dict:
        function = tool["function"]
        properties = {self.name_key: {"const": function["name"]}, self.args_key: _parameters(function, index)}
        return {"type": "object", "properties": properties, "required": [self.name_key, self.args_key],
                "additionalProperties": False}

    def _call_body(self, tool: dict, index: int, lit: _Literals) -> str:
        """One tool's call after its opening: the call itself and its closing."""
        function = tool["function"]
        if self.name_key:
            inner = lark_json(self._call_schema(tool, index))
        else:
            inner = (f"{lit(self.name_prefix + function['name'])} {self.name_suffix_lark} {lit(self.name_sep)} "
                     f"{lark_json(_parameters(function, index))}")
        return f"({inner} {lit(self.call_end)})"


def has_strict_tool(tools: list[dict] | None) -> bool:
    """Some function is `strict`: its calls must follow its schema even where the model may answer in words."""
    return any(tool["function"].get("strict") is True for tool in tools or ())


def _as_enforced(tools: list[dict]) -> list[dict]:
    """The tools as a grammar under `auto` holds them: strict ones as sent, the others loose."""
    return [tool if tool["function"].get("strict") is True else _loose(tool) for tool in tools]


def _loose(tool: dict) -> dict:
    """A non-strict tool as an `auto` grammar with strict tools holds it: its name, any object as arguments."""
    return {"type": "function", "function": {"name": tool["function"]["name"], "parameters": {"type": "object"}}}


def _parameters(function: dict, index: int) -> dict:
    """The function's parameters schema as the grammar nests it. Its `$ref`s ("#", "#/$defs/...") point into
    the parameters, but the grammar places them inside a call object (or an array of calls), whose root
    has no `$defs` and is not the arguments; an `$id` makes the parameters the root their refs resolve
    against (one per tool, so two tools' `$defs` never meet). A schema with its own `$id` already is one."""
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        return {"type": "object"}
    return parameters if "$id" in parameters else {"$id": f"urn:edgefire:tool:{index}", **parameters}


def _expect(text: str, pos: int, literal: str) -> int:
    literal = literal.strip()
    if not literal:
        return pos
    if not text.startswith(literal, pos):
        raise ValueError(f"expected {literal!r}")
    return pos + len(literal)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class _Literals:
    """Lark for fixed text: a token the grammar library reads as special by id (its bytes are not text),
    the rest quoted."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._special = _grammar_special_tokens(tokenizer)

    def __call__(self, text: str) -> str:
        if not text:
            return ""
        parts, rest = [], text
        while rest:
            token = next((s for s in self._special if rest.startswith(s)), None)
            if token is not None:
                parts.append(f"<[{self._special[token]}]>")
                rest = rest[len(token):]
                continue
            cut = min((i for i in (rest.find(s) for s in self._special) if i > 0), default=len(rest))
            parts.append(json.dumps(rest[:cut]))
            rest = rest[cut:]
        return " ".join(parts)


@functools.lru_cache(maxsize=16)
def _grammar_special_tokens(tokenizer: ChatTokenizer) -> dict[str, int]:
    """The added tokens the grammar library reads as special tokens: text in a grammar never matches them,
    only their id does. The library's view decides, not the tokenizer's `special` flag: it also takes added
    tokens shaped `<...>` for special (Qwen's `<tool_call>` is added but not flagged), and a literal of their
    text would let the model spell the marker out byte by byte but never write the token it was trained on."""
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    try:
        library = llguidance.LLTokenizer(tokenizer.tokenizer.to_str())
    except (ValueError, RuntimeError):
        # A tokenizer the library cannot read gets no grammar on any site (the engine refuses it with its
        # own message); its flags are the best guess for a grammar that will not run.
        return {token.content: token_id for token_id, token in added.items() if token.special}
    return {token.content: token_id for token_id, token in added.items() if library.is_special_token(token_id)}


FORMATS = {f.name: f for f in (
    ToolCallFormat("hermes", ("<tool_call>", "</tool_call>"), call_begin="<tool_call>\n", call_end="\n</tool_call>",
                   separator="\n"),
    # Replayed turns carry `[CALL_ID]id` after the name; the model writes only name and arguments.
    ToolCallFormat("mistral_v11", ("[TOOL_CALLS]", "[ARGS]"), call_begin="[TOOL_CALLS]", name_key="",
                   name_suffix_regex=r"(?:\[CALL_ID\][A-Za-z0-9]+)?", name_sep="[ARGS]", short_ids=True),
    ToolCallFormat("mistral", ("[TOOL_CALLS]",), section_begin="[TOOL_CALLS]", array=True, short_ids=True),
    ToolCallFormat("granite", ("<|tool_call|>",), section_begin="<|tool_call|>", array=True),
    ToolCallFormat("command_r7b", ("<|START_ACTION|>", "tool_name"), section_begin="<|START_ACTION|>",
                   section_end="<|END_ACTION|>", array=True, name_key="tool_name", args_key="parameters"),
    ToolCallFormat("deepseek_v3", ("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>' + tool['function']['arguments']"),
                   section_begin="<｜tool▁calls▁begin｜>", section_end="<｜tool▁calls▁end｜>",
                   call_begin="<｜tool▁call▁begin｜>", call_end="<｜tool▁call▁end｜>", name_key="",
                   name_sep="<｜tool▁sep｜>"),
    ToolCallFormat("kimi_k2", ("<|tool_calls_section_begin|>",), section_begin="<|tool_calls_section_begin|>",
                   section_end="<|tool_calls_section_end|>", call_begin="<|tool_call_begin|>",
                   call_end="<|tool_call_end|>", name_key="", name_prefix="functions.", name_suffix_regex=":[0-9]+",
                   name_suffix_lark="/:[0-9]+/", name_sep="<|tool_call_argument_begin|>"),
    ToolCallFormat("llama3_json", ('"name": function name, "parameters"',), args_key="parameters", parallel=False),
)}


def parser_names() -> list[str]:
    return sorted({*FORMATS, NO_PARSER})


def tool_call_format(tokenizer: ChatTokenizer, setting: str | None = None) -> ToolCallFormat | None:
    """The model's tool-call format from the operator's setting, else from its chat template."""
    if setting is not None:
        if setting == NO_PARSER:
            return None
        if setting not in FORMATS:
            raise ValueError(f"unknown tool-call format {setting!r}; known: {', '.join(parser_names())}")
        return FORMATS[setting]
    if tokenizer.template is None:
        return None
    text = "\n".join(tokenizer.template.sources.values())
    return next((f for f in FORMATS.values() if all(marker in text for marker in f.detect)), None)


class ToolCallStream:
    """One answer's text split into content and tool calls as it streams.

    `add(text)` returns the content safe to send now: text before the format's marker, holding back a
    tail that could still be the start of the marker. From the marker on, text is kept until `finish`,
    which parses the calls; calls that do not parse come back as content. With `forced` (a required
    call) the whole answer is the calls. Without `parallel` (`parallel_tool_calls: false`) an answer holds
    at most one call: the first, when a model left free (`auto`) writes several. With `answer_names` (the
    offered functions, under `auto` with a response format) the answer is JSON unless it opens with calls
    of those functions: calls are looked for at its start only (a bare JSON call: an object of just a
    function's name and arguments), and the JSON streams as content once it is known to be no call.
    """

    def __init__(self, fmt: ToolCallFormat, forced: bool = False, parallel: bool = True,
                 answer_names: frozenset[str] | None = None) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.answer_names = answer_names
        self._in_calls = forced
        self._decided = forced       # calls looked for at the start only: whether the answer opens with them is known
        self._pending = ""           # content held back
        self._calls_text = ""

    def add(self, text: str) -> str:
        if self._in_calls:
            self._calls_text += text
            return ""
        self._pending += text
        if self._decided:
            return self._take(len(self._pending))
        if not self.fmt.marker or self.answer_names is not None:
            return self._decide_at_start()
        marker = self.fmt.marker
        start = self._pending.find(marker)
        if start >= 0:
            self._in_calls, self._calls_text = True, self._pending[start:]
            return self._take(start, keep=False)
        hold = next((n for n in range(min(len(marker) - 1, len(self._pending)), 0, -1)
                     if marker.startswith(self._pending[-n:])), 0)
        return self._take(len(self._pending) - hold)

    def _decide_at_start(self) -> str:
        """Calls only at the answer's start (after blanks): its opening, the marker or a bare call's "{"."""
        opening = self.fmt.marker or "{"
        stripped = self._pending.lstrip()
        if len(stripped) < len(opening) and opening.startswith(stripped):
            return ""  # blank, or what could still become the opening
        self._decided = True
        if stripped.startswith(opening):
            self._in_calls, self._calls_text, self._pending = True, self._pending, ""
            return ""
        return self._take(len(self._pending))

    def _take(self, upto: int, keep: bool = True) -> str:
        out = self._pending[:upto]
        self._pending = self._pending[upto:] if keep else ""
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) at the end of the answer."""
        if not self._in_calls:
            return self._take(len(self._pending)), []
        parsed = self.fmt.split(self._calls_text, self.answer_names)
        if parsed is None:
            return self._calls_text, []
        content, calls = parsed
        return content, calls if self.parallel else calls[:1]


def tool_call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Stream deltas of finished calls, shaped as OpenAI streams them: each call opens with its index, id,
    type and name (empty arguments), then its arguments follow."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas
