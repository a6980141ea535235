"""The heartbeat wire contract: what an agent reports about its capacity, field by field, with the
types and bounds that agent, registry and router all hold it to.

- the agent builds its heartbeat as a `CapacityReport` (node_agent.heartbeat);
- the registry validates every heartbeat body against `CapacityReport` before it is queued for the
  group commit (registry.routes_agent), so nothing it stores can fail a database write;
- the router parses each site's capacity in the snapshot as a `SnapshotCapacity` (router.snapshot):
  the same fields plus the registry's `reported_at`.

Validation is strict: no coercion ("5" is not 5, true is not 1, 5.0 is not an integer), every
integer and rate is bounded, prefix-cache hashes are exactly 16 lower-case hex digits and their
list is capped. The integer bounds are what the registry's columns hold (`registry.tables`:
32-bit for the sequence counts and block size, 64-bit for blocks and tokens; 2**53 keeps the
latter exact in any JSON parser), so a heartbeat that passes here always stores.

To add a field: add it to `CapacityReport` with a default and its bounds, and (registry) a column
in `registry.tables` plus a migration. Agents that do not send it get the default.
Standard library and pydantic only: the router and the agent import this without the engine.
"""

from __future__ import annotations

import struct
from functools import cached_property
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

MAX_INT32 = 2**31 - 1
MAX_JSON_INT = 2**53 - 1
MAX_BLOCK_SIZE = 4096  # tokens per KV block
MAX_TOKENS_PER_S = 1e12
MAX_CACHE_HASHES = 16_384  # ~300 KB of JSON per heartbeat at most
CACHE_HASH_HEX_DIGITS = 16  # engine.prefix_hash hashes are 64-bit

Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
LargeCount = Annotated[int, Field(ge=0, le=MAX_JSON_INT)]
BlockSize = Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)]
TokensPerSecond = Annotated[float, Field(ge=0.0, le=MAX_TOKENS_PER_S, allow_inf_nan=False)]
CacheHash = Annotated[str, StringConstraints(pattern=rf"^[0-9a-f]{{{CACHE_HASH_HEX_DIGITS}}}$")]


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PrefixCacheSummary(WireModel):
    """The blocks a site's prefix cache holds, most recently used first."""

    block_size: BlockSize = Field(description="tokens per hashed block")
    hashes: list[CacheHash] = Field(default_factory=list, max_length=MAX_CACHE_HASHES,
                                    description="engine.prefix_hash block hashes, 16 lower-case hex digits each")

    def hash_values(self) -> frozenset[int]:
        # Each hash is 16 hex digits (CacheHash checks it), so all of them are one run of big-endian
        # 8-byte words: read in C, 2.4x faster than an int() per hash (a router reads every site's
        # summary on each snapshot refresh).
        return frozenset(struct.unpack(f">{len(self.hashes)}Q", bytes.fromhex("".join(self.hashes))))


class CapacityReport(WireModel):
    """One heartbeat: how busy a site is right now (the body of POST /v1/agent/heartbeat)."""

    kv_blocks_total: LargeCount
    kv_blocks_free: LargeCount
    block_size: BlockSize
    num_running: Count = 0
    num_waiting: Count = 0
    inflight_prefill_tokens: LargeCount = 0
    inflight_decode_tokens: LargeCount = 0
    prefill_tokens_per_s: TokensPerSecond = 0.0
    decode_tokens_per_s: TokensPerSecond = 0.0
    # The load decode_tokens_per_s was measured under, averaged like it: sequences per decode step
    # and the KV tokens they held (what each step read). 0: not measured yet.
    decode_batch_size: float = Field(0.0, ge=0.0, le=MAX_INT32, allow_inf_nan=False)
    decode_kv_tokens: float = Field(0.0, ge=0.0, le=MAX_JSON_INT, allow_inf_nan=False)
    prefix_cache_summary: PrefixCacheSummary | None = None
    draining: bool = False
    # The site's devices: the GPUs its engines run on (0: CPU only) and their tensor x pipeline layout,
    # with the experts of a mixture of experts split expert_parallel_size ways per stage.
    num_gpus: Count = 0
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_INT32)
    pipeline_parallel_size: int = Field(1, ge=1, le=MAX_INT32)
    expert_parallel_size: int = Field(1, ge=1, le=MAX_INT32)
    # Speculative decoding: the share of proposed tokens the site's engines kept since start (0: none proposed).
    speculative_acceptance: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _free_within_total(self) -> CapacityReport:
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError("kv_blocks_free cannot exceed kv_blocks_total")
        return self

    def to_json(self) -> dict:
        return self.model_dump(mode="json")


class SnapshotCapacity(CapacityReport):
    """A site's capacity as the routers' snapshot carries it: the heartbeat plus when it arrived."""

    # Fields a newer registry adds are ignored, so routers can be upgraded after registries.
    model_config = ConfigDict(extra="ignore")

    reported_at: float | None = Field(None, allow_inf_nan=False,
                                      description="when the registry stored it (its clock, seconds since the epoch)")

    @property
    def cache_block_size(self) -> int:
        """Block size of the prefix-cache summary; 0 when the site reports no cached blocks."""
        summary = self.prefix_cache_summary
        return summary.block_size if summary is not None and summary.hashes else 0

    @cached_property
    def cached_hashes(self) -> frozenset[int]:
        summary = self.prefix_cache_summary
        return summary.hash_values() if summary is not None else frozenset()
