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
| harmony | `<|channel|>commentary to=functions.N <|constrain|>json<|message|>A<|call|>` (a message; one call) | gpt-oss |
| glm45 | `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>` (KeyValueCalls) | GLM-4.5, 4.6 |
| qwen3_coder | `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n</tool_call>` (KeyValueCalls) | Qwen3-Coder, Qwen3.5 |
| seed_oss | `<seed:tool_call>\\n<function=N>\\n<parameter=K>V</parameter>\\n...</function>\\n</seed:tool_call>` (KeyValueCalls) | Seed-OSS |

Templates not in this table (Command R+'s `Action:` blocks, DeepSeek-R1's fenced calls) are not recognised:
their requests with `tool_choice: required` get a 400, and their output is plain content.

gpt-oss's calls are harmony messages, read by router.reasoning's HarmonySplit (the `harmony` reasoning parser,
which this format needs): a commentary message addressed to a recipient reaches the answer's text as
`<|start|>functions.N<|message|>A<|call|>`, whichever order its header had, and is parsed from there as the
other formats are (`<|call|>` ends the call, and the output: it is an end of sequence of gpt-oss). A recipient
outside `functions.` (the built-in browser and python tools, which a request never offers) names no function,
so its message is no call. Its grammars (HarmonyCalls) shape messages, not text inside the answer: a required
call is the call's message, `auto` with strict tools a final message of free text or the call's message (a
preamble may come first), and with a response format a final message of JSON or the call's message; the
optional analysis message comes in front (router.reasoning.harmony_grammar).

With `tool_choice: required` or a named function the output is constrained (engine.grammar) to
exactly the format wrapping arguments that match the function's JSON schema, so it always parses.
With `auto` the output is parsed: text before the format's opening marker, and any the model writes
after its calls, is content (OpenAI carries content beside calls); a stream sends the words after the calls
as they are written, holding back, as before them, only a tail that could still open more markup. A call
names an offered function: an answer with a call of one leaves out its calls of functions the request did not
offer (an empty name included; the router logs each and counts it in `edgefire_router_tool_calls_dropped`),
and their markup is no content, streamed or whole; an answer with none, or whose calls do not parse, is
content as the model wrote it. Once a call was sent, markup that breaks is dropped, never content
(ToolCallStream). With `logprobs`, only content tokens carry logprobs (OpenAI's `logprobs.content`): the
tokens of call markup carry none, and a chunk of a call's arguments no content (router.completions).
Llama 3's bare JSON has no
marker, so an object is a call only when it names an offered function and holds nothing but its name and
parameters, each once; any other object is an answer, and streams as content from the first character that
shows it (_BareCallScan): only what may still be a call is held back, and a call is sent once its object closes,
the words after it streaming as content (the answer holds one such call). An answer cut by max_tokens keeps the
calls it completed and the one it ends in, with the arguments written so far, and its finish reason "length",
as OpenAI's; none of a call's markup becomes content, nor does markup any answer ends in (the next call's
opening or the section's closing, begun before an end of sequence). A required call's answer is calls alone:
nothing of it is content.
A call's arguments are its JSON text as the model wrote it (OpenAI's are the model's text too), never decoded
and written again: a stream sends them as they are written (ToolCallStream), and its pieces join into exactly
the arguments the whole answer returns. GLM, Qwen3-Coder and Seed-OSS write no JSON object but a key/value pair
per argument: their arguments are the object built from the pairs (each value read by the function's schema,
KeyValueCalls), sent pair by pair as each value closes; Qwen3-Coder's slips (a call without its `<tool_call>`, a
value without its `</parameter>`) are read as the calls it meant.
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

import ast
import functools
import json
import os
import re
from dataclasses import dataclass, field, replace

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

    def with_tools(self, tools: list[dict]) -> ToolCallFormat:
        """The format as it reads one request's calls: the same, for formats whose arguments are JSON as written
        (KeyValueCalls reads each value by its function's schema)."""
        return self

    def arguments_scan(self, name: str, begin: int) -> _JsonPrefix:
        """What reads a call's arguments as they are written, from `begin` (the text after its name's markup)."""
        return _JsonPrefix(begin)

    def ended_arguments(self, arguments: str) -> str:
        """A call's arguments where the answer ended (not cut by max_tokens) inside it: as far as they got."""
        return arguments

    # -- parsing the output ----------------------------------------------------------------------

    def split(self, text: str, names: frozenset[str] | None = None,
              cut: bool = False) -> tuple[str, list[ToolCall]] | None:
        """(content, calls) when the text holds calls of offered functions that parse, else None (the whole text is
        then content). Content is the text before the calls and any the model wrote between or after them, as
        written: OpenAI carries content beside calls, and dropping it would lose words the model meant for the user.
        `names`: the functions a call may name. A call that names none of them (or an empty name) is dropped when
        the text holds a call of an offered function (its markup is no words either), and makes the text no calls
        when it does not. A bare JSON call (no marker: a JSON answer with a `name` field may look like one) must
        name an offered function and hold nothing but its name and arguments.

        `cut`: the answer was cut short (max_tokens). The calls it completed come back as calls, and the one it
        ends inside comes back with the arguments written so far (what a client streaming the call has been
        sent), as OpenAI returns a call cut by max_tokens. Cut before that call's name is complete, the call is
        left out, and so is its markup: it is the start of a call, no words for the user, and a client would
        show it as the answer; with no call complete that leaves (content, [])."""
        parsed = self.split_all(text, names, cut)
        if parsed is None:
            return None
        content, calls = parsed
        offered = [call for call in calls if _is_call_name(call.name, names)]
        return None if calls and not offered else (content, offered)

    def split_all(self, text: str, names: frozenset[str] | None = None,
                  cut: bool = False) -> tuple[str, list[ToolCall]] | None:
        """`split`, keeping the calls of functions not offered (after a marker any call that parses is one)."""
        if not self.marker:  # a bare JSON call opens the answer, or there is none
            text = text.lstrip()
            if not text.startswith("{"):
                return None
        content, calls, rest = "", [], text
        while True:
            start = self.calls_start(rest, names) if self.marker else (-1 if calls else 0)
            if start < 0 and rest.strip() and self.marker.startswith(rest.lstrip()):
                return content, calls  # ended inside the next marker (a required call's, or after calls)
            if start < 0:
                break
            if rest[:start].strip():
                content += rest[:start].lstrip() if calls else rest[:start]  # the blank after calls is layout
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
        pos = _expect(body, 0, self.section_begin)
        if self.array:
            pos = _expect(body, _skip_space(body, pos), "[")
            while True:
                call, pos = self._object_call_at(body, _skip_space(body, pos), names, cut)
                calls.append(call)
                pos = _skip_space(body, pos)
                if not body.startswith(",", pos):
                    break
                pos += 1
            pos = _expect(body, pos, "]")
        else:
            separator = self.separator.strip()
            while True:
                call, pos = self._one_call(body, pos, names, cut)
                calls.append(call)
                pos = _skip_space(body, pos)
                following = _skip_space(body, pos + len(separator)) if separator and body.startswith(separator, pos) else pos
                opens = self._call_opens(body, following)
                if opens is None:
                    raise _Ended()  # ended inside the next call's opening
                if not opens:
                    break
                pos = following
        return _expect(body, _skip_space(body, pos), self.section_end)

    def calls_start(self, text: str, names: frozenset[str] | None) -> int:
        """Where the first call in `text` opens (the format's marker), -1 where none does."""
        return text.find(self.marker)

    def held_back(self, text: str, names: frozenset[str] | None) -> int:
        """How many characters at the end of `text`, which holds no call's opening, may still grow into one (a
        stream holds them back from the content)."""
        marker = self.marker
        return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)

    def _call_opens(self, body: str, pos: int) -> bool | None:
        """Whether the next call of the same calls opens at `pos`, where the call before ended; None where the text
        ends inside its opening."""
        begin = self.call_begin.strip()
        if not begin or pos == len(body):
            return False
        return None if begin.startswith(body[pos:]) else body.startswith(begin, pos)

    def _one_call(self, body: str, pos: int, names: frozenset[str] | None, cut: bool) -> tuple[ToolCall, int]:
        pos = _skip_space(body, _expect(body, _skip_space(body, pos), self.call_begin))
        if self.name_key:
            call, pos = self._object_call_at(body, pos, names, cut)
        else:
            call, pos = self._named_call_at(body, pos, names, cut)
        try:
            return call, _expect(body, _skip_space(body, pos), self.call_end)
        except _Ended:
            raise _Ended(call) from None  # its arguments are whole: only the closing was cut

    def _named_call_at(self, body: str, pos: int, names: frozenset[str] | None,
                       cut: bool) -> tuple[ToolCall, int]:
        """`NAME name_sep ARGUMENTS` at `pos`."""
        match = self._name_pattern.match(body, pos)
        if match is None:
            if cut and self._name_so_far(body[pos:]):
                raise _Ended()
            raise ValueError("no function name")
        name = match.group(1)
        start = _skip_space(body, match.end())
        try:
            arguments, pos = _DECODER.raw_decode(body, start)
        except ValueError:
            if cut and _object_so_far(body[start:]):
                raise _Ended(ToolCall(name, body[start:], new_call_id(self.short_ids))) from None
            raise
        if not isinstance(arguments, dict):
            raise ValueError("arguments are not an object")
        return ToolCall(name, body[start:pos], new_call_id(self.short_ids)), pos

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
        return self._object_call(item, names, _member_texts(body, pos)), end

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
        if not self._readable_name(name, names):
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
            _parsed, end = _DECODER.raw_decode(arguments)
            arguments = arguments[:end]
        except ValueError:
            pass
        return ToolCall(name, arguments, new_call_id(self.short_ids))

    def _object_call(self, item, names: frozenset[str] | None, members: list[tuple[str, str]]) -> ToolCall:
        """The call of a whole JSON object: `members` are its (name, value text) pairs as written."""
        name, arguments = item[self.name_key], item.get(self.args_key, {})
        if not self._readable_name(name, names) or not isinstance(arguments, dict):
            raise ValueError("a call needs an offered function's name and object arguments")
        if not self.marker and names is not None and (item.keys() - {self.name_key, self.args_key}
                                                      or len(members) > len(item)):
            # A member written twice is no call either: the stream (_BareCallScan) tells an answer from a call
            # as the object is written, and a name or arguments written again later would undo what it told.
            raise ValueError("a bare JSON call holds only its name and arguments, each once")
        arguments_text = next((text for key, text in reversed(members) if key == self.args_key), "{}")
        return ToolCall(name, arguments_text, new_call_id(self.short_ids))

    def _readable_name(self, name, names: frozenset[str] | None) -> bool:
        """Whether a call read from the text may have this name: after a marker any string (`split` then drops the
        calls of functions not offered: their markup is no words), a bare JSON call only an offered function's
        (an object of another name is an answer)."""
        return isinstance(name, str) if self.marker else _is_call_name(name, names)

    # -- streaming: a call's opening and closing, read as they are written -------------------------

    def call_head(self, text: str, pos: int, first: bool) -> tuple[str, int] | None:
        """(name, where its arguments begin) of the call that opens at `pos` (where the calls begin when `first`,
        else where the call before ended), once the text holds its name and the "{" of its arguments; None while
        the text may still grow into them. A ValueError where no call opens there in the shape the format writes
        (its name before its arguments; other members may come first, as Command R7B's `tool_call_id`): whatever
        is there is left to `split` at the end of the answer."""
        if first:
            pieces = [self.section_begin, "[" if self.array else self.call_begin]
        elif self.array:
            pieces = [","]
        elif self.call_begin.strip():
            pieces = [self.call_begin]
        else:
            raise ValueError("one call only")
        pos = _through(text, pos, [piece.strip() for piece in pieces if piece.strip()])
        if pos is None:
            return None
        pos = _skip_space(text, pos)
        if self.name_key:
            pos = _through(text, pos, ["{"])
            pos = None if pos is None else _value_of(text, pos, self.name_key, self.args_key)
            if pos is None:
                return None
            match = _JSON_STRING.match(text, pos)
            if match is None:
                if text[pos:pos + 1] not in ("", '"'):
                    raise ValueError("the name is no string")
                return None
            name = json.loads(match.group())
            pos = _through(text, match.end(), [","])
            pos = None if pos is None else _value_of(text, pos, self.args_key, self.name_key)
        else:
            match = self._name_pattern.match(text, pos)
            if match is None:
                if self._name_so_far(text[pos:]):
                    return None
                raise ValueError("no function name")
            name, pos = match.group(1), match.end()
        if pos is None or _skip_space(text, pos) == len(text):
            return None
        pos = _skip_space(text, pos)
        if text[pos] != "{":
            raise ValueError("arguments are not an object")
        return name, pos

    def call_tail(self, text: str, pos: int) -> int | None:
        """The end of the call whose arguments end at `pos` (the rest of its object, the format's call end); None
        while the text may still grow into it, a ValueError where something else follows."""
        if self.name_key:
            pos = _object_end(text, pos)
        if pos is None or self.array or not self.call_end.strip():
            return pos
        return _through(text, pos, [self.call_end.strip()])

    def next_opening(self, text: str, pos: int) -> bool:
        """Whether the text at `pos`, where a call closed, opens the next call of the same calls, or may still
        grow into its opening."""
        opening = "," if self.array else self.call_begin.strip()
        if not opening:
            return False
        try:
            _through(text, pos, [opening])
        except ValueError:
            return False
        return True

    def calls_end(self, text: str, pos: int) -> int | None:
        """The end of the calls whose last call closed at `pos`: past the array's "]" and the section's closing
        where the format writes them; None while the text may still grow into that closing. A format that writes
        calls one by one (no array) ends them wherever anything but the next call's opening follows, its
        section's closing or not (a model that leaves the closing out goes on in words); in an array anything
        else is broken markup (a ValueError)."""
        closing = [piece for piece in ("]" if self.array else "", self.section_end.strip()) if piece]
        try:
            return _through(text, pos, closing)
        except ValueError:
            if self.array:
                raise
            return pos

    @property
    def _name_pattern(self) -> re.Pattern:
        """`NAME name_sep` (re's cache keeps it compiled)."""
        return re.compile(re.escape(self.name_prefix) + r"([^\s\"'<>\[\]{}]+?)" + self.name_suffix_regex
                          + re.escape(self.name_sep))

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
        calls = self._calls_rules(_as_enforced(tools), parallel and self.parallel, lit)
        return GrammarSpec("lark", "\n".join([*self._free_text_rules(lit, tools), *calls]))

    def answer_or_calls_grammar(self, answer: GrammarSpec, tools: list[dict], parallel: bool,
                                tokenizer: ChatTokenizer) -> GrammarSpec:
        """Lark for `tool_choice: auto` with a response format (the Agents SDK's agent with an output type and
        tools): the final answer, JSON following `answer`'s schema, or calls of these tools from the first
        token on (strict tools' arguments following their schema, the others' any JSON object). Nothing comes
        before the calls, so the parser looks for them at the start only (ToolCallStream's `answer_or_calls`):
        the JSON may hold the marker's text in a string. The answer cannot begin with a marker: compact JSON
        opens with `{`, `[`, `"`, a digit, `-` or a literal, and no marker of text does (`<...>`, `[TOOL_CALLS]`,
        where `[T` is no JSON); a bare JSON call (Llama 3) is told from an answer by its shape and name."""
        lit = _Literals(tokenizer)
        rules = [f"start: final_answer | {lit(self.marker)} calls",
                 f"final_answer: {lark_json(json.loads(answer.source))}",
                 *self._calls_rules(_as_enforced(tools), parallel and self.parallel, lit)]
        return GrammarSpec("lark", "\n".join(rules))

    def _free_text_rules(self, lit: _Literals, tools: list[dict]) -> list[str]:
        """The `start` rule of an `auto` answer: text, or text up to the marker and then `calls`."""
        if not self.marker:  # bare JSON: the answer is a call exactly when it starts with "{" (after spaces)
            return ["start: TEXT | calls", r"TEXT: /\s*([^{\s](.|\n)*)?/"]
        # Text never holds the marker's text: the parser would read a call there that the grammar never shaped;
        # nor (KeyValueCalls) the opening of a call written without its marker.
        trigger = self.marker.rstrip()
        unshaped = " | ".join(json.dumps(t) for t in (trigger, *self._bare_openings(tools)))
        text = [f"TEXT: ANY & ~(ANY ({unshaped}) ANY)", r"ANY: /(.|\n)*/"]
        opening = lit(self.marker)
        if opening.startswith("<["):  # the marker opens with a special token, which text cannot hold
            return [f"start: TEXT ({opening} calls)?", *text]
        # A marker in plain text: the lazy lexeme ends at its first occurrence.
        head = "ANY" if unshaped == json.dumps(trigger) else "TEXT"  # nor, where there are any, a bare opening
        return [f"start: TEXT | head {lit(self.marker[len(trigger):])} calls",
                f"head[lazy]: {head} {json.dumps(trigger)}", *text]

    def _bare_openings(self, tools: list[dict]) -> list[str]:
        """The text that opens a call of one of these tools without the format's marker (KeyValueCalls)."""
        return []

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


def _is_call_name(name, names: frozenset[str] | None) -> bool:
    """A call names a function: a name that is no string, or empty, makes it no call, and so does one that is not
    an offered function's (`names`)."""
    return isinstance(name, str) and bool(name) and (names is None or name in names)


def _expect(text: str, pos: int, literal: str) -> int:
    """The end of the format's `literal` markup at `pos`; _Ended where the text ends inside it: the answer ended
    in markup, cut short or not (a stop string, an end of sequence where a grammar shapes no calls), and what it
    wrote of it is no words for the user."""
    literal = literal.strip()
    if not literal:
        return pos
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
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


def _through(text: str, pos: int, pieces: list[str]) -> int | None:
    """The end of `pieces` written from `pos` on, blanks before each allowed; None while the text ends inside them,
    a ValueError where it holds something else."""
    for piece in pieces:
        pos = _skip_space(text, pos)
        if text.startswith(piece, pos):
            pos += len(piece)
        elif piece.startswith(text[pos:]):
            return None
        else:
            raise ValueError(f"expected {piece!r}")
    return pos


def _value_of(text: str, pos: int, key: str, before: str) -> int | None:
    """Where member `key`'s value begins in a JSON object being written, its members read from `pos` (just past
    its "{" or a ","); None while the text ends first, a ValueError where member `before` comes first or the
    text is no object's members."""
    while True:
        pos = _skip_space(text, pos)
        match = _JSON_STRING.match(text, pos)
        if match is None:
            if text[pos:pos + 1] not in ("", '"'):
                raise ValueError("no member's name")
            return None
        name = json.loads(match.group())
        start = _through(text, match.end(), [":"])
        if start is None:
            return None
        start = _skip_space(text, start)
        if name == key:
            return start
        if name == before:
            raise ValueError(f"{before!r} before {key!r}")
        pos = _value_end(text, start)
        pos = None if pos is None else _through(text, pos, [","])
        if pos is None:
            return None


def _object_end(text: str, pos: int) -> int | None:
    """The end of a JSON object being written whose members are read to `pos`; None while the text ends first."""
    while True:
        pos = _skip_space(text, pos)
        if pos == len(text):
            return None
        if text[pos] == "}":
            return pos + 1
        if text[pos] != ",":
            raise ValueError("expected ',' or '}'")
        pos = _skip_space(text, pos + 1)
        match = _JSON_STRING.match(text, pos)
        if match is None and text[pos:pos + 1] not in ("", '"'):
            raise ValueError("no member's name")
        start = None if match is None else _through(text, match.end(), [":"])
        pos = None if start is None else _value_end(text, _skip_space(text, start))
        if pos is None:
            return None  # a value that never ends is left to `split`


def _value_end(text: str, pos: int) -> int | None:
    try:
        return _DECODER.raw_decode(text, pos)[1]
    except ValueError:
        return None


def _member_texts(text: str, pos: int) -> list[tuple[str, str]]:
    """The members of the JSON object at `pos`, which is whole, in the order written: (name, its value's text)
    (a decoded object keeps the last of a name written twice)."""
    members = []
    pos = _skip_space(text, pos + 1)
    while text[pos] != "}":
        name, pos = _DECODER.raw_decode(text, pos)
        start = _skip_space(text, _skip_space(text, pos) + 1)  # past the ":"
        _value, pos = _DECODER.raw_decode(text, start)
        members.append((name, text[start:pos]))
        pos = _skip_space(text, pos)
        if text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    return members


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
        self.tokenizer = tokenizer
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


@dataclass(frozen=True, slots=True)
class HarmonyCalls(ToolCallFormat):
    """gpt-oss's calls (the module docstring): parsed from the text HarmonySplit makes of a call's message, and
    forced by grammars of the harmony messages the model itself writes."""

    def grammar(self, tools: list[dict], parallel: bool, tokenizer: ChatTokenizer) -> GrammarSpec:
        """One call's message (`<|call|>` ends the output: a harmony answer holds one call)."""
        lit = _Literals(tokenizer)
        return GrammarSpec("lark", "\n".join(["start: call_message", self._message_rule(tools, lit)]))

    def auto_grammar(self, tools: list[dict], parallel: bool, tokenizer: ChatTokenizer) -> GrammarSpec:
        """A final message of free text, or a call's message (strict tools' arguments following their schema, the
        others' any JSON object), a preamble to the user allowed before it. Free text holds no special token, so
        it never opens a message of its own."""
        lit = _Literals(tokenizer)
        preamble = f'{lit("<|channel|>commentary<|message|>")} FREE_TEXT {lit("<|end|><|start|>assistant")}'
        return GrammarSpec("lark", "\n".join([
            f'start: {lit("<|channel|>final<|message|>")} FREE_TEXT | ({preamble})? call_message',
            r"FREE_TEXT: /(.|\n)*/", self._message_rule(_as_enforced(tools), lit)]))

    def answer_or_calls_grammar(self, answer: GrammarSpec, tools: list[dict], parallel: bool,
                                tokenizer: ChatTokenizer) -> GrammarSpec:
        """A final message of JSON following `answer`'s schema, or a call's message."""
        lit = _Literals(tokenizer)
        return GrammarSpec("lark", "\n".join([
            f'start: {lit("<|channel|>final<|message|>")} final_answer | call_message',
            f"final_answer: {lark_json(json.loads(answer.source))}", self._message_rule(_as_enforced(tools), lit)]))

    @staticmethod
    def _message_rule(tools: list[dict], lit: _Literals) -> str:
        """`call_message`: a call's header as gpt-oss writes it (with `<|constrain|>json` where the vocabulary has
        the token, else as its template writes earlier calls), its arguments and `<|call|>`."""
        constrain = "<|constrain|>" in _grammar_special_tokens(lit.tokenizer)
        bodies = []
        for index, tool in enumerate(tools):
            name = tool["function"]["name"]
            header = (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" if constrain
                      else f" to=functions.{name}<|channel|>commentary json<|message|>")
            bodies.append(f"({lit(header)} {lark_json(_parameters(tool['function'], index))} {lit('<|call|>')})")
        return "call_message: " + " | ".join(bodies)


@dataclass(frozen=True, slots=True)
class KeyValueCalls(ToolCallFormat):
    """Calls written as a key/value pair per argument, not a JSON object; the markup of the name, the keys and the
    values is the format's, as each family's template writes it:

    - GLM-4.5/4.6 (`glm45`): `<tool_call>NAME`, `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per argument,
      `</tool_call>`; blanks between the pieces as GLM-4.6's template writes them (a newline after the name and after
      each pair, as both templates' tool instructions show) or none. Values other than strings as JSON (`tojson`).
    - Qwen3-Coder and Qwen3.5 (`qwen3_coder`): `<tool_call>`, `<function=NAME>`, `<parameter=KEY>` VALUE
      `</parameter>` per argument, `</function>`, `</tool_call>`, each on its own line: the template writes a newline
      after the value's opening and before its closing, which are layout (one of each, where written, is no part of
      the value: a value's own first and last blank lines are kept). Objects and arrays as JSON, other values with
      Jinja's `string` (Python's True, False, None).
    - Seed-OSS (`seed_oss`): the same inside `<seed:tool_call>...</seed:tool_call>`, a value right between its tags
      (no layout newlines), and every value but a string with Jinja's `string`: Python's text of a dict or list
      (`{'a': 1, 'b': False}`).

    Two slips of the models that write `<function=NAME>` are read as the calls they were meant to be:
    - `bare_calls`: a call written without its opening (`<function=NAME>` in the answer's text, no `<tool_call>`) is
      a call where the request offers a function of that name (another name's markup stays words); its closing
      (`</tool_call>`) may be left out too, `</function>` then ends it. A stream holds back a tail that may grow
      into such an opening as it does one of the marker, and `auto`'s grammar keeps the opening out of free text.
    - `unclosed_values`: a value whose closing tag is left out ends at a line that opens the next key
      (`\n<parameter=`) or closes the pairs (`\n</function>`), where it would otherwise run on to a later pair's
      closing and swallow that pair's markup. Text such as `a < b`, or a tag inside a line, stays in the value; the
      grammar writes no string value holding such a line, so what it accepts reads back as written.

    The arguments sent to the client are the JSON object built from the pairs, by one rule (`_value_json`): a value
    whose property the function's schema admits only strings for (`type: string`, an enum or const of strings) is
    that string, as written; any other value (another type, a union with strings, a property or a function the
    request gives no schema for) is its JSON text when it is JSON, else (`python_values`, formats whose template
    writes Python's text) the JSON of the Python literal it is when it is a dict, list, True, False or None, else
    the string. (A union with strings reads `7` as the number, which the template also writes for the string "7".)
    A stream sends a call's name once its name is written and each pair once its value closes; the object's `}`
    comes with the call's closing.

    Required calls and strict tools follow the schema in the grammar: the properties in the schema's order,
    the required ones always, the others optionally, then (where `additionalProperties` is not false) any more
    pairs under other keys, their values as `additionalProperties` says; a string value is any text without the
    value's closing tag (an enum or const of strings: those strings; minLength and maxLength kept), any other
    value JSON following its property's schema (`$ref`s resolved within the parameters). A string value's pattern
    and format are not enforced. The grammar writes the layout the template writes."""

    name_tags: tuple[str, str] = ("", "")   # around the name (GLM's: none, the name ends at a blank or a tag)
    key_tags: tuple[str, str] = ("", "")
    after_key: str = ""                     # what the grammar writes between a key's and its value's tags
    value_tags: tuple[str, str] = ("", "")  # an empty opening: the value starts right after the key's closing
    value_newlines: bool = False            # a newline after the value's opening and before its closing is layout
    pairs_end: str = ""                     # closes the pairs, before the call's closing (`</function>`)
    python_values: bool = False             # the template writes non-strings as Python's text (Jinja's `string`)
    bare_calls: bool = False                # a call may open at its name's markup, its call_begin left out
    unclosed_values: bool = False           # a value may end at a line opening the next key or the pairs' closing
    schemas: dict | None = field(default=None, compare=False)  # function name -> its parameters (with_tools)

    def with_tools(self, tools: list[dict]) -> KeyValueCalls:
        return replace(self, schemas={tool["function"]["name"]: tool["function"].get("parameters")
                                      for tool in tools})

    def arguments_scan(self, name: str, begin: int) -> _KeyValuePrefix:
        return _KeyValuePrefix(self, name, begin)

    def ended_arguments(self, arguments: str) -> str:
        """The object of the pairs read (whole pairs, `{"K": V, ...` or nothing), closed: its `}` comes with the
        call's closing, which an answer that ended inside the call (an end of sequence, a stop string, broken
        markup) never wrote, and its finish reason says "tool_calls", so the arguments must parse."""
        try:
            json.loads(arguments)
        except ValueError:
            return (arguments or "{") + "}"
        return arguments

    # -- parsing -----------------------------------------------------------------------------------

    def _one_call(self, body: str, pos: int, names: frozenset[str] | None, cut: bool) -> tuple[ToolCall, int]:
        at = _skip_space(body, pos)
        pos = at if self._bare_at(body, at) else _expect(body, at, self.call_begin)
        head = self._name_at(body, pos)
        if head is None:
            name = None if self.name_tags[0].strip() else _KV_NAME.match(body, _skip_space(body, pos))
            if cut or name is None:
                raise _Ended()
            # The answer ended (not cut) right after a name: a call of no arguments without its closing.
            raise _Ended(ToolCall(name.group(), "{}", new_call_id(self.short_ids)))
        scan = self.arguments_scan(*head)
        scan.read(body)
        if scan.broken:
            raise ValueError("no key/value call")
        if scan.whole:
            return ToolCall(head[0], scan.arguments(body), new_call_id(self.short_ids)), scan.end
        if scan.closing(body, ended=not cut):  # the pairs are whole: only the call's closing was cut or left out
            raise _Ended(ToolCall(head[0], scan.closed(), new_call_id(self.short_ids)))
        if cut:
            raise _Ended(ToolCall(head[0], scan.arguments(body), new_call_id(self.short_ids)))
        raise ValueError("the call does not close")

    @property
    def _name_opening(self) -> str:
        return self.name_tags[0].strip()

    def _bare_at(self, text: str, pos: int) -> bool:
        """Whether a call written without its opening (`bare_calls`) opens at `pos`."""
        return self.bare_calls and bool(self._name_opening) and text.startswith(self._name_opening, pos)

    @property
    def _bare_pattern(self) -> re.Pattern:
        """A bare call's opening: the name's markup (re's cache keeps it compiled)."""
        return re.compile(re.escape(self._name_opening) + "(" + _KV_NAME.pattern + ")" + re.escape(self.name_tags[1]))

    def calls_start(self, text: str, names: frozenset[str] | None) -> int:
        """The marker, or before it the name's markup of an offered function's call written without it."""
        start = text.find(self.marker)
        if self.bare_calls and names:
            for match in self._bare_pattern.finditer(text, 0, len(text) if start < 0 else start):
                if match.group(1) in names:
                    return match.start()
        return start

    def held_back(self, text: str, names: frozenset[str] | None) -> int:
        held = ToolCallFormat.held_back(self, text, names)
        if not (self.bare_calls and names):
            return held
        openings = [self._name_opening + name + self.name_tags[1] for name in names]
        pos = text.find("<", len(text) - min(max(map(len, openings)) - 1, len(text)))
        while 0 <= pos < len(text) - held:
            if any(opening.startswith(text[pos:]) for opening in openings):
                return len(text) - pos
            pos = text.find("<", pos + 1)
        return held

    def _call_opens(self, body: str, pos: int) -> bool | None:
        opens = ToolCallFormat._call_opens(self, body, pos)
        if opens is not False or not self.bare_calls or pos == len(body):
            return opens
        return None if self._name_opening.startswith(body[pos:]) else self._bare_at(body, pos)

    def _bare_openings(self, tools: list[dict]) -> list[str]:
        if not self.bare_calls:
            return []
        return [self._name_opening + tool["function"]["name"] + self.name_tags[1] for tool in tools]

    def _name_at(self, text: str, pos: int) -> tuple[str, int] | None:
        """(the call's name, the end of its markup) at `pos`, once what follows it shows it whole (its closing tag;
        without one, a blank or a tag); None while it may go on; a ValueError where no name is."""
        opening, closing = self.name_tags[0].strip(), self.name_tags[1]
        pos = _skip_space(text, pos)
        if not text.startswith(opening, pos):
            if opening.startswith(text[pos:]):
                return None
            raise ValueError("no function name")
        pos += len(opening)
        match = _KV_NAME.match(text, pos)
        if match is None or match.end() == len(text):
            if pos == len(text) or match is not None:
                return None
            raise ValueError("no function name")
        if not closing:
            return match.group(), match.end()
        if text[match.end()].isspace():
            raise ValueError("a blank inside the name's markup")
        end = _through(text, match.end(), [closing])
        return None if end is None else (match.group(), end)

    @property
    def _closing(self) -> list[str]:
        """The pieces that close a call's pairs, blanks allowed before each."""
        return [piece.strip() for piece in (self.pairs_end, self.call_end) if piece.strip()]

    def _closing_end(self, text: str, pos: int) -> int | None:
        """The end of the call's closing at `pos` (`_through`'s answers); with `bare_calls` the pairs' closing may
        end the call alone, where anything but the call's closing follows it."""
        closing = self._closing
        if not self.bare_calls or len(closing) < 2:
            return _through(text, pos, closing)
        end = _through(text, pos, closing[:1])
        if end is None:
            return None
        try:
            return _through(text, end, closing[1:])
        except ValueError:
            return end

    @property
    def _value_breaks(self) -> tuple[str, ...]:
        """What ends a value left without its closing tag (`unclosed_values`): a line opening the next key or
        closing the pairs."""
        if not self.unclosed_values:
            return ()
        return tuple(NL + tag.strip() for tag in (self.key_tags[0], self.pairs_end) if tag.strip())

    def _schema_of(self, name: str) -> tuple[dict, dict]:
        """(the function's parameters, the schemas of its properties by name), {} where the request gave none."""
        parameters = (self.schemas or {}).get(name)
        if not isinstance(parameters, dict):
            return {}, {}
        properties = parameters.get("properties")
        return parameters, properties if isinstance(properties, dict) else {}

    def _value_json(self, parameters: dict, properties: dict, key: str, text: str) -> str:
        """One pair's value as JSON text (the rule in the class docstring)."""
        schema = properties.get(key, parameters.get("additionalProperties"))
        if _only_strings(schema, parameters):
            return json.dumps(text, ensure_ascii=False)
        value = text.strip()
        try:
            json.loads(value, parse_constant=_no_constant)
        except ValueError:
            literal = _python_literal(value) if self.python_values else None
            return json.dumps(text, ensure_ascii=False) if literal is None else literal
        return value

    # -- streaming -----------------------------------------------------------------------------------

    def call_head(self, text: str, pos: int, first: bool) -> tuple[str, int] | None:
        """(name, where its pairs begin) once the name is whole: its arguments are read from the pairs."""
        at = _skip_space(text, pos)
        if self._bare_at(text, at):
            return self._name_at(text, at)
        if self.bare_calls and self._name_opening.startswith(text[at:]):
            return None
        pos = _through(text, pos, [self.call_begin.strip()])
        return None if pos is None else self._name_at(text, pos)

    def next_opening(self, text: str, pos: int) -> bool:
        at = _skip_space(text, pos)
        return at == len(text) or self._call_opens(text, at) is not False

    def call_tail(self, text: str, pos: int) -> int | None:
        return pos  # the scan of the pairs read the call's closing

    # -- grammars ------------------------------------------------------------------------------------

    def _calls_rules(self, tools: list[dict], several: bool, lit: _Literals) -> list[str]:
        rules = ToolCallFormat._calls_rules(self, tools, several, lit)
        for index, tool in enumerate(tools):
            rules += self._pair_rules(tool["function"], index, lit)
        closing = self._value_closing(lit, after_text=True)
        # A closing that is a special token cannot be in text; one of plain text ends the lazy lexeme first.
        string_value = "string_value" if closing.startswith("<[") else "string_value[lazy]"
        return [*rules, f"{string_value}: ARG_TEXT {closing}", "ARG_TEXT: " + self._value_text(r"(.|\n)*", lit)]

    def _value_closing(self, lit: _Literals, after_text: bool = False) -> str:
        """The value's closing tag, after the layout newline where the format writes one (`after_text`: after a
        string value's text, whose terminal holds that newline where the tag is a special token)."""
        tag = lit(self.value_tags[1])
        if not self.value_newlines or after_text and tag.startswith("<["):
            return tag
        return lit(NL + self.value_tags[1])

    def _value_text(self, regex: str, lit: _Literals) -> str:
        """The terminal of a string value's text (`regex`), never holding the value's closing tag, where the parser
        would end it. With the layout newline before the tag: the newline ends the terminal where the tag is a
        special token (text cannot hold it); where the tag is text, the lazy lexeme ends at the newline and the tag,
        so the text must not hold the tag alone. Nor a line at which `unclosed_values` would end the value (the
        layout newline after the value's opening begins one too)."""
        special = lit(self.value_tags[1]).startswith("<[")
        unread = []
        if self.value_newlines and not special:
            unread.append(f"/(.|\\n)*/ {json.dumps(self.value_tags[1])} /(.|\\n)*/")
        if self._value_breaks:
            line_start = r"/((.|\n)*\n)?/" if self.value_newlines else r"/(.|\n)*\n/"
            tags = " | ".join(json.dumps(tag[len(NL):]) for tag in self._value_breaks)
            unread.append(f"{line_start} ({tags}) /(.|\\n)*/")
        text = f"/{regex}\\n/" if self.value_newlines and special else f"/{regex}/"
        return f"{text} & ~({' | '.join(unread)})" if unread else text

    def _call_body(self, tool: dict, index: int, lit: _Literals) -> str:
        """NAME in its markup, a newline, its pairs (absent where it takes none) and the closing."""
        function = tool["function"]
        pairs = f"pairs_{index}" if self._pair_items(function, index) else ""
        name = self.name_tags[0] + function["name"] + self.name_tags[1] + NL
        end = self.pairs_end + NL + self.call_end if self.pairs_end else self.call_end
        return f"({lit(name)} {pairs} {lit(end)})"

    @staticmethod
    def _pair_items(function: dict, index: int) -> list[str]:
        """The rule names of a call's pairs: each property's in the schema's order (optional ones with `?`), then
        free pairs where the schema allows more."""
        parameters = _parameters(function, index)
        properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
        required = parameters.get("required") if isinstance(parameters.get("required"), list) else []
        items = [f"pair_{index}_{j}" + ("" if key in required else "?") for j, key in enumerate(properties)]
        return items + ([] if parameters.get("additionalProperties") is False else [f"more_{index}*"])

    def _pair_rules(self, function: dict, index: int, lit: _Literals) -> list[str]:
        items = self._pair_items(function, index)
        if not items:
            return []
        parameters = _parameters(function, index)
        properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
        (key_begin, key_end), value_begin = self.key_tags, self.value_tags[0] + (NL if self.value_newlines else "")
        rules = [f"pairs_{index}: {' '.join(items)}"]
        for j, (key, schema) in enumerate(properties.items()):
            opening = lit(f"{key_begin}{key}{key_end}{self.after_key}{value_begin}")
            value, more = self._value_rule(schema, parameters, f"{index}_{j}", lit)
            rules += [f"pair_{index}_{j}: {opening} {value} {lit(NL)}", *more]
        if items[-1] == f"more_{index}*":  # more pairs: any key but the properties' (theirs come in order above)
            extra = parameters.get("additionalProperties")
            value, more = self._value_rule(extra if isinstance(extra, dict) else {}, parameters, f"{index}_more", lit)
            # A key without blanks around it: the parser reads a key stripped, and ` count` would be `count` again;
            # nor the first character of the key's closing (`>` where the key is inside the opening tag).
            stop = re.escape("".join(sorted({"<", key_end[:1]})))
            key = f"/[^{stop}\\s]([^{stop}\\n]*[^{stop}\\s])?/" + (
                f" & ~({' | '.join(json.dumps(k) for k in properties)})" if properties else "")
            rules += [f"more_{index}: {lit(key_begin)} ARG_KEY_{index} {lit(key_end + self.after_key + value_begin)} "
                      f"{value} {lit(NL)}", f"ARG_KEY_{index}: {key}", *more]
        return rules

    def _value_rule(self, schema, parameters: dict, name: str, lit: _Literals) -> tuple[str, list[str]]:
        """A value and its closing tag, and the rules it needs: a string as written (its enum, const, minLength and
        maxLength kept), JSON following the property's schema, or any text where the schema allows anything."""
        closing = self._value_closing(lit)
        strings = [] if _says_nothing(_resolved(schema, parameters)) else _string_choices(schema, parameters)
        if strings:
            return f"({' | '.join(lit(s) for s in strings)}) {closing}", []
        if strings is None:
            return f"{lark_json(_within_parameters(schema, parameters))} {closing}", []
        schema = _resolved(schema, parameters)
        lengths = [schema.get(k) if isinstance(schema, dict) else None for k in ("minLength", "maxLength")]
        if not any(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
            return "string_value", []
        low, high = (n if isinstance(n, int) and not isinstance(n, bool) else d for n, d in zip(lengths, (0, "")))
        closing = self._value_closing(lit, after_text=True)
        lazy = "" if closing.startswith("<[") else "[lazy]"
        text = self._value_text(f"(.|\\n){{{low},{high}}}", lit)
        return f"value_{name}", [f"value_{name}{lazy}: ARG_TEXT_{name} {closing}", f"ARG_TEXT_{name}: {text}"]


class _KeyValuePrefix:
    """A key/value call (KeyValueCalls) read as it is written, from just past its name through its closing: its
    arguments (`size`, `arguments`) are the JSON object built from the pairs whose value closed, `{"K": V, ...`,
    closed by `}` with the call, so a stream sends each pair once; `whole` once the call's closing is read
    (`end` is then past it), `broken` where the text is no such call. Each character is searched once."""

    def __init__(self, fmt: KeyValueCalls, name: str, begin: int) -> None:
        self.fmt = fmt
        self.begin = self.end = begin
        self.whole = self.broken = False
        self._parameters, self._properties = fmt._schema_of(name)
        self._json = ""
        self._key = ""
        self._expect = "pair"    # pair (a key's opening or the call's closing), key, value_opening, value
        self._searched = begin   # how far the text was searched for the closing tag of the key or value being read

    @property
    def size(self) -> int:
        return len(self._json)

    def arguments(self, text: str, since: int = 0) -> str:
        return self._json[since:]

    def closed(self) -> str:
        """The arguments as the call's closing makes them."""
        return (self._json or "{") + "}"

    def closing(self, text: str, ended: bool = False) -> bool:
        """Whether the text ends inside the call's closing, its pairs whole; `ended`: the answer ended there (an
        end of sequence, not max_tokens), so one that ends after a whole pair ends the call too, as a JSON call
        whose object closed does (more pairs could follow only a cut answer's)."""
        rest = text[_skip_space(text, self.end):]
        return self._expect == "pair" and (ended if not rest else _pieces_so_far(rest, self.fmt._closing))

    def read(self, text: str) -> None:
        while not (self.whole or self.broken) and self._step(text):
            pass

    def _step(self, text: str) -> bool:
        """Reads the next piece (a tag, a key, a value); False while the text ends before it is whole."""
        key_begin, key_end = self.fmt.key_tags
        value_begin, value_end = self.fmt.value_tags
        if self._expect in ("pair", "value_opening"):
            pos = _skip_space(text, self.end)
            tag = key_begin if self._expect == "pair" else value_begin
            if text.startswith(tag, pos):
                self.end = self._searched = pos + len(tag)
                self._expect = "key" if self._expect == "pair" else "value"
                return True
            if tag.startswith(text[pos:]):
                return False
            if self._expect == "value_opening":
                self.broken = True
                return False
            try:  # no key: the call's closing
                end = self.fmt._closing_end(text, pos)
            except ValueError:
                self.broken = True
                return False
            if end is not None:
                self.end, self._json, self.whole = end, self.closed(), True
            return end is not None
        closing = key_end if self._expect == "key" else value_end
        ends = [closing, *(self.fmt._value_breaks if self._expect == "value" else ())]
        found, end = min(((text.find(e, self._searched), e) for e in ends), key=lambda hit: (hit[0] < 0, hit[0]))
        if found < 0:
            self._searched = max(self.end, len(text) - max(map(len, ends)) + 1)
            # A key is a name: a tag or a line inside it is no key/value call.
            self.broken = self._expect == "key" and bool(re.search(r"[<\n]", text[self.end:self._searched]))
            return False
        # A value's closing tag is read; a line that ends a value left unclosed is the next piece's.
        piece, self.end = text[self.end:found], found + len(closing) if end == closing else found
        if self._expect == "key":
            if re.search(r"[<\n]", piece):
                self.broken = True
                return False
            # Without a value's opening tag the value starts right after the key's closing, blanks and all.
            self._key, self._searched = piece.strip(), self.end
            self._expect = "value_opening" if value_begin else "value"
        else:
            if self.fmt.value_newlines:  # the template's layout around the value
                piece = piece[piece.startswith(NL):len(piece) - piece.endswith(NL)]
            value = self.fmt._value_json(self._parameters, self._properties, self._key, piece)
            self._json += ("{" if not self._json else ", ") + json.dumps(self._key, ensure_ascii=False) + ": " + value
            self._expect = "pair"
        return True


_KV_NAME = re.compile(r"[^\s<>]+")
NL = "\n"


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON")


def _python_literal(text: str) -> str | None:
    """The JSON of the Python literal `text` is, where it is a dict, a list, True, False or None (what Jinja's
    `string` makes of a value); None otherwise: a number or a quoted string is read as written."""
    if not text or text[0] not in "{[TFN":
        return None
    try:
        value = ast.literal_eval(text)
        if value is not None and not isinstance(value, (dict, list, bool)):
            return None
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _resolved(schema, parameters: dict, depth: int = 0):
    """`schema` with a local `$ref` ("#", "#/...") followed into the parameters; None where it leads nowhere."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 32:
        ref, schema, depth = schema["$ref"], parameters, depth + 1
        if not ref.startswith("#"):
            return None
        for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
            schema = schema.get(part) if isinstance(schema, dict) else None
    return schema


def _string_choices(schema, parameters: dict, depth: int = 0) -> list[str] | None:
    """The strings a schema admitting only strings allows ([] for any string); None where it admits more (or
    says nothing)."""
    schema = _resolved(schema, parameters)
    if not isinstance(schema, dict) or depth > 32:
        return None
    if "const" in schema:
        return [schema["const"]] if isinstance(schema["const"], str) else None
    if "enum" in schema:
        enum = schema["enum"]
        return list(enum) if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) else None
    kind = schema.get("type")
    if kind in ("string", ["string"]):
        return []
    branches = schema.get("anyOf", schema.get("oneOf"))
    if kind is None and isinstance(branches, list) and branches:
        choices = [_string_choices(branch, parameters, depth + 1) for branch in branches]
        if any(c is None for c in choices):
            return None
        return [] if any(c == [] for c in choices) else [s for c in choices for s in c]
    return None


_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})


def _says_nothing(schema) -> bool:
    """A schema that allows any value: its grammar is any text, which the parser reads as JSON where it is."""
    return schema is True or isinstance(schema, dict) and not schema.keys() - _ANNOTATIONS


def _only_strings(schema, parameters: dict) -> bool:
    return _string_choices(schema, parameters) is not None


def _within_parameters(schema, parameters: dict) -> dict:
    """A property's schema as a grammar compiles it alone: its local `$ref`s point into the parameters, which it
    carries under `$defs` (the refs rewritten to reach them there)."""
    def moved(node):
        if isinstance(node, dict):
            return {k: ("#/$defs/parameters" + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                        else moved(v)) for k, v in node.items()}
        return [moved(v) for v in node] if isinstance(node, list) else node

    schema = moved(schema) if isinstance(schema, dict) else {}
    root = moved({key: value for key, value in parameters.items() if key != "$id"})
    return {**schema, "$defs": {**schema.get("$defs", {}), "parameters": root}}


FORMATS = {f.name: f for f in (
    # Before hermes: its `<tool_call>` markers are GLM's and Qwen3-Coder's too (`<arg_key>` is GLM's alone, the
    # `<function=` and `<parameter=` openings Qwen3-Coder's and Seed-OSS's, whose `<seed:tool_call>` holds no
    # `<tool_call>`).
    KeyValueCalls("glm45", ("<tool_call>", "<arg_key>"), call_begin="<tool_call>", call_end="</tool_call>",
                  separator="\n", name_key="", key_tags=("<arg_key>", "</arg_key>"), after_key="\n",
                  value_tags=("<arg_value>", "</arg_value>")),
    KeyValueCalls("qwen3_coder", ("<tool_call>", "<function=", "<parameter="), call_begin="<tool_call>",
                  call_end="</tool_call>", separator="\n", name_key="", name_tags=("\n<function=", ">"),
                  key_tags=("<parameter=", ">"), value_tags=("", "</parameter>"), value_newlines=True,
                  pairs_end="</function>", python_values=True, bare_calls=True, unclosed_values=True),
    KeyValueCalls("seed_oss", ("<seed:tool_call>", "<function=", "<parameter="), call_begin="<seed:tool_call>",
                  call_end="</seed:tool_call>", separator="\n", name_key="", name_tags=("\n<function=", ">"),
                  key_tags=("<parameter=", ">"), value_tags=("", "</parameter>"), pairs_end="</function>",
                  python_values=True, bare_calls=True, unclosed_values=True),
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
    HarmonyCalls("harmony", ("<|channel|>", "to=", "functions."), call_begin="<|start|>", call_end="<|call|>",
                 name_key="", name_prefix="functions.", name_sep="<|message|>", parallel=False),
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
    tail that could still be the start of the marker (or of a call written without it: KeyValueCalls). From the marker on, text is kept until `finish`,
    which parses the calls; calls that do not parse come back as content. With `forced` (a required
    call) the whole answer is the calls. Without `parallel` (`parallel_tool_calls: false`) an answer holds
    at most one call: the first, when a model left free (`auto`) writes several. With `answer_or_calls`
    (under `auto` with a response format) the answer is JSON unless it opens with calls of the offered
    functions (`names`): calls are looked for at its start only (a bare JSON call: an object of just a
    function's name and arguments), and the JSON streams as content once it is known to be no call; so does a
    bare JSON answer under `auto` alone (_BareCallScan reads it as it is written).
    With `names` (the offered functions) a call must name one of them: a marker followed by an empty name, or a
    function the request did not offer, is no call (a client could not run it), and a bare JSON call (Llama 3)
    must also hold nothing but its name and arguments: a model asked for a JSON document with a `name` field
    answers with one.

    Calls stream as they are written, as OpenAI streams them (`take_deltas`): a call opens (index, id, name)
    once its name and the "{" of its arguments are written (a key/value call's: its name), and its arguments follow as they grow, as far
    as they are a prefix of valid JSON. A call opens early only when it is sure to be one: under a required
    call (the grammar shapes it), or after a marker when it names an offered function (`names`); Llama 3's
    bare JSON under `auto` is a call only once its object is whole, so it is sent, whole, when the object closes,
    and the text after it is read as the text after closed calls is (below; `split` reads no second bare call,
    so none follows). What is sent is never taken back: a call that opened stays a call. An answer that ends
    inside its calls once one was sent (an end of sequence, a stop string) reads as one cut there by max_tokens:
    its calls as far as they got, no markup as content. One whose markup breaks (a model left free) keeps the
    calls sent, each with the arguments sent, as far as they were JSON, and the rest of its calls' text is
    dropped (it is markup, no words for the user). In either, a key/value call's pairs are closed into their object
    (`ended_arguments`): the finish reason says "tool_calls", and its arguments must parse. Otherwise `finish`
    sends what each call still lacks, so the streamed calls always join into the calls `finish` returns (ids
    included): the streamed answer and the whole one are the same.

    Once calls were sent and their markup ends (the format's closing, or words where the next call's opening
    would be) and words follow, they are final and the text after them is content again, sent as it is written
    (until those words, the closing and the blank after it are the calls', so their tokens carry no logprobs):
    the blank before the words is layout, a tail that could open more markup is held back, and a marker opens
    more calls. A call of a function not offered is read but not sent; in an answer with calls of offered
    functions it is left out (`dropped` names it), and in one without, the whole text stays the answer, as
    written.
    """

    def __init__(self, fmt: ToolCallFormat, forced: bool = False, parallel: bool = True,
                 names: frozenset[str] | None = None, deltas: bool = True, answer_or_calls: bool = False) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.answer_or_calls = answer_or_calls
        self.names = names
        self.dropped: list[str] = []  # the functions not offered that calls named (those calls are left out)
        self._forced = forced
        self._in_calls = forced
        self._decided = forced       # calls looked for at the start only: whether the answer opens with them is known
        self._pending = ""           # content held back
        self._calls_text = ""        # the text of the calls being read, from their marker on
        self._after_calls = False    # calls were read and closed: the blank before the words that follow is layout
        # Streaming the calls as written: which may open early, and how far the text has been read.
        self._early = forced or (bool(fmt.marker) and names is not None)
        self._offered = None if forced else names
        self._record = deltas        # a whole response reads the calls from `finish` alone
        self._phase = "head"         # what comes next at `_pos`: a call's head, its arguments, its tail; "off"
        self._pos = 0
        self._arguments: _JsonPrefix | None = None
        # The call being read that is not sent: its name (None: a call past the first without `parallel`) and scan.
        self._skipped: tuple[str | None, _JsonPrefix] | None = None
        self._num_read = 0           # the calls read in `_calls_text` (sent or skipped)
        self._first = 0              # the first call of `_sent` in `_calls_text` (the calls before it are whole)
        self._sent: list[ToolCall] = []   # the calls opened (their arguments sent: `_sent_calls`)
        self._skipped_names: list[str] = []  # the calls of `_calls_text` read but not sent
        self._deltas: list[dict] = []
        self._bare: _BareCallScan | None = None  # a bare JSON object at the start, not yet known call or answer

    @property
    def in_calls(self) -> bool:
        """Whether the text read last went to calls (or to what may still be their markup). A bare JSON object
        that may still be a call is held as content is (its tokens' logprobs wait for the content it may be)."""
        return self._in_calls and self._bare is None

    def add(self, text: str) -> str:
        if self._in_calls:
            self._calls_text += text
            return self._read_calls()
        content = self._add_content(text)
        if self._in_calls:
            content += self._read_calls()
        return content

    def _add_content(self, text: str) -> str:
        self._pending += text
        if self._after_calls:
            if not self._pending.strip():
                return ""
            self._pending, self._after_calls = self._pending.lstrip(), False
        if self._decided:
            return self._take(len(self._pending))
        if not self.fmt.marker or self.answer_or_calls:
            return self._decide_at_start()
        start = self.fmt.calls_start(self._pending, self.names)
        if start >= 0:
            self._in_calls, self._calls_text = True, self._pending[start:]
            return self._take(start, keep=False)
        return self._take(len(self._pending) - self.fmt.held_back(self._pending, self.names))

    def _decide_at_start(self) -> str:
        """Calls only at the answer's start (after blanks): its opening, the marker or a bare call's "{"."""
        opening = self.fmt.marker or "{"
        stripped = self._pending.lstrip()
        if len(stripped) < len(opening) and opening.startswith(stripped):
            return ""  # blank, or what could still become the opening
        self._decided = True
        if stripped.startswith(opening):
            self._in_calls, self._calls_text, self._pending = True, self._pending, ""
            if not self.fmt.marker and self.names is not None:
                self._bare = _BareCallScan(self.fmt, self.names)
            return ""
        return self._take(len(self._pending))

    def _take(self, upto: int, keep: bool = True) -> str:
        out = self._pending[:upto]
        self._pending = self._pending[upto:] if keep else ""
        return out

    def _read_calls(self) -> str:
        """Opens the calls whose heads are written and sends their arguments as they grow; stops for good at
        the first text it cannot read as the next piece of a call (that is left to `finish`). Once the calls
        end and words follow, the calls read are final and the words are content (returned, and read on as
        an answer's text is: more calls may follow them)."""
        if self._bare is not None:
            if not self._read_bare():
                return ""
            if not self._in_calls:  # a bare JSON object that is no call: the answer, sent from now on
                content, self._calls_text = self._calls_text, ""
                return content
        text = self._calls_text
        while self._early and self._phase != "off":
            try:
                if self._phase == "head":
                    if self._num_read and not self.fmt.next_opening(text, self._pos):
                        end = self.fmt.calls_end(text, self._pos)
                        if end is None or not text[end:].strip():
                            # The calls end where words follow: until then the text read last (their closing,
                            # the blank after it) is theirs, so its tokens carry no logprobs (`in_calls`).
                            return ""
                        self._pos = end
                        return self._end_calls()
                    head = self.fmt.call_head(text, self._pos, not self._num_read)
                    if head is None:
                        return ""
                    self._num_read += 1
                    unoffered = self._offered is not None and head[0] not in self._offered
                    if unoffered or self._sent and not self.parallel:  # a second call without parallel: not sent
                        self._skipped = head[0] if unoffered else None, self.fmt.arguments_scan(*head)
                        self._phase = "arguments"
                    else:
                        self._open(*head)
                elif self._phase == "arguments":
                    if not self._read_arguments(text):
                        return ""
                else:
                    end = self.fmt.call_tail(text, self._pos)
                    if end is None:
                        return ""
                    if self._skipped is not None:
                        self._skipped_names += [self._skipped[0]] if self._skipped[0] is not None else []
                        self._skipped = None
                    self._phase, self._pos = "head", end
            except ValueError:
                self._phase = "off"
        return ""

    def _read_bare(self) -> bool:
        """Reads the bare JSON object at the start; True once it is known: a call (sent at once, `_send_bare`) or
        the answer (`_in_calls` off: its text is content from now on, never taken back). While it may still be
        either it is held (JSON that Python reads and JSON does not, NaN, waits for `finish`)."""
        scan = self._bare
        verdict = scan.read(self._calls_text)
        if verdict is None:
            return False
        self._bare = None
        self._in_calls = verdict
        if verdict:
            self._send_bare(scan.call, scan.end)
        return True

    def _send_bare(self, call: ToolCall, end: int) -> None:
        """A bare JSON object proved a whole call (_BareCallScan) is certain: it is sent now, whole, and read as a
        marker format's calls are once they close (`_read_calls`): the text after it waits in `_calls_text` until
        words follow, which are content (`split` reads one bare call and the rest as words, so no call follows).
        Its text leaves `_calls_text`, as calls that ended do (`_first`), so `finish` never reads it again."""
        self._sent.append(call)
        if self._record:
            self._deltas += [_opening_delta(0, call), _arguments_delta(0, call.arguments)]
        self._calls_text = self._calls_text[end:]
        self._first, self._num_read, self._pos, self._phase, self._early = 1, 1, 0, "head", True

    def _end_calls(self) -> str:
        """The calls read end at `_pos`: final when one was sent, and the text after them is content. Calls of no
        offered function alone are no calls yet: they wait for `finish` (the whole text may be the answer)."""
        if self._forced or not self._sent:
            self._phase = "off"
            return ""
        self._sent = self._sent_calls()
        self.dropped += self._skipped_names
        rest = self._calls_text[self._pos:]
        self._calls_text, self._pos, self._num_read, self._first = "", 0, 0, len(self._sent)
        self._arguments, self._skipped_names, self._phase = None, [], "head"
        self._in_calls, self._after_calls, self._pending = False, True, ""
        content = self._add_content(rest)
        return content + (self._read_calls() if self._in_calls else "")

    def _open(self, name: str, arguments_at: int) -> None:
        call = ToolCall(name, "", new_call_id(self.fmt.short_ids))
        if self._arguments is not None:  # the call before is closed: its arguments are whole
            self._sent[-1] = self._sent_calls()[-1]
        self._sent.append(call)
        self._arguments = self.fmt.arguments_scan(name, arguments_at)
        self._phase = "arguments"
        if self._record:
            self._deltas.append(_opening_delta(len(self._sent) - 1, call))

    def _read_arguments(self, text: str) -> bool:
        """Sends what the arguments add (a skipped call's are read, not sent); True once they are whole (the
        call's tail comes next)."""
        scan = self._skipped[1] if self._skipped is not None else self._arguments
        before = scan.size
        scan.read(text)
        if scan.size > before and self._record and self._skipped is None:
            self._deltas.append(_arguments_delta(len(self._sent) - 1, scan.arguments(text, before)))
        if scan.broken:
            raise ValueError("the arguments are no JSON")
        if not scan.whole:
            return False
        self._phase, self._pos = "tail", scan.end
        return True

    def take_deltas(self) -> list[dict]:
        """The stream deltas of the calls since the last take, a call's adjacent argument pieces joined (a call
        still opens with empty arguments, as OpenAI's do)."""
        out: list[dict] = []
        for delta in self._deltas:
            call, previous = delta["tool_calls"][0], out[-1]["tool_calls"][0] if out else {"id": None}
            if "id" not in call and "id" not in previous and previous["index"] == call["index"]:
                previous["function"]["arguments"] += call["function"]["arguments"]
            else:
                out.append(delta)
        self._deltas = []
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) at the end of the answer; `cut`: it was cut short by max_tokens
        (ToolCallFormat.split: the call it ends in comes back as far as it got). The deltas that complete the
        streamed calls are then ready to take; `dropped` names the calls left out."""
        if not self._in_calls:
            return ("" if self._after_calls else self._take(len(self._pending))), list(self._sent)
        whole = self._sent[:self._first]
        self._sent = self._sent_calls()
        sent = self._sent[self._first:]
        content, calls, dropped = self._parsed(cut, bool(self._sent))
        if sent and not _extends(calls, sent):
            # An answer that ended inside calls already sent (all it wrote reads as their beginning) reads as one
            # cut there; one that breaks them keeps what was sent, and its markup is no content (the class
            # docstring).
            if self._phase != "off":
                content, calls, dropped = self._parsed(True, True)
            if self._phase == "off" or not _extends(calls, sent):
                content, calls, dropped = "", list(sent), list(self._skipped_names)
        calls = [replace(call, id=early.id) for call, early in zip(calls, sent)] + calls[len(sent):]
        calls = (whole + calls)[:None if self.parallel else 1]
        if not cut:
            calls = [replace(call, arguments=self.fmt.ended_arguments(call.arguments)) for call in calls]
        self.dropped += dropped
        if self._record:
            for index, call in enumerate(calls[len(whole):], len(whole)):
                if index >= len(self._sent):
                    self._deltas.append(_opening_delta(index, call))
                early = self._sent[index].arguments if index < len(self._sent) else ""
                if len(call.arguments) > len(early):
                    self._deltas.append(_arguments_delta(index, call.arguments[len(early):]))
        self._sent = calls
        return content, calls

    def _sent_calls(self) -> list[ToolCall]:
        """The calls opened, each with the arguments sent (the last one's read from the text only now: a long
        call's arguments are not copied at every step)."""
        if len(self._sent) == self._first:
            return list(self._sent)
        return [*self._sent[:-1], replace(self._sent[-1], arguments=self._arguments.arguments(self._calls_text))]

    def _parsed(self, cut: bool, has_calls: bool) -> tuple[str, list[ToolCall], list[str]]:
        """(content, the calls of offered functions, the names of those of others) of `_calls_text`; `has_calls`:
        the answer has calls already, so calls of no offered function are dropped even where no other is here."""
        if self._forced:
            # The grammar writes calls and nothing else: an answer that ends early (a stop string) ends inside
            # them, as one cut there, and no piece of their markup is words.
            parsed = self.fmt.split(self._calls_text, self.names, cut=True)
            calls = parsed[1] if parsed is not None else []
            return "", calls if self.parallel else calls[:1], []
        parsed = self.fmt.split_all(self._calls_text, self.names, cut)
        # A bare JSON object cut before its name is whole may as well be an answer (only a required call is
        # known to be a call), so it stays content; a marker's text is no answer.
        if parsed is None or not (parsed[1] or self.fmt.marker):
            return ("", [], []) if has_calls else (self._calls_text, [], [])
        content, calls = parsed
        offered = [call for call in calls if _is_call_name(call.name, self.names)]
        dropped = [call.name for call in calls if not _is_call_name(call.name, self.names)]
        if dropped and not offered and not has_calls:
            return self._calls_text, [], []  # no call at all: the whole text is the answer, as written
        return content, offered, dropped


def _extends(calls: list[ToolCall], sent: list[ToolCall]) -> bool:
    """Whether `calls` are the calls sent so far, grown: the same names, arguments that go on from those sent."""
    return len(calls) >= len(sent) and all(call.name == early.name and call.arguments.startswith(early.arguments)
                                           for call, early in zip(calls, sent))


def _opening_delta(index: int, call: ToolCall) -> dict:
    """A call's first delta, as OpenAI streams it: its index, id, type and name, with no arguments yet."""
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}]}


def _arguments_delta(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_DIGITS = "0123456789"
# A number's states (after "-", "0", more digits, ".", fraction digits, "e", its sign, exponent digits), and the
# ones it may end in; as the JSON grammar, and Python's decoder, read numbers.
_NUMBER_STEPS = {
    ("", "-"): "-", ("", "0"): "0", ("", "1"): "int", ("-", "0"): "0", ("-", "1"): "int",
    ("0", "."): ".", ("0", "e"): "e",
    ("int", "1"): "int", ("int", "0"): "int", ("int", "."): ".", ("int", "e"): "e",
    (".", "0"): "frac", (".", "1"): "frac", ("frac", "0"): "frac", ("frac", "1"): "frac", ("frac", "e"): "e",
    ("e", "-"): "e-", ("e", "0"): "exp", ("e", "1"): "exp", ("e-", "0"): "exp", ("e-", "1"): "exp",
    ("exp", "0"): "exp", ("exp", "1"): "exp",
}
_NUMBER_ENDS = frozenset({"0", "int", "frac", "exp"})


def _number_class(char: str) -> str:
    if char == "0":
        return "0"
    if char in _DIGITS:
        return "1"
    return {"-": "-", "+": "-", ".": ".", "e": "e", "E": "e"}.get(char, "")


class _JsonPrefix:
    """A JSON value read as it is written, from `begin`: `end` is how far the text is a prefix of valid JSON,
    `whole` once the value is complete (then `end` is its end), `broken` at the first character no JSON value
    could hold there. Each character is read once, so a long call costs no more than its length."""

    def __init__(self, begin: int) -> None:
        self.begin = self.end = begin
        self.whole = self.broken = False
        self._containers: list[str] = []
        self._expect = "value"     # value, value_or_close, key, key_or_close, colon, after_value
        self._string: str | None = None   # inside a string: "key" or "value"
        self._escape = -1          # in a string: -1 none, 0 after a backslash, k > 0 hex digits still due
        self._literal = ""         # what a true/false/null still needs
        self._number: str | None = None

    @property
    def size(self) -> int:
        """The length of the arguments read so far (what may be sent)."""
        return self.end - self.begin

    def arguments(self, text: str, since: int = 0) -> str:
        """The arguments read so far, from their `since`th character on: the JSON text as written."""
        return text[self.begin + since:self.end]

    def read(self, text: str) -> None:
        pos = self.end
        while pos < len(text) and not (self.whole or self.broken):
            if self._step(text, pos):
                pos = self.end
            else:
                self.broken = True

    def _step(self, text: str, pos: int) -> bool:
        """Reads the character at `pos` (or a run of plain string characters), moving `end` past it."""
        char = text[pos]
        if self._string is not None:
            return self._string_step(text, pos, char)
        if self._literal:
            if char != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._expect = "after_value"
            self.end = pos + 1
            return True
        if self._number is not None:
            step = _NUMBER_STEPS.get((self._number, _number_class(char)))
            if step is not None and not (char == "+" and self._number != "e"):
                self._number, self.end = step, pos + 1
                return True
            if self._number not in _NUMBER_ENDS:
                return False
            self._number, self._expect = None, "after_value"
        if char in " \t\n\r":
            self.end = pos + 1
            return True
        if not self._token(char):
            return False
        self.end = pos + 1
        return True

    def _string_step(self, text: str, pos: int, char: str) -> bool:
        if self._escape == 0:
            if char not in '"\\/bfnrtu':
                return False
            self._escape = 4 if char == "u" else -1
        elif self._escape > 0:
            if char not in "0123456789abcdefABCDEF":
                return False
            self._escape = self._escape - 1 if self._escape > 1 else -1
        elif char == '"':
            self._expect = "colon" if self._string == "key" else "after_value"
            self._string = None
        elif char == "\\":
            self._escape = 0
        elif char < " ":
            return False
        else:
            self.end = _STRING_RUN.match(text, pos).end()
            return True
        self.end = pos + 1
        return True

    def _token(self, char: str) -> bool:
        expect = self._expect
        if expect in ("value", "value_or_close"):
            if char == "]" and expect == "value_or_close":
                return self._close()
            if char in "{[":
                self._containers.append(char)
                self._expect = "key_or_close" if char == "{" else "value_or_close"
            elif char == '"':
                self._string = "value"
            elif char in _LITERALS:
                self._literal = _LITERALS[char]
            elif char == "-" or char in _DIGITS:
                self._number = _NUMBER_STEPS[("", _number_class(char))]
            else:
                return False
            return True
        if expect in ("key", "key_or_close"):
            if char == "}" and expect == "key_or_close":
                return self._close()
            if char != '"':
                return False
            self._string = "key"
            return True
        if expect == "colon":
            if char != ":":
                return False
            self._expect = "value"
            return True
        if char == ",":
            self._expect = "key" if self._containers[-1] == "{" else "value"
            return True
        if char == ("}" if self._containers[-1] == "{" else "]"):
            return self._close()
        return False

    def _close(self) -> bool:
        self._containers.pop()
        self._expect = "after_value"
        if not self._containers:
            self.whole = True
        return True


class _BareCallScan:
    """A bare JSON object (Llama 3's call has no marker) read as it is written, to tell as early as the text allows
    whether it may still be a call by `ToolCallFormat.split`'s rule: an object of just an offered function's name
    (a string) and its arguments (an object), each written once. The text proves it is none at the first member
    of another name or written again, a name that no offered function's begins with, arguments that open as no
    object, or JSON that breaks; once the object is whole, `split` itself decides. Each character of the
    arguments is read once (_JsonPrefix); a key or a name is read again as it grows, but it proves the object no
    call once it is longer than every name it may be."""

    def __init__(self, fmt: ToolCallFormat, names: frozenset[str]) -> None:
        self.fmt, self.names = fmt, names
        self._pos = 0
        self._expect = "object"     # object, key_or_close, key, colon, value, after_value
        self._key = ""              # the member whose value comes next
        self._keys: set[str] = set()
        self._arguments: _JsonPrefix | None = None
        self._python_literal = False  # arguments Python's decoder reads (NaN, Infinity) and JSON does not
        self.call: ToolCall | None = None  # the call, once the object is a whole one
        self.end = 0                       # and where its object ends

    def read(self, text: str) -> bool | None:
        """True once the object is a whole call (`call`, `end`), False once the text cannot become one, None while
        it may."""
        try:
            while not self._python_literal:
                pos = _skip_space(text, self._pos)
                if pos == len(text):
                    return None
                if self._expect == "object":
                    self._pos, self._expect = _through(text, pos, ["{"]), "key_or_close"
                elif self._expect in ("key_or_close", "after_value") and text[pos] == "}":
                    parsed = self.fmt.split(text[:pos + 1], self.names)
                    if parsed is None:
                        return False
                    (self.call,), self.end = parsed[1], pos + 1
                    return True
                elif self._expect == "after_value":
                    self._pos, self._expect = _through(text, pos, [","]), "key"
                    if not {self.fmt.name_key, self.fmt.args_key} - self._keys:
                        raise ValueError("a member beside the name and the arguments")
                elif self._expect in ("key_or_close", "key"):
                    key = self._string(text, pos, {self.fmt.name_key, self.fmt.args_key} - self._keys)
                    if key is None:
                        return None
                    self._key, self._pos, self._expect = key[0], key[1], "colon"
                    self._keys.add(self._key)
                elif self._expect == "colon":
                    end = _through(text, pos, [":"])
                    if end is None:
                        return None
                    self._pos, self._expect = end, "value"
                elif self._key == self.fmt.name_key:
                    name = self._string(text, pos, self.names)
                    if name is None:
                        return None
                    self._pos, self._expect = name[1], "after_value"
                elif not self._read_arguments(text, pos):
                    return None
        except ValueError:
            return False
        return None

    def _read_arguments(self, text: str, pos: int) -> bool:
        """Reads the arguments as far as they are written; True once they are whole."""
        if self._arguments is None:
            if text[pos] != "{":
                raise ValueError("arguments are not an object")
            self._arguments = _JsonPrefix(pos)
        scan = self._arguments
        scan.read(text)
        if scan.broken:
            self._python_literal = text[scan.end:scan.end + 1] in ("N", "I")
            if not self._python_literal:
                raise ValueError("the arguments are no JSON")
        if not scan.whole:
            return False
        self._pos, self._expect, self._arguments = scan.end, "after_value", None
        return True

    @staticmethod
    def _string(text: str, pos: int, allowed) -> tuple[str, int] | None:
        """(the JSON string at `pos`, its end) when it is whole and one of `allowed`; None while it is written and
        one of them still begins with what it holds so far; a ValueError otherwise."""
        match = _JSON_STRING.match(text, pos)
        if match is not None:
            value = json.loads(match.group())
            if value not in allowed or not value:
                raise ValueError("not a name a call may have here")
            return value, match.end()
        if text[pos] != '"':
            raise ValueError("no string")
        body = _STRING_BODY.match(text, pos + 1)
        if not _ESCAPE_SO_FAR.fullmatch(text, body.end()):
            raise ValueError("no JSON string")
        so_far = json.loads('"' + body.group() + '"')
        if so_far[-1:] and "\ud800" <= so_far[-1] <= "\udbff":
            so_far = so_far[:-1]  # the first half of a character its next escape completes
        if not any(name.startswith(so_far) for name in allowed):
            raise ValueError("not a name a call may have here")
        return None


_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_ESCAPE_SO_FAR = re.compile(r'(?:\\(?:u[0-9a-fA-F]{0,3})?)?')
