"""The benchmarks' streaming client: each token timed when its event arrives, errors named, connections kept.

A local server plays the router: it answers with a chunked SSE stream, one event at a time with
pauses between, and records when it sent each one.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from benchmarks.harness import StreamClient


def event(tokens: list[str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": "".join(tokens), "finish_reason": finish,
              "logprobs": {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens)}}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


USAGE = b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}).encode() + b"\n\n"


class Server:
    """Answers each request on a connection with `answers`' next item: a list of body pieces
    (written one by one, `pause` seconds apart, as chunks of a chunked body), or (status, body)."""

    def __init__(self, answers: list, pause: float = 0.05, close_after: int | None = None) -> None:
        self.answers, self.pause, self.close_after = list(answers), pause, close_after
        self.sent: list[float] = []      # perf_counter after each piece was written
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if isinstance(answer, tuple):
                    status, body = answer
                    writer.write(f"HTTP/1.1 {status} Bad Request\r\ncontent-length: {len(body)}\r\n"
                                 "content-type: application/json\r\n\r\n".encode() + body)
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                             b"x-edgefire-prefill-site: p\r\nx-edgefire-decode-site: d\r\n\r\n")
                for index, piece in enumerate(answer):
                    if self.close_after is not None and index == self.close_after:
                        writer.close()
                        return
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    await writer.drain()
                    self.sent.append(time.perf_counter())
                    await asyncio.sleep(self.pause)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc_info) -> None:
        self.server.close()


BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 0}


async def test_each_token_is_timed_when_its_event_arrives_not_when_the_answer_ends():
    pieces = [event(["a"]), event(["b", "c"]), event(["d"], finish="length") + USAGE + b"data: [DONE]\n\n"]
    server = Server([pieces])
    async with server as url, StreamClient(url, "key") as client:
        result = await client.stream("/v1/completions", BODY, kind="stream")
    assert not result.error, result.error
    assert result.text == "abcd" and result.num_tokens == 4 and result.prompt_tokens == 5
    assert (result.prefill_site, result.decode_site, result.kind) == ("p", "d", "stream")
    assert len(result.token_times) == 4 and result.token_times[1] == result.token_times[2]  # one event, two tokens
    # each token arrived after its event was sent, and the first long before the last was sent
    sent = [server.sent[0], server.sent[1], server.sent[1], server.sent[2]]
    assert all(arrived >= sent_at - 0.002 for arrived, sent_at in zip(result.token_times, sent))
    assert result.token_times[0] < server.sent[2] - 0.05
    assert result.ttft_s == pytest.approx(result.token_times[0] - result.started)
    request = server.requests[0].decode()
    assert "Authorization: Bearer key" in request and json.loads(request.split("\r\n\r\n")[1])["stream"] is True


async def test_one_connection_carries_request_after_request():
    answer = [event(["a"], finish="length") + b"data: [DONE]\n\n"]
    server = Server([answer, list(answer), list(answer)], pause=0.0)
    async with server as url, StreamClient(url) as client:
        results = [await client.stream("/v1/completions", BODY) for _ in range(3)]
    assert [r.error for r in results] == ["", "", ""] and [r.text for r in results] == ["a", "a", "a"]
    assert server.connections == 1


async def test_an_http_error_an_error_event_and_a_cut_stream_each_say_what_happened():
    async with Server([(400, b'{"error": {"message": "max_tokens must be positive"}}')]) as url, \
            StreamClient(url) as client:
        result = await client.stream("/v1/completions", BODY)
    assert result.error.startswith("HTTP 400") and "max_tokens must be positive" in result.error

    error = b'data: {"error": {"message": "every site failed", "type": "server_error"}}\n\n'
    async with Server([[event(["a"]), error]], pause=0.0) as url, StreamClient(url) as client:
        result = await client.stream("/v1/completions", BODY)
    assert result.error == "every site failed"

    async with Server([[event(["a"]), event(["b"])]], pause=0.0, close_after=1) as url, StreamClient(url) as client:
        result = await client.stream("/v1/completions", BODY)
    assert "closed the connection" in result.error

    async with Server([[event(["a"]) + b"data: [DONE]\n\n"]], pause=0.0) as url, StreamClient(url) as client:
        result = await client.stream("/v1/completions", BODY)
    assert result.error == "stream ended without a finish reason after 1 tokens"
