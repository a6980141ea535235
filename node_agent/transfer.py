"""KV transfer over FetchKV: the sending side turns a payload into chunk messages, the receiving
side streams them back into a KVPayload and refuses anything it cannot trust.

The receiver checks, as chunks arrive: the first chunk carries the layout, prompt token ids and
chunk count; the layout fits this engine; every chunk's size matches its token count and its xxh3
checksum matches its bytes; the stream ends with exactly the announced chunks, covering every layer and
token once. Each byte is checksummed once here (the engine checks again at import). Any failure, including the gRPC call's own, is one
KVTransferError, so Decode has one thing to catch before it recomputes.
"""

from __future__ import annotations

from grpc import aio

from engine.errors import KVTransferError
from engine.kv_export import KVExport
from engine.kv_transfer import KVChunk, KVLayout, KVPayload
from node_agent.proto import agent_pb2


def chunk_message(chunk: KVChunk, export: KVExport | None = None) -> agent_pb2.KVChunk:
    """One chunk on the wire; the first (export given) also carries the layout, prompt and chunk count."""
    msg = agent_pb2.KVChunk(layer=chunk.layer, first_token=chunk.first_token, num_tokens=chunk.num_tokens,
                            data=bytes(chunk.data), checksum=chunk.checksum)
    if export is not None:
        msg.kv_layout = export.layout.to_json()
        msg.token_ids.extend(export.token_ids)
        msg.num_chunks = export.num_chunks
    return msg


class PayloadAssembler:
    """Builds a KVPayload from chunk messages in arrival order, checking each as it comes."""

    def __init__(self, expected_layout: KVLayout, prompt_ids: list[int]):
        self._expected = expected_layout
        self._prompt_ids = prompt_ids
        self.payload: KVPayload | None = None
        self._num_chunks = 0
        self.num_bytes = 0

    def add(self, msg: agent_pb2.KVChunk) -> None:
        if self.payload is None:
            if not msg.kv_layout or not msg.num_chunks:
                raise KVTransferError("the first KV chunk lacks the layout and chunk count")
            self.start(msg.kv_layout, list(msg.token_ids), msg.num_chunks)
        self.add_chunk(KVChunk(msg.layer, msg.first_token, msg.num_tokens, msg.data, msg.checksum))

    def start(self, layout_json: str, token_ids: list[int], num_chunks: int) -> None:
        layout = KVLayout.from_json(layout_json)
        if token_ids != self._prompt_ids:
            raise KVTransferError(f"the KV source holds a different prompt ({len(token_ids)} tokens) "
                                  f"than this request's ({len(self._prompt_ids)} tokens)")
        layout.check_fits(self._expected)
        self.payload = KVPayload(layout, token_ids)
        self._num_chunks = num_chunks

    def add_chunk(self, chunk: KVChunk) -> None:
        if self._num_chunks and len(self.payload.chunks) >= self._num_chunks:
            raise KVTransferError(f"KV stream sent more than the {self._num_chunks} chunks it announced")
        chunk.check(self.payload.layout)
        self.payload.chunks.append(chunk)
        self.num_bytes += len(chunk.data)

    def finish(self) -> KVPayload:
        if self.payload is None:
            raise KVTransferError("the KV stream ended before its first chunk")
        if len(self.payload.chunks) != self._num_chunks:
            raise KVTransferError(f"the KV stream ended after {len(self.payload.chunks)} of "
                                  f"{self._num_chunks} chunks")
        self.payload.check_coverage()
        return self.payload


async def receive_payload(call: aio.UnaryStreamCall, expected_layout: KVLayout, prompt_ids: list[int]) -> KVPayload:
    """Drain a FetchKV call into a verified payload; cancels the call on any failure."""
    assembler = PayloadAssembler(expected_layout, prompt_ids)
    try:
        async for msg in call:
            assembler.add(msg)
        return assembler.finish()
    except aio.AioRpcError as exc:
        raise KVTransferError(f"FetchKV failed: {exc.code().name}: {exc.details()}") from exc
    finally:
        call.cancel()  # no-op once the stream has ended; frees the call if we stopped early
