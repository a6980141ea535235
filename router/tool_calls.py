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
With `auto` the output is parsed: text before the format's opening marker, and any the model writes
after its calls, is content (OpenAI carries content beside calls), and calls that do not parse leave the
whole output as content. Llama 3's bare JSON has no marker, so an object is a call only when it names an
offered function and holds nothing but its name and parameters; any other object is an answer. An answer
cut by max_tokens keeps the calls it completed and the one it ends in, with the arguments written so far,
and its finish reason "length", as OpenAI's; none of a call's markup becomes content.
With `auto` and a `strict` function (OpenAI's promise that its calls follow its schema) the output is
constrained too, but loosely: free text, in which the marker's text cannot appear, or from the marker on
calls of the offered functions (strict ones' arguments follow their schema, the others' are any JSON
object), like xgrammar's structural tags: the grammar lets text run until the trigger, then shapes the
call. Its cost, measured on this project's 2-core CPU machine with a 128k-token vocabulary and four
strict tools (one row, the engine's CPU path): a free-text token's mask takes about 6 us (the library
caches the mask of a state that repeats), the first two steps about 0.9 ms each, the step that opens a
call up to 10 ms once, and the call itself about 10 us a token, as a required call does. Without a strict
function there is no grammar at all. With `auto` and a `response_format` (an OpenAI Agents SDK agent with
an output type and tools) the output is constrained to the final answer, JSON following the response
format, or calls of the offered functions from its first token on (strict or not, as above), and the
parser looks for calls at the start only, so JSON that holds the marker's text, or (Llama 3's bare JSON)
has a `name`, stays the answer. A reasoning model's block comes in front of each of these grammars
(router.reasoning). Markers that the grammar library reads as special tokens are matched by token id, so
the model writes them as the tokens it was trained on and text cannot spell them out byte by byte.
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

    # -- parsing the output ----------------------------------------------------------------------

    def split(self, text: str, names: frozenset[str] | None = None,
              cut: bool = False) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) when the text holds calls that parse, else None (the whole text is then content).
        Content is the text before the calls and any the model wrote between or after them, as written: OpenAI
        carries content beside calls, and dropping it would lose words the model meant for the user. `names`:
        the functions a call may name, where text that is no call of theirs is content (a JSON object with a
        `name`): a call must then name one and, as a JSON object, hold nothing but its name and arguments.

        `cut`: the answer was cut short (max_tokens). The calls it completed come back as calls, and the one it
        ends inside comes back with the arguments written so far (what a client streaming the call has been
        sent), as OpenAI returns a call cut by max_tokens. Cut before that call's name is complete, the call is
        left out, and so is its markup: it is the start of a call, no words for the user, and a client would
        show it as the answer; with no call complete that leaves (content, [])."""
        if not self.marker:  # a bare JSON call opens the answer, or there is none
            text = text.lstrip()
            if not text.startswith("{"):
                return None
        content, calls, rest = "", [], text
        while True:
            start = rest.find(self.marker) if self.marker else (-1 if calls else 0)
            if start < 0 and cut and rest.strip() and self.marker.startswith(rest.lstrip()):
                return content, calls  # ended inside the next marker (a required call's, or after calls)
            if start < 0:
                break
            if rest[:start].strip():
                content += rest[:start]
            try:
                rest = rest[start:][self._parse_calls(rest[start:], names, cut, calls):]
            except _Ended as ended:
                calls += [ended.call] if ended.call is not None else []
                return content, calls
            except (ValueError, KeyError, TypeError):
                return None
        if not calls:
            return None
        return content + rest.lstrip(), calls  # the blank between the calls and more words is layout

    def _parse_calls(self, body: str, names: frozenset[str] | None, cut: bool, calls: list[ToolCall]) -> int:
        """Appends the calls that open `body` to `calls`; the end of the last one (of its section)."""
        pos = _expect(body, 0, self.section_begin, cut)
        if self.array:
            pos = _expect(body, _skip_space(body, pos), "[", cut)
            while True:
                call, pos = self._object_call_at(body, _skip_space(body, pos), names, cut)
                calls.append(call)
                pos = _skip_space(body, pos)
                if not body.startswith(",", pos):
                    break
                pos += 1
            pos = _expect(body, pos, "]", cut)
        else:
            begin, separator = self.call_begin.strip(), self.separator.strip()
            while True:
                call, pos = self._one_call(body, pos, names, cut)
                calls.append(call)
                pos = _skip_space(body, pos)
                following = _skip_space(body, pos + len(separator)) if separator and body.startswith(separator, pos) else pos
                if cut and begin and following < len(body) and begin.startswith(body[following:]):
                    raise _Ended()  # ended inside the next call's opening
                if not begin or not body.startswith(begin, following):
                    break
                pos = following
        return _expect(body, _skip_space(body, pos), self.section_end, cut)

    def _one_call(self, body: str, pos: int, names: frozenset[str] | None, cut: bool) -> tuple[ToolCall, int]:
        pos = _skip_space(body, _expect(body, _skip_space(body, pos), self.call_begin, cut))
        if self.name_key:
            call, pos = self._object_call_at(body, pos, names, cut)
        else:
            call, pos = self._named_call_at(body, pos, names, cut)
        try:
            return call, _expect(body, _skip_space(body, pos), self.call_end, cut)
        except _Ended:
            raise _Ended(call) from None  # its arguments are whole: only the closing was cut

    def _named_call_at(self, body: str, pos: int, names: frozenset[str] | None,
                       cut: bool) -> tuple[ToolCall, int]:
        """`NAME name_sep ARGUMENTS` at `pos`."""
        pattern = re.compile(re.escape(self.name_prefix) + r"([^\s\"'<>\[\]{}]+?)" + self.name_suffix_regex
                             + re.escape(self.name_sep))
        match = pattern.match(body, pos)
        if match is None:
            if cut and self._name_so_far(body[pos:]):
                raise _Ended()
            raise ValueError("no function name")
        name = match.group(1)
        if names is not None and name not in names:
            raise ValueError("not an offered function")
        start = _skip_space(body, match.end())
        try:
            arguments, pos = _DECODER.raw_decode(body, start)
        except ValueError:
            if cut and _object_so_far(body[start:]):
                raise _Ended(ToolCall(name, body[start:], new_call_id(self.short_ids))) from None
            raise
        if not isinstance(arguments, dict):
            raise ValueError("arguments are not an object")
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id(self.short_ids)), pos

    def _name_so_far(self, text: str) -> bool:
        """Whether `text` could still grow into a call's name and its separator (the answer ended inside them)."""
        sep = self.name_sep
        head = text[:len(text) - next((k for k in range(min(len(sep) - 1, len(text)), 0, -1)
                                       if text.endswith(sep[:k])), 0)]
        if len(head) <= len(self.name_prefix):
            return self.name_prefix.startswith(head)
        return head.startswith(self.name_prefix) and re.fullmatch(r"[^\s\"'<>\[\]{}]*",
                                                                   head[len(self.name_prefix):]) is not None

    def _object_call_at(self, body: str, pos: int, names: frozenset[str] | None,
                        cut: bool) -> tuple[ToolCall, int]:
        """A call written as one JSON object at `pos`."""
        try:
            item, end = _DECODER.raw_decode(body, pos)
        except ValueError:
            if not cut:
                raise
            raise _Ended(self._cut_object_call(body[pos:], names)) from None
        return self._object_call(item, names), end

    def _cut_object_call(self, text: str, names: frozenset[str] | None) -> ToolCall | None:
        """The call object the answer ended inside: its name and the arguments written so far, None while its
        name is not complete; a ValueError where the text is no call's beginning."""
        opening = re.compile(r'\{\s*' + re.escape(json.dumps(self.name_key)) + r'\s*:\s*').match(text)
        if opening is None:
            if _pieces_so_far(text, ["{", json.dumps(self.name_key), ":"]):
                return None
            raise ValueError("not a call")
        try:
            name, end = _DECODER.raw_decode(text, opening.end())
        except ValueError:
            if opening.end() == len(text) or text.startswith('"', opening.end()):
                return None  # ended before the name was whole
            raise
        if not isinstance(name, str) or (names is not None and name not in names):
            raise ValueError("not a call of an offered function")
        args_key = re.compile(r'\s*,\s*' + re.escape(json.dumps(self.args_key)) + r'\s*:\s*').match(text, end)
        if args_key is None:
            if _pieces_so_far(text[end:], [",", json.dumps(self.args_key), ":"]):
                return ToolCall(name, "", new_call_id(self.short_ids))
            raise ValueError("not a call")
        arguments = text[args_key.end():]
        if not _object_so_far(arguments):
            raise ValueError("arguments are not an object")
        try:  # the arguments are whole and only the call's closing was cut: as a whole call's
            parsed, _end = _DECODER.raw_decode(arguments)
            arguments = json.dumps(parsed, ensure_ascii=False)
        except ValueError:
            pass
        return ToolCall(name, arguments, new_call_id(self.short_ids))

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


class _Ended(Exception):
    """The answer (cut short) ended inside the calls: `call` is the one it ended in, as far as it got, or None
    when that call's name was not complete."""

    def __init__(self, call: ToolCall | None = None) -> None:
        super().__init__()
        self.call = call


def _expect(text: str, pos: int, literal: str, cut: bool = False) -> int:
    literal = literal.strip()
    if not literal:
        return pos
    if text.startswith(literal, pos):
        return pos + len(literal)
    if cut and literal.startswith(text[pos:]):
        raise _Ended()
    raise ValueError(f"expected {literal!r}")


def _pieces_so_far(text: str, pieces: list[str]) -> bool:
    """Whether `text` is all of `pieces` so far, blanks between them allowed: it ends before they are whole."""
    pos = 0
    for piece in pieces:
        pos = _skip_space(text, pos)
        if not text.startswith(piece, pos):
            return piece.startswith(text[pos:])
        pos += len(piece)
    return False


def _object_so_far(text: str) -> bool:
    """Arguments cut short: nothing yet, or what opens a JSON object."""
    return not text.strip() or text.lstrip().startswith("{")


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
    With `names` (the offered functions) a bare JSON call (Llama 3) must name one of them and hold nothing
    but its name and arguments: a model asked for a JSON document with a `name` field answers with one.
    """

    def __init__(self, fmt: ToolCallFormat, forced: bool = False, parallel: bool = True,
                 answer_names: frozenset[str] | None = None, names: frozenset[str] | None = None) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.answer_names = answer_names
        # Markers leave no doubt that a call is meant, so their calls are taken whatever they name.
        self.names = answer_names if answer_names is not None or fmt.marker else names
        self._forced = forced
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

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) at the end of the answer; `cut`: it was cut short by max_tokens
        (ToolCallFormat.split: the call it ends in comes back as far as it got)."""
        if not self._in_calls:
            return self._take(len(self._pending)), []
        parsed = self.fmt.split(self._calls_text, self.names, cut)
        # A bare JSON object cut before its name is whole may as well be an answer (only a required call is
        # known to be a call), so it stays content; a marker's text is no answer.
        if parsed is None or not (parsed[1] or self.fmt.marker or self._forced):
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
