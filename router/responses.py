"""OpenAI response and stream-chunk bodies, built from plain values, and their one JSON encoding."""

from __future__ import annotations

import json
from collections.abc import Callable
from json.encoder import encode_basestring

from engine.tokenizer import ChatTokenizer

encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
_SPLICE = "\x00edgefire-text\x00"  # stands in for a chunk's text while its bytes are built


class ChunkEncoder:
    """The JSON bodies of one stream's chunks.

    Nearly every chunk carries only new text, so its bytes are a head and a tail encoded once per
    stream with the text spliced between them; every other chunk is encoded whole. Both give the
    bytes of `encode_json(chunk).encode()`.
    """

    def __init__(self, response_id: str, created: int, model: str, chat: bool, index: int = 0) -> None:
        template = (chat_chunk(response_id, created, model, {"content": _SPLICE}, None, None, index) if chat
                    else completion_chunk(response_id, created, model, _SPLICE, None, None, index))
        head, tail = encode_json(template).split(encode_basestring(_SPLICE))
        self._head, self._tail = head.encode(), tail.encode()

    def text(self, text: str) -> bytes:
        """The chunk with `text` and nothing else: no logprobs, no finish reason."""
        return self._head + encode_basestring(text).encode() + self._tail

    @staticmethod
    def encode(chunk: dict) -> bytes:
        return encode_json(chunk).encode()


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int,
          num_reasoning_tokens: int | None = None, prediction: tuple[int, int] | None = None) -> dict:
    """`num_reasoning_tokens` is None for models that do not reason, `prediction` (the predicted output's
    proposed tokens kept, and rejected) for requests without one; with neither, no completion_tokens_details."""
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
    details = {}
    if num_reasoning_tokens is not None:
        details["reasoning_tokens"] = num_reasoning_tokens
    if prediction is not None:
        details["accepted_prediction_tokens"], details["rejected_prediction_tokens"] = prediction
    if details:
        body["completion_tokens_details"] = details
    return body


# The tier a chat request was served at, as OpenAI reports it: whatever `service_tier` asked for, there is one.
SERVICE_TIER = "default"


def chat_chunk(response_id: str, created: int, model: str, delta: dict, finish_reason: str | None,
               logprobs: list[dict] | None, index: int = 0) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "service_tier": SERVICE_TIER,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason}]}


def completion_chunk(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     logprobs: dict | None, index: int = 0) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(response_id: str, created: int, model: str, chat: bool, usage_body: dict) -> dict:
    if chat:
        return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "service_tier": SERVICE_TIER, "choices": [], "usage": usage_body}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model, "choices": [],
            "usage": usage_body}


def chat_response(response_id: str, created: int, model: str, text: str, finish_reason: str,
                  logprobs: list[dict] | None, usage_body: dict, reasoning: str | None = None,
                  reasons: bool = False, tool_calls: list[dict] | None = None, index: int = 0) -> dict:
    """`reasons`: the model is a reasoning model, so the message carries `reasoning_content` (maybe null).
    A message with tool calls has `content` null when the model wrote nothing besides them, as OpenAI's."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["content"] = text if text.strip() else None
        message["tool_calls"] = tool_calls
    if reasons:
        message["reasoning_content"] = reasoning
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "service_tier": SERVICE_TIER,
            "choices": [{"index": index, "message": message,
                         "logprobs": None if logprobs is None else {"content": logprobs},
                         "finish_reason": finish_reason}],
            "usage": usage_body}


def completion_response(response_id: str, created: int, model: str, text: str, finish_reason: str,
                        logprobs: dict | None, usage_body: dict, index: int = 0) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_body}


def chat_logprobs(tokenizer: ChatTokenizer, tokens: list,
                  token_bytes: Callable[[int], bytes] | None = None) -> list[dict]:
    """Chat format: one entry per sampled token with its top alternatives. `token_bytes` gives a token's
    own bytes (router.model_assets), so the entries' bytes join into the answer's UTF-8 even where a
    character spans tokens; without it they are the bytes of each token's text."""
    return [{**_chat_entry(tokenizer, t.token_id, t.logprob, token_bytes),
             "top_logprobs": [_chat_entry(tokenizer, top.token_id, top.logprob, token_bytes)
                              for top in t.top_logprobs]}
            for t in tokens]


def completion_logprobs(tokenizer: ChatTokenizer, tokens: list, text_offset: int) -> dict:
    """Legacy completions format: parallel arrays."""
    texts = [_token_text(tokenizer, t.token_id) for t in tokens]
    offsets, offset = [], text_offset
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_token_text(tokenizer, top.token_id): top.logprob for top in t.top_logprobs}
                             for t in tokens],
            "text_offset": offsets}


def merge_completion_logprobs(into: dict | None, more: dict) -> dict:
    if into is None:
        return more
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        into[name].extend(more[name])
    return into


def _chat_entry(tokenizer: ChatTokenizer, token_id: int, logprob: float,
                token_bytes: Callable[[int], bytes] | None) -> dict:
    text = _token_text(tokenizer, token_id)
    raw = token_bytes(token_id) if token_bytes is not None else text.encode()
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _token_text(tokenizer: ChatTokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
