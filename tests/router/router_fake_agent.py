"""A deterministic fake agent (grpc.aio) for router tests and the overhead benchmark.

The token at output position i depends only on the prompt and i, exactly as greedy decoding
would, so a stream resumed elsewhere with the tokens already sent matches a fault-free run.
Fault switches: `refuse` (a status code before the first token), `die_after` (abort UNAVAILABLE
after k tokens of a stream), `hang` (never answer; `hang_if` for chosen calls), `stall_after` (go
silent after k tokens of a stream), `token_delay_s`; `tokens_per_chunk` sends tokens k to a message,
as a speculating agent does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from engine.tokenizer import ChatTokenizer
from node_agent.proto import agent_pb2, agent_pb2_grpc

MODEL = "tiny-llama"
EMBED_SIZE = 8   # the length of the fake embeddings


def model_info_from_dir(model_dir: str | Path, model: str = MODEL) -> agent_pb2.ModelInfo:
    model_dir = Path(model_dir)
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    return agent_pb2.ModelInfo(
        model=model, tokenizer_json=(model_dir / "tokenizer.json").read_text(),
        tokenizer_config_json=(model_dir / "tokenizer_config.json").read_text(),
        generation_config_json=json.dumps(generation_config), context_length=1024, block_size=16,
        kv_bytes_per_token=4096, eos_token_ids=generation_config["eos_token_id"])


def word_token_ids(info: agent_pb2.ModelInfo) -> list[int]:
    """Ids of whole words with a leading space, so any sequence of them reads as plain text."""
    tokenizer = ChatTokenizer(info.tokenizer_json, json.loads(info.tokenizer_config_json))
    vocab = tokenizer.tokenizer.get_vocab()
    return sorted(i for t, i in vocab.items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3)


class FakeAgent(agent_pb2_grpc.AgentServicer):
    def __init__(self, name: str, info: agent_pb2.ModelInfo, words: list[int]) -> None:
        self.name = name
        self.info = info
        self.words = words
        self.eos_id = info.eos_token_ids[0]
        self.eos_at: int | None = None        # emit EOS at this output position (finish "stop")
        self.refuse: grpc.StatusCode | None = None
        self.refuse_methods: frozenset[str] | None = None  # refuse only these RPCs (None: every one)
        self.die_after: int | None = None
        self.hang = False
        self.hang_if: Callable[[str, object], bool] | None = None  # (method, request): hang that call as `hang` does
        self.stall_after: int | None = None
        self.token_delay_s = 0.0
        self.tokens_per_chunk = 1
        self.num_cached_tokens = 0
        self.calls: list[tuple[str, object]] = []
        self.metadata: list[dict] = []
        self.released: list[str] = []
        self.released_lease_ids: list[str] = []
        self.num_cancelled = 0
        self.num_health_checks = 0
        self.health_load = {"kv_blocks_total": 1000, "kv_blocks_free": 1000}  # load figures Health reports
        self.server: grpc.aio.Server | None = None
        self.address = ""

    def token_at(self, prompt_ids, position: int) -> int:
        if self.eos_at is not None and position == self.eos_at:
            return self.eos_id
        seed = sum(prompt_ids) * 31 + len(prompt_ids)
        return self.words[(seed + 7 * position * position + position) % len(self.words)]

    async def start(self, credentials: grpc.ServerCredentials | None = None) -> FakeAgent:
        self.server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(self, self.server)
        if credentials is not None:
            port = self.server.add_secure_port("127.0.0.1:0", credentials)
        else:
            port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)

    async def _gate(self, method: str, request, context) -> None:
        self.calls.append((method, request))
        self.metadata.append(dict(context.invocation_metadata()))
        if self.hang or (self.hang_if is not None and self.hang_if(method, request)):
            await asyncio.sleep(3600)
        if self.refuse is not None and (self.refuse_methods is None or method in self.refuse_methods):
            await context.abort(self.refuse, f"{self.name} refuses")

    async def _stream(self, request, context, start: int):
        prompt, max_tokens = list(request.prompt_ids), request.sampling.max_tokens
        held = []
        for position in range(start, max_tokens):
            if self.die_after is not None and position - start >= self.die_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name} died")
            if self.stall_after is not None and position - start >= self.stall_after:
                await asyncio.sleep(3600)
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            token_id = self.token_at(prompt, position)
            finish = "stop" if token_id == self.eos_id else ("length" if position + 1 == max_tokens else "")
            token = agent_pb2.Token(token_id=token_id)
            if request.sampling.HasField("logprobs"):
                token.logprob = -0.5
                token.top_logprobs.add(token_id=token_id, logprob=-0.5)
            held.append(token)
            if finish or len(held) == self.tokens_per_chunk:
                yield agent_pb2.TokenChunk(tokens=held, finish_reason=finish, num_prompt_tokens=len(prompt),
                                           num_cached_tokens=self.num_cached_tokens)
                held = []
            if finish:
                return

    async def Generate(self, request, context):
        await self._gate("Generate", request, context)
        try:
            async for chunk in self._stream(request, context, len(request.generated_ids)):
                yield chunk
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise

    async def Decode(self, request, context):
        await self._gate("Decode", request, context)
        try:
            async for chunk in self._stream(request, context, len(request.generated_ids)):
                yield chunk
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise

    async def Prefill(self, request, context):
        await self._gate("Prefill", request, context)
        token_id = self.token_at(list(request.prompt_ids), 0)
        done = token_id == self.eos_id or request.sampling.max_tokens <= 1
        finish = ("stop" if token_id == self.eos_id else "length") if done else ""
        return agent_pb2.PrefillResult(
            first_token=agent_pb2.Token(token_id=token_id), kv_handle="" if done else f"kv-{len(self.calls)}",
            num_prompt_tokens=len(request.prompt_ids), num_cached_tokens=self.num_cached_tokens,
            kv_bytes=len(request.prompt_ids) * self.info.kv_bytes_per_token, finish_reason=finish, lease_ttl_s=30)

    async def ReleaseKV(self, request, context):
        if request.kv_handle:
            self.released.append(request.kv_handle)
        if request.lease_id:
            self.released_lease_ids.append(request.lease_id)
        return agent_pb2.ReleaseKVResponse(released=True)

    async def Embed(self, request, context):
        """A vector of EMBED_SIZE values made from each input's token ids (normalized), for routing tests."""
        self.calls.append(("Embed", request))
        if self.refuse is not None and (self.refuse_methods is None or "Embed" in self.refuse_methods):
            await context.abort(self.refuse, "refused")
        if request.model != self.info.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.model} is not served here")
        if request.dimensions > EMBED_SIZE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dimensions: {request.dimensions} exceeds this model's embedding size {EMBED_SIZE}")
        embeddings = []
        for item in request.inputs:
            ids = list(item.token_ids)
            vector = np.array([1 + (sum(ids) * (k + 1)) % 97 for k in range(EMBED_SIZE)], dtype="<f4")
            vector = vector[:request.dimensions or EMBED_SIZE]
            vector /= np.linalg.norm(vector)
            embeddings.append(agent_pb2.Embedding(data=vector.astype("<f4").tobytes(), num_prompt_tokens=len(ids)))
        return agent_pb2.EmbedResponse(embeddings=embeddings, normalized=True)

    async def GetModelInfo(self, request, context):
        self.calls.append(("GetModelInfo", request))
        if request.model != self.info.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"{request.model} is not served here")
        return self.info

    async def Health(self, request, context):
        self.num_health_checks += 1
        return agent_pb2.HealthResponse(status=agent_pb2.HealthResponse.SERVING, site=self.name,
                                        models=[self.info.model], **self.health_load)

    def reference_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """What a fault-free run returns for this prompt."""
        out = []
        for position in range(max_tokens):
            out.append(self.token_at(prompt_ids, position))
            if out[-1] == self.eos_id:
                break
        return out
