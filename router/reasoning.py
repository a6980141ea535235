"""Reasoning output kept apart from the answer, as OpenAI-compatible servers return it.

Reasoning models (DeepSeek-R1, Qwen3, Kimi-K2-Thinking, SmolLM3, GLM-4.5/4.6, Command R7B, Seed-OSS, ...) write their
thinking between a start and an end tag before the answer. The router returns it as
`message.reasoning_content` (`delta.reasoning_content` when streaming) and the answer as `content`,
without the tags. The reasoning is the text the model wrote in its block, special tokens included (a tool
call's marker that the tokenizer flags special is part of its thoughts), streamed and whole alike.

Which models reason is decided once per model, never guessed from the text a model writes: an
operator setting (`reasoning_parsers` in the router config: model -> parser name, or "none"), else
the chat template: a template that writes a known pair of tags, each a single token of the model's
vocabulary, belongs to a reasoning family. The split works on token ids, so it holds whether or not
the tags are special tokens that detokenization drops.

Some templates open the block in the generation prompt (DeepSeek-R1, DeepSeek-V3.1 with
`thinking`, Qwen3-Thinking-2507): the prompt ends with the start tag and the output holds only the
end tag. Whether a request starts inside the block is read from its prompt ids. The split of a
stream is a pure function of the tokens generated so far, so a stream resumed on another site
splits exactly as an unbroken one.

A request whose output follows a grammar (`response_format`, a tool call) gets the reasoning block in
its grammar too (`with_reasoning`): constrained from the first token, the model could not think (it
must open the block itself, as Qwen3 does) or would write the JSON inside a block its prompt opened,
which would come back as reasoning with an empty answer. The reasoning is free text, the answer is
what the grammar allows:

| the prompt | the grammar |
|---|---|
| opens the block (ends with the start tag) | reasoning, end tag, answer (`after_reasoning`) |
| closes an empty block (thinking turned off), or the request sets `enable_thinking` / `thinking` false | the answer |
| neither (Qwen3 thinking: the model opens the block itself) | an optional block, then the answer (`reasoning_first`) |

Templates close an empty block to turn thinking off: Qwen3's `enable_thinking: false`, SmolLM3's
`/no_think`, DeepSeek-V3.1 without `thinking`, GLM-4.5/4.6's `enable_thinking: false` (which also ends each user
message with `/nothink`). The answer after a block, the model's or the prompt's, starts at its first line with
words, that line's indentation kept (ReasoningStream.answer_delta).

`reasoning_effort` (OpenAI's none, minimal, low, medium, high, xhigh) becomes what the model's template
takes (`template_effort`): a template with effort levels (gpt-oss's "Reasoning: low|medium|high") gets its
nearest level (minimal its lowest, xhigh its highest); "none" sets the template's thinking switch false
(Qwen3's, SmolLM3's and GLM's `enable_thinking`, DeepSeek-V3.1's `thinking`; Seed-OSS's budget of tokens,
`thinking_budget`, to 0, where its generation prompt opens the block for the model's note on the budget), and any
other effort sets it true (Seed-OSS: its budget left as the request sets it, unlimited by default: the template names
no budget for an effort), unless the request sets the switch itself the other way (a 400: two contradicting
asks). A reasoning model whose template has no switch (gpt-oss, DeepSeek-R1, Kimi-K2-Thinking) always reasons:
"none" is a 400 saying so. A model that does not reason takes every effort, as its template reads it.

gpt-oss writes no tags but messages, in its "harmony" format (parser `harmony`, detected from a template
that writes `<|channel|>` and `<|message|>`): `<|channel|>analysis<|message|>THOUGHTS<|end|>`, then
`<|start|>assistant<|channel|>final<|message|>ANSWER<|return|>`, or a tool call, a commentary message to a
recipient: `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
(the recipient may come before the channel). HarmonySplit reads the messages' headers: analysis bodies are
the reasoning; final bodies, and commentary bodies without a recipient (a preamble: the model telling the
user what it is about to do, before a call), are the answer's content; a message to a
recipient is a call, which reaches the answer as `<|start|>RECIPIENT<|message|>ARGS<|call|>` for
router.tool_calls' `harmony` format to read. Headers and end tokens are neither. Under a grammar the answer
is framed as messages too (`harmony_grammar`): an optional analysis message, then a final message holding
the answer, or (tool-call grammars write their own frames) the call's message. Such an answer sent back as an
earlier turn (a preamble as content, reasoning and a call) is one gpt-oss's template refuses; `fold_preambles`
gives the template the turn it takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from engine.chat_template import REASONING_KEYS, ChatTemplate
from engine.grammar import GrammarSpec, lark_json
from engine.tokenizer import ChatTokenizer
from router.errors import bad_request
from router.openai_request import REASONING_EFFORTS
from router.text_stream import WindowDetokenizer

# parser name -> (start tag, end tag)
PARSERS = {
    "think": ("<think>", "</think>"),                      # DeepSeek-R1/V3.1, Qwen3, Kimi-K2, SmolLM3, GLM-4.5/4.6
    "command": ("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command R7B / A
    "seed": ("<seed:think>", "</seed:think>"),              # Seed-OSS
}
# Tokens a template may write after the start tag of a block it opens in the generation prompt: Seed-OSS's with a
# thinking budget of 0 ends with `<seed:think><seed:cot_budget_reflect>`, and the model writes its note on the
# budget, then the end tag.
OPENING_TOKENS = {"seed": ("<seed:cot_budget_reflect>",)}
# Special tokens a model writes inside its block, which a grammar's free reasoning text cannot hold (text never
# matches a special token): Seed-OSS's notes on its budget, `<seed:cot_budget_reflect>...</seed:cot_budget_reflect>`,
# every so many tokens of a budget, and the note a budget of 0 asks for.
INNER_TOKENS = {"seed": ("<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>")}
PARSER_ALIASES = {"deepseek_r1": "think", "deepseek_v3": "think", "qwen3": "think", "kimi_k2": "think",
                  "smollm3": "think", "glm45": "think", "cohere_command": "command", "seed_oss": "seed"}
NO_PARSER = "none"
HARMONY = "harmony"                                      # gpt-oss: messages, not tags (HarmonyFormat)
HARMONY_ALIASES = ("gpt_oss", "openai_gptoss")
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")


def parser_names() -> list[str]:
    return sorted({*PARSERS, *PARSER_ALIASES, HARMONY, *HARMONY_ALIASES, NO_PARSER})


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start_id: int
    end_id: int
    opening_ids: frozenset[int] = frozenset()  # OPENING_TOKENS
    inner_ids: frozenset[int] = frozenset()    # INNER_TOKENS

    def starts_open(self, prompt_ids: list[int], tokenizer: ChatTokenizer) -> bool:
        """Whether the prompt itself opened the block: its last non-blank token is the start tag, or one of the
        template's OPENING_TOKENS after it."""
        ids = list(prompt_ids)
        while ids and ids[-1] in self.opening_ids:
            ids.pop()
        if len(ids) < len(prompt_ids):
            return ids[-1:] == [self.start_id]
        return self._last_tag(prompt_ids, tokenizer) == self.start_id

    def starts_closed(self, prompt_ids: list[int], tokenizer: ChatTokenizer) -> bool:
        """Whether the prompt ends with a block it closed (the empty block templates write to turn thinking
        off): its last non-blank token is the end tag."""
        return self._last_tag(prompt_ids, tokenizer) == self.end_id

    def _last_tag(self, prompt_ids: list[int], tokenizer: ChatTokenizer) -> int | None:
        """The start or end tag when it is the prompt's last non-blank token, else None."""
        for token_id in reversed(prompt_ids):
            if token_id in (self.start_id, self.end_id):
                return token_id
            if tokenizer.decode([token_id], skip_special_tokens=False).strip():
                return None
        return None


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """gpt-oss's harmony messages (the module docstring): the ids of their frame's special tokens."""

    name: str
    start_id: int
    channel_id: int
    message_id: int
    end_id: int
    return_id: int
    call_id: int

    @property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end a message: `<|end|>`, `<|return|>` (the last), `<|call|>` (a tool call)."""
        return frozenset((self.end_id, self.return_id, self.call_id))

    def starts_open(self, prompt_ids: list[int], tokenizer: ChatTokenizer) -> bool:
        return False  # the output opens with a message header, never inside a body

    def starts_closed(self, prompt_ids: list[int], tokenizer: ChatTokenizer) -> bool:
        return False  # gpt-oss has no switch that turns its analysis off


def fold_preambles(messages: list[dict]) -> list[dict]:
    """The messages as gpt-oss's template takes them: an assistant turn with tool calls that carries both a
    preamble (`content`) and reasoning, as the router answers a preamble then a call, holds the two joined as
    its reasoning, the preamble after the thoughts (the order the model wrote them), and no content.

    The template refuses such a turn ("Cannot pass both content and thinking"), yet a client sending back what
    it received must be served. The template renders no commentary message to no one: of a calling turn it
    shows one analysis message, the reasoning, or the content when there is no reasoning, so it already reads
    a preamble as thoughts. Joined, the model sees both texts it wrote where the template shows a calling turn's
    words (and loses both, as any calling turn's thoughts, once a final answer follows); dropping the preamble
    would hide from the model what it told the user."""
    folded = []
    for message in messages:
        reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
        content = message.get("content")
        if (message.get("role") == "assistant" and message.get("tool_calls") and isinstance(content, str)
                and content and isinstance(reasoning, str) and reasoning):
            turn = {key: value for key, value in message.items() if key not in REASONING_KEYS}
            message = {**turn, "content": "", "reasoning_content": f"{reasoning}\n\n{content}"}
        folded.append(message)
    return folded


# Chat template variables that turn reasoning off when false (Qwen3 and SmolLM3 read the first, DeepSeek-V3.1
# either): a request that sets one gets no reasoning block in its grammar, even from a template that ignores it.
THINKING_SWITCHES = ("enable_thinking", "thinking")
# Chat template variables that give the thinking a budget of tokens, none at 0 (Seed-OSS's `thinking_budget`, which
# is -1, unlimited, unless set): "none" sets it to 0. The template names no budget for an effort level, so other
# efforts leave it as the request sets it, or unlimited.
THINKING_BUDGETS = ("thinking_budget",)
# The effort levels gpt-oss's system message takes ("Reasoning: ..."), least to most.
HARMONY_EFFORTS = ("low", "medium", "high")
_LEVELS = REASONING_EFFORTS[1:]  # the efforts that reason, least to most ("none" is the switch's)


def template_effort(template_kwargs: dict, fmt: ReasoningFormat | HarmonyFormat | None,
                    template: ChatTemplate | None, model: str) -> dict:
    """The template variables a request's `reasoning_effort` becomes for this model (the module docstring): its
    template's nearest effort level, its thinking switch set, or a 400 for "none" on a model that always
    reasons. `template_kwargs` are the request's (chat_template_kwargs with reasoning_effort)."""
    effort = template_kwargs.get("reasoning_effort")
    if effort is None:
        return template_kwargs
    kwargs = dict(template_kwargs)
    switches = [name for name in THINKING_SWITCHES if template is not None and name in template.variables]
    budgets = [name for name in THINKING_BUDGETS if template is not None and name in template.variables]
    if budgets and fmt is not None:
        kwargs = _budgeted(kwargs, budgets, effort)
    if effort == "none":
        del kwargs["reasoning_effort"]
        if switches:
            return _switched(kwargs, switches, False, effort)
        if budgets or fmt is None:
            return kwargs  # its budget is 0 (above), or the model does not reason: nothing to turn off
        raise bad_request(f"`reasoning_effort` \"none\" asks for no reasoning, but the model `{model}` always "
                          f"reasons: its chat template has no switch that turns reasoning off. Send \"minimal\" for "
                          f"its least reasoning, or leave `reasoning_effort` out.", "reasoning_effort",
                          "unsupported_value")
    levels = _effort_levels(fmt, template)
    if levels:
        kwargs["reasoning_effort"] = _nearest_level(effort, levels)
    return _switched(kwargs, switches, True, effort) if switches and fmt is not None else kwargs


def _effort_levels(fmt, template: ChatTemplate | None) -> tuple[str, ...]:
    """The effort levels the template takes, least to most: gpt-oss's, else those a template reading
    `reasoning_effort` names as strings; () when it names none (it gets the effort as sent)."""
    if isinstance(fmt, HarmonyFormat):
        return HARMONY_EFFORTS
    if template is None or "reasoning_effort" not in template.variables:
        return ()
    named = {text for literals in template.literals.values() for text in literals.split("\0")}
    return tuple(level for level in _LEVELS if level in named)


def _nearest_level(effort: str, levels: tuple[str, ...]) -> str:
    """The level nearest `effort` (a tie goes to the higher: at least the effort asked for)."""
    rank = _LEVELS.index(effort)
    return min(reversed(levels), key=lambda level: abs(_LEVELS.index(level) - rank))


def _budgeted(kwargs: dict, budgets: list[str], effort: str) -> dict:
    """The template kwargs with a thinking budget of 0 for "none"; a 400 where the request set a budget that
    contradicts the effort (none but a budget, or some effort but a budget of 0)."""
    for name in budgets:
        budget = kwargs.get(name)
        if budget is not None and (budget == 0) != (effort == "none"):
            raise bad_request(f"`reasoning_effort` \"{effort}\" turns thinking {'off' if effort == 'none' else 'on'}, "
                              f"but `chat_template_kwargs.{name}` is {json.dumps(budget)}; send one of the two.",
                              "reasoning_effort", "invalid_parameter_combination")
    return {**kwargs, **dict.fromkeys(budgets, 0)} if effort == "none" else kwargs


def _switched(kwargs: dict, switches: list[str], on: bool, effort: str) -> dict:
    """The template kwargs with its thinking switches set `on`; a 400 where the request set one the other way."""
    for name in switches:
        if kwargs.get(name, on) is not on:
            raise bad_request(f"`reasoning_effort` \"{effort}\" turns thinking {'on' if on else 'off'}, but "
                              f"`chat_template_kwargs.{name}` is {json.dumps(kwargs[name])}; send one of the two.",
                              "reasoning_effort", "invalid_parameter_combination")
    return {**kwargs, **dict.fromkeys(switches, on)}


# The grammar's pieces around the answer: the tags by token id (text cannot spell a token), free text inside,
# and the blank line models write after the end tag (Qwen3's template puts one there), which the answer's
# own grammar (compact JSON, a call's marker) would refuse; a few characters, so no model wanders in blanks.
_REASONING_RULES = ("REASONING: /(.|\\n)*/", r"BLANK: /[ \t\r\n]{1,4}/")


def with_reasoning(spec: GrammarSpec, fmt: ReasoningFormat | HarmonyFormat, prompt_ids: list[int],
                   tokenizer: ChatTokenizer, template_kwargs: dict) -> GrammarSpec:
    """The grammar of a reasoning model's output whose answer must follow `spec`, from how the prompt leaves
    the block (the module's table)."""
    if isinstance(fmt, HarmonyFormat):
        return harmony_grammar(spec, fmt)
    if fmt.starts_open(prompt_ids, tokenizer):
        return after_reasoning(spec, fmt)
    if fmt.starts_closed(prompt_ids, tokenizer) or any(template_kwargs.get(k) is False for k in THINKING_SWITCHES):
        return spec
    return reasoning_first(spec, fmt.start_id, fmt.end_id, fmt.inner_ids)


def after_reasoning(spec: GrammarSpec, fmt: ReasoningFormat) -> GrammarSpec:
    """The grammar of an output that starts inside the reasoning block: free text up to the end tag, then
    `spec`."""
    return GrammarSpec("lark", "\n".join([f"start: {_reasoning(fmt.inner_ids)} <[{fmt.end_id}]> BLANK? answer",
                                          *_reasoning_rules(fmt.inner_ids), _answer_rules(spec)]))


def reasoning_first(spec: GrammarSpec, start_id: int, end_id: int,
                    inner_ids: frozenset[int] = frozenset()) -> GrammarSpec:
    """The grammar of an output that may open the reasoning block itself (Qwen3 writes the start tag as its
    first token, GLM a newline and then the tag): an optional block of free text (and `inner_ids`), then `spec`."""
    block = f"BLANK? <[{start_id}]> {_reasoning(inner_ids)} <[{end_id}]> BLANK?"
    return GrammarSpec("lark", "\n".join([f"start: ({block})? answer", *_reasoning_rules(inner_ids),
                                          _answer_rules(spec)]))


def _reasoning(inner_ids: frozenset[int]) -> str:
    """The block's content in a grammar: free text, and the special tokens the model writes inside it."""
    return "reasoning" if inner_ids else "REASONING"


def _reasoning_rules(inner_ids: frozenset[int]) -> list[str]:
    inner = " | ".join(f"<[{token_id}]>" for token_id in sorted(inner_ids))
    return [*_REASONING_RULES, *([f"reasoning: REASONING (({inner}) REASONING)*"] if inner_ids else [])]


def harmony_grammar(spec: GrammarSpec, fmt: HarmonyFormat) -> GrammarSpec:
    """The grammar of a harmony output (the generation prompt ends with `<|start|>assistant`, so the output opens
    with a message's header) whose answer must follow `spec`: an optional analysis message, then a final message
    holding the answer when `spec` is a response format (a JSON schema), or the messages `spec` itself frames
    (router.tool_calls' harmony grammars write the call's message, or a final one, themselves)."""
    channel, message = f"<[{fmt.channel_id}]>", f"<[{fmt.message_id}]>"
    if spec.kind == "json_schema":
        answer = [f'answer: {channel} "final" {message} final_json',
                  f"final_json: {lark_json(json.loads(spec.source))}"]
    else:
        answer = [_answer_rules(spec)]
    analysis = f'{channel} "analysis" {message} REASONING <[{fmt.end_id}]> <[{fmt.start_id}]> "assistant"'
    return GrammarSpec("lark", "\n".join([f"start: ({analysis})? answer", _REASONING_RULES[0], *answer]))


def _answer_rules(spec: GrammarSpec) -> str:
    """`spec` as Lark rules whose entry is `answer` (Lark grammars name theirs `start`)."""
    if spec.kind == "json_schema":
        return f"answer: {lark_json(json.loads(spec.source))}"
    return re.sub(r"^start:", "answer:", spec.source, count=1, flags=re.MULTILINE)


def reasoning_format(tokenizer: ChatTokenizer,
                     setting: str | None = None) -> ReasoningFormat | HarmonyFormat | None:
    """The model's reasoning format from the operator's setting, else from its chat template; None for
    models that do not reason."""
    if setting is not None:
        if setting == NO_PARSER:
            return None
        if setting == HARMONY or setting in HARMONY_ALIASES:
            found = _harmony_format(tokenizer)
            if found is None:
                raise ValueError(f"reasoning parser {setting!r} needs {', '.join(HARMONY_TOKENS)} as single tokens "
                                 f"of the model's vocabulary")
            return found
        name = PARSER_ALIASES.get(setting, setting)
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {setting!r}; known: {', '.join(parser_names())}")
        found = _format(tokenizer, name)
        if found is None:
            raise ValueError(f"reasoning parser {setting!r} needs {' and '.join(PARSERS[name])} as single tokens "
                             f"of the model's vocabulary")
        return found
    template = tokenizer.template
    if template is None:
        return None
    text = "\n".join(template.sources.values())
    if "<|channel|>" in text and "<|message|>" in text:
        return _harmony_format(tokenizer)
    for name, (start, end) in PARSERS.items():
        if start in text and end in text:
            return _format(tokenizer, name)
    return None


def _format(tokenizer: ChatTokenizer, name: str) -> ReasoningFormat | None:
    start, end = PARSERS[name]
    start_id, end_id = tokenizer.token_to_id(start), tokenizer.token_to_id(end)
    if start_id is None or end_id is None:
        return None
    opening = (tokenizer.token_to_id(token) for token in OPENING_TOKENS.get(name, ()))
    inner = (tokenizer.token_to_id(token) for token in INNER_TOKENS.get(name, ()))
    return ReasoningFormat(name, start_id, end_id, frozenset(i for i in opening if i is not None),
                           frozenset(i for i in inner if i is not None))


def _harmony_format(tokenizer: ChatTokenizer) -> HarmonyFormat | None:
    ids = [tokenizer.token_to_id(token) for token in HARMONY_TOKENS]
    return None if None in ids else HarmonyFormat(HARMONY, *ids)


class ReasoningSplit:
    """Routes each generated token to the reasoning or the answer; the tags themselves go to neither.

    The start tag counts only as the first generated token, blanks aside (a model that does not think this
    time answers directly); everything after the end tag is the answer. GLM's template writes a newline between
    the generation prompt and the block, so its model writes one before the start tag: blank tokens (`is_blank`)
    before the first other token are held until it shows whether they come before a block (then they are its
    layout, counted as reasoning) or begin the answer.
    """

    def __init__(self, fmt: ReasoningFormat, starts_open: bool, is_blank: Callable[[int], bool] | None = None) -> None:
        self.fmt = fmt
        self.in_reasoning = starts_open
        self.finished = False            # the end tag was seen (or the block never opened)
        self.num_reasoning_tokens = 0
        self._is_blank = is_blank
        self._held: list[int] = []       # the blank tokens written so far, before any other

    def split(self, token_ids: list[int], last: bool = False) -> tuple[list[int], list[int]]:
        """(reasoning ids, answer ids) of the next generated tokens; `last`: the output ends with them, so blanks
        still held are the answer (one that is only blanks, or cut by max_tokens before its first word)."""
        reasoning, answer = [], []
        for token_id in token_ids:
            if self.in_reasoning:
                self.num_reasoning_tokens += 1
                if token_id == self.fmt.end_id:
                    self.in_reasoning, self.finished = False, True
                else:
                    reasoning.append(token_id)
            elif self.finished:
                answer.append(token_id)
            elif token_id == self.fmt.start_id:
                self.in_reasoning = True
                self.num_reasoning_tokens += 1 + len(self._held)
                self._held = []
            elif self._is_blank is not None and self._is_blank(token_id):
                self._held.append(token_id)
            else:
                self.finished = True
                answer += [*self._held, token_id]
                self._held = []
        if last and self._held:
            answer, self._held = [*self._held, *answer], []
        return reasoning, answer


# A header holds a role, a channel, a recipient and a content type: a few tokens. Output whose "header" runs
# longer without a `<|message|>` is no harmony message (a model answering in plain text): it is the answer.
MAX_HARMONY_HEADER_TOKENS = 48
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_HARMONY_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class HarmonySplit:
    """Routes each token of a harmony output (the module docstring) to the reasoning or the answer, message by
    message. The output opens inside the first message's header (the prompt wrote `<|start|>assistant`); a
    header is read whole, up to its `<|message|>`, before its body goes anywhere, since the channel and the
    recipient decide where. A call's message reaches the answer as `<|start|>RECIPIENT<|message|>` (the
    recipient's tokens as the tokenizer writes them), its arguments, and `<|call|>`, whichever order its header
    had; nothing else of any header, nor any end token, does. A pure function of the tokens, as ReasoningSplit."""

    def __init__(self, fmt: HarmonyFormat, tokenizer: ChatTokenizer) -> None:
        self.fmt = fmt
        self._tokenizer = tokenizer
        self._header: list[int] | None = []   # the header being read; None inside a body
        self._body = ""                       # where the body goes: "reasoning", "answer" or "call"
        self.num_reasoning_tokens = 0         # the analysis messages' tokens, their headers and ends included

    def split(self, token_ids: list[int], last: bool = False) -> tuple[list[int], list[int]]:
        """(reasoning ids, answer ids) of the next generated tokens."""
        reasoning, answer = [], []
        for token_id in token_ids:
            if self._header is not None:
                self._header_token(token_id, answer)
            elif token_id in self.fmt.end_ids:
                if self._body == "call":
                    answer.append(self.fmt.call_id)
                elif self._body == "reasoning":
                    self.num_reasoning_tokens += 1
                self._header = []
            elif self._body == "reasoning":
                self.num_reasoning_tokens += 1
                reasoning.append(token_id)
            else:
                answer.append(token_id)
        return reasoning, answer

    def _header_token(self, token_id: int, answer: list[int]) -> None:
        if token_id in self.fmt.end_ids:  # a header that ends before its message: nothing of it is words
            self._header = []
        elif token_id != self.fmt.message_id:
            self._header.append(token_id)
            if len(self._header) > MAX_HARMONY_HEADER_TOKENS:
                answer.extend(self._header)
                self._header, self._body = None, "answer"
        else:
            text = self._tokenizer.decode(self._header, skip_special_tokens=False)
            channel, recipient = _HARMONY_CHANNEL.search(text), _HARMONY_RECIPIENT.search(text)
            if recipient is not None:
                self._body = "call"
                answer.extend([self.fmt.start_id, *self._tokenizer.encode(recipient.group(1), False),
                               self.fmt.message_id])
            elif channel is not None and channel.group(1) == "analysis":
                self._body = "reasoning"
                self.num_reasoning_tokens += len(self._header) + 1
            else:  # final, a preamble (commentary to no one), a channel of another name: words for the user
                self._body = "answer"
            self._header = None


class ReasoningStream:
    """One chat stream's reasoning text and answer tokens: `add(ids)` -> (reasoning text delta, answer ids).

    The reasoning is the text the model wrote in its block, special tokens included: a marker the tokenizer
    flags special (a tool call's opening, say) is words of the thoughts like any other, and skipping special
    tokens would drop it. Only the block's own tags (ReasoningSplit) and the end-of-sequence tokens
    (`hidden_ids`: an answer that ends inside its block) are left out."""

    def __init__(self, fmt: ReasoningFormat | HarmonyFormat, starts_open: bool, tokenizer: ChatTokenizer,
                 hidden_ids: frozenset[int] = frozenset(), starts_closed: bool = False) -> None:
        def is_blank(token_id: int) -> bool:
            return not tokenizer.decode([token_id], skip_special_tokens=False).strip()

        self.split = (HarmonySplit(fmt, tokenizer) if isinstance(fmt, HarmonyFormat)
                      else ReasoningSplit(fmt, starts_open, is_blank))
        self._detokenizer = WindowDetokenizer(tokenizer, skip_special_tokens=False)
        self._hidden_ids = hidden_ids
        self._starts_closed = starts_closed  # the prompt closed an empty block: the answer follows a block too
        self._answer_started = False
        self._leading = ""                   # the answer's blank start, until its first word shows where it begins
        self.text = ""

    @property
    def num_reasoning_tokens(self) -> int:
        return self.split.num_reasoning_tokens

    def add(self, token_ids: list[int], last: bool = False) -> tuple[str, list[int]]:
        """`last`: the output ends with these tokens."""
        reasoning_ids, answer_ids = self.split.split(token_ids, last)
        reasoning_ids = [t for t in reasoning_ids if t not in self._hidden_ids]
        delta = self._detokenizer.add(reasoning_ids) if reasoning_ids else ""
        if not self.text:
            delta = delta.lstrip()  # the newline templates put after the start tag
        self.text += delta
        return delta, answer_ids

    def answer_delta(self, delta: str) -> str:
        """The answer's text, without the blanks between the reasoning's end tag (the model's, or the one that
        closed the prompt's empty block) and the answer: the rest of the tag's line and the blank lines after it.
        The answer's first line keeps its indentation (code), and so does an answer right after a prompt whose
        block closed (Qwen3 writes its blank lines after the tag in the prompt: the model's spaces are its own)."""
        if self._answer_started or not (self.num_reasoning_tokens or self._starts_closed):
            return delta
        self._leading += delta
        words = self._leading.lstrip()
        if not words:
            return ""
        self._answer_started = True
        blank = self._leading[:len(self._leading) - len(words)]
        if "\n" not in blank and self.num_reasoning_tokens:
            return words
        return self._leading[blank.rfind("\n") + 1:]
