"""How a request's events become its stream's messages (node_agent.service.send_tokens): what travels
together, what each message says, and a client gone mid-write ending the request at once."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import TokenEvent
from node_agent.proto import agent_pb2
from node_agent.service import send_tokens


class Context:
    """The part of a gRPC servicer context send_tokens uses; `fail_at`: the write that finds the client gone."""

    def __init__(self, fail_at: int | None = None):
        self.messages: list[agent_pb2.TokenChunk] = []
        self.fail_at = fail_at

    async def write(self, message: agent_pb2.TokenChunk) -> None:
        if len(self.messages) == self.fail_at:
            raise asyncio.CancelledError()
        self.messages.append(message)


def event(token_id: int, more: bool = False, finish_reason: str | None = None, logprob: float | None = None,
          top_logprobs=None, **counts) -> TokenEvent:
    fields = dict(num_prompt_tokens=9, num_cached_tokens=0, num_accepted_prediction_tokens=0,
                  num_rejected_prediction_tokens=0)
    fields.update(counts)
    return TokenEvent(token_id, logprob, top_logprobs, finish_reason, more=more, **fields)


async def stream_of(events: list[TokenEvent], closed: list[bool] | None = None):
    try:
        for e in events:
            yield e
    finally:
        if closed is not None:
            closed.append(True)


async def test_tokens_waiting_together_travel_in_one_message_and_the_last_ends_it():
    events = [event(1), event(2, more=True), event(3, more=True), event(4, num_cached_tokens=4),
              event(5, more=True, finish_reason="length", num_cached_tokens=4, num_accepted_prediction_tokens=2,
                    num_rejected_prediction_tokens=1)]
    context = Context()
    await send_tokens(stream_of(events), context)
    assert [[t.token_id for t in m.tokens] for m in context.messages] == [[1], [2, 3, 4], [5]]
    assert [m.finish_reason for m in context.messages] == ["", "", "length"]
    assert [m.num_prompt_tokens for m in context.messages] == [9, 9, 9]
    assert [m.num_cached_tokens for m in context.messages] == [0, 4, 4]
    last = context.messages[-1]
    assert (last.num_accepted_prediction_tokens, last.num_rejected_prediction_tokens) == (2, 1)


async def test_logprobs_travel_only_with_the_tokens_that_have_them():
    events = [event(1, more=True), event(2, logprob=-0.5, top_logprobs=[(2, -0.5), (7, -1.25)]),
              event(3, finish_reason="stop", logprob=-2.0, top_logprobs=[])]
    context = Context()
    await send_tokens(stream_of(events), context)
    first, second = context.messages
    assert not first.tokens[0].HasField("logprob") and not first.tokens[0].top_logprobs
    assert first.tokens[1].logprob == -0.5
    assert [(t.token_id, t.logprob) for t in first.tokens[1].top_logprobs] == [(2, -0.5), (7, -1.25)]
    assert second.tokens[0].logprob == -2.0 and second.finish_reason == "stop"


async def test_a_write_that_finds_the_client_gone_closes_the_request_at_once():
    """The request's stream is closed before send_tokens returns, not when it is collected: that close is
    what aborts the request in the engine and frees its blocks."""
    closed: list[bool] = []
    context = Context(fail_at=1)
    with pytest.raises(asyncio.CancelledError):
        await send_tokens(stream_of([event(i) for i in range(1, 6)], closed), context)
    assert closed == [True] and len(context.messages) == 1
