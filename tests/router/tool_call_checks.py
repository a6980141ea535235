"""What the key/value tool-call formats' tests (test_tool_calls_glm.py, test_tool_calls_xml.py) read the same way:
streamed call deltas joined, a grammar's verdict on a text, a replayed conversation rendered, and an OpenAI client's
stream of a chat completion gathered."""

from __future__ import annotations

from engine.grammar import GrammarCompiler
from router.tool_calls import ToolCallStream
from tests.engine.chat_checkpoints import TEMPLATES


def deltas_joined(deltas: list[dict]) -> list[dict]:
    """The calls the OpenAI tool_calls deltas add up to: each opened once (its id, name and no arguments), its
    arguments then appended."""
    calls: list[dict] = []
    for delta in deltas:
        part, = delta["tool_calls"]
        if "id" in part:
            assert part["index"] == len(calls) and part["function"]["arguments"] == ""
            calls.append({"name": part["function"]["name"], "arguments": ""})
        else:
            calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return calls


def stream_in_pieces(fmt, names: frozenset[str], text: str, step: int):
    """text through a ToolCallStream, step characters at a time: (content, calls, deltas, joined), joined holding
    (end of the piece, the calls its deltas so far add up to) after each piece."""
    stream, sent, deltas, joined = ToolCallStream(fmt, names=names), "", [], []
    for end in range(step, len(text) + step, step):
        sent += stream.add(text[end - step:end])
        deltas += stream.take_deltas()
        joined.append((end, deltas_joined(deltas)))
    tail, calls = stream.finish()
    deltas += stream.take_deltas()
    return sent + tail, calls, deltas, joined


def grammar_compiler(tokenizer, template: str) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.tokenizer.to_str(), tokenizer.vocab_size,
                           [tokenizer.token_to_id(TEMPLATES[template][1])])


def grammar_accepts(compiler: GrammarCompiler, tokenizer, spec, text: str) -> bool:
    matcher = compiler.matcher(spec)
    return (all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False))
            and matcher.matcher.is_accepting())


def replayed_conversation(tokenizer, tools: list[dict], arguments: list[dict]) -> str:
    """A user turn, the assistant's calls of `write` and `now` with arguments, and their results, rendered by the
    template for the next assistant turn."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
             for i, (name, arguments) in enumerate(zip(["write", "now"], arguments))]
    messages = [{"role": "user", "content": "Note it, and the time."},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "written"},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)


async def read_chat_stream(client, body: dict):
    """A streamed chat completion as the OpenAI client reads it: (calls as (name, arguments), reasoning, content,
    finish_reason, how many chunks carried arguments)."""
    streamed, reasoning, content, finish, num_argument_chunks = {}, "", "", None, 0
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or ():
                name, arguments = streamed.get(part.index, ("", ""))
                streamed[part.index] = (name + (part.function.name or ""), arguments + (part.function.arguments or ""))
                num_argument_chunks += bool(part.function.arguments)
            finish = choice.finish_reason or finish
    return list(streamed.values()), reasoning, content, finish, num_argument_chunks
