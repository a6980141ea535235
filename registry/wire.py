"""The wire contracts between agents, registry and routers: what an agent reports about its capacity,
field by field, with the types and bounds that agent, registry and router all hold it to; and which
roles a site offers (`RoleOffer`), the one rule every view of a site's role reads.

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

Several models at one site. Each model an agent hosts has an engine with its own KV pool and prefix
cache. The site's figures are their sums (what the planner and `edgefire status` read); an agent
hosting more than one model also sends each model's own pool and cache under `models` (a single-model
site sends none: its figures are its model's, and its heartbeat stays as small as ever). The routers
check a request's KV headroom and prefix-cache hits against its model's own figures
(`SnapshotCapacity.own`), and the site's where the site does not report the model apart (an older
agent). Every prefix-cache hash of a heartbeat counts against one cap, `MAX_CACHE_HASHES`, which the
agent shares among its models. A registry older than `models` refuses the field; the agent then
sends the heartbeat without it and folds every model's hashes into the site's summary, the shape
agents sent before (`CapacityReport.to_json`).

Role offer: the registry computes each site's `RoleOffer` once (registry.snapshot) and publishes it
as the site's `role_offer` in the routers' snapshot and the admin API; the planner, `edgefire status`,
the dashboard and the routers read that field instead of re-deriving it. A snapshot from a registry
older than the field is read by the same rule (`read_role_offer`).

Packed hashes. Prefix-cache hashes are most of a large fleet's snapshot, and as JSON strings each
takes 19 bytes for 8 of information. A router that asks for `PACKED_SNAPSHOT_MEDIA_TYPE` (HTTP
`Accept`) gets every summary of the snapshot with `packed_hashes` instead of `hashes`: the same
hashes in the same order, as base64 of 8-byte big-endian words (`pack_cache_hashes`);
`SnapshotCacheSummary` reads either shape, so a router reads a registry older than the format too.

Held and evictable cached blocks. A summary lists first the blocks that running sequences or KV leases
hold, then the evictable ones (no user left: the engine counts them in `kv_blocks_free` and reuses them
for new blocks); `num_held` says how many of its leading hashes are held. A request reusing a held block
takes no free block for it, while reusing an evictable one takes it out of the free pool, so a router
credits only held hits against the free blocks a request needs (the agent's admission does the same:
engine BlockManager.shared_prefix_blocks), and every hit against its prefill time. A summary without
`num_held` (an agent older than the field) is read as all held: the credit routers gave every cached
block before. That errs towards trying a site the agent then refuses (RESOURCE_EXHAUSTED, and the
router moves on), never towards passing over a site that would take the request. A registry older than
the field refuses it inside a summary; the agent then leaves it out of every summary
(`CapacityReport.to_json`, `SUMMARY_FIELDS`).

Standard library and pydantic only: the router and the agent import this without the engine.
"""

from __future__ import annotations

import binascii
import math
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, product, zip_longest
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, model_validator

from registry.records import SITE_ROLES
from registry.validate import MAX_MODEL_ID

MAX_INT32 = 2**31 - 1
MAX_JSON_INT = 2**53 - 1
MAX_BLOCK_SIZE = 4096  # tokens per KV block
MAX_TOKENS_PER_S = 1e12
MAX_CACHE_HASHES = 16_384  # ~300 KB of JSON per heartbeat at most, over the site's and every model's summary
MAX_MODELS_PER_SITE = 256
CACHE_HASH_HEX_DIGITS = 16  # engine.prefix_hash hashes are 64-bit
CACHE_HASH_BYTES = CACHE_HASH_HEX_DIGITS // 2
MAX_PACKED_HASH_CHARS = 4 * math.ceil(MAX_CACHE_HASHES * CACHE_HASH_BYTES / 3)  # base64 of the cap's worth
# The routers' snapshot with every prefix-cache summary's hashes packed (see "Packed hashes" above).
PACKED_SNAPSHOT_MEDIA_TYPE = "application/vnd.edgefire.snapshot-packed+json"

Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
LargeCount = Annotated[int, Field(ge=0, le=MAX_JSON_INT)]
BlockSize = Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)]
TokensPerSecond = Annotated[float, Field(ge=0.0, le=MAX_TOKENS_PER_S, allow_inf_nan=False)]
CacheHash = Annotated[str, StringConstraints(pattern=rf"^[0-9a-f]{{{CACHE_HASH_HEX_DIGITS}}}$")]
ModelId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_MODEL_ID)]


class WireModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PrefixCacheSummary(WireModel):
    """The blocks a site's prefix cache holds, most recently used first: the held ones, then the evictable
    ones (see "Held and evictable cached blocks" above)."""

    block_size: BlockSize = Field(description="tokens per hashed block")
    hashes: list[CacheHash] = Field(default_factory=list, max_length=MAX_CACHE_HASHES,
                                    description="engine.prefix_hash block hashes, 16 lower-case hex digits each")
    num_held: int | None = Field(None, ge=0, le=MAX_CACHE_HASHES, exclude_if=lambda value: value is None,
                                 description="how many of the leading hashes running sequences or KV leases hold; "
                                             "the rest are evictable. Absent: all of them")

    @model_validator(mode="after")
    def _checked(self) -> PrefixCacheSummary:
        return self._held_within_hashes()

    def _held_within_hashes(self) -> PrefixCacheSummary:
        if self.num_held is not None and self.num_held > self.num_hashes:
            raise ValueError(f"num_held must be at most the number of hashes ({self.num_hashes}), got {self.num_held}")
        return self

    def hash_words(self) -> tuple[int, ...]:
        """The hashes as integers, in order."""
        # Each hash is 16 hex digits (CacheHash checks it), so all of them are one run of big-endian
        # 8-byte words: read in C, 2.4x faster than an int() per hash (a router reads every site's
        # summary on each snapshot refresh).
        return struct.unpack(f">{len(self.hashes)}Q", bytes.fromhex("".join(self.hashes)))

    @property
    def num_hashes(self) -> int:
        return len(self.hashes)


# Optional fields of a summary that an older registry may refuse, each left out of every summary once it
# does (CapacityReport.to_json): named as the registry's 422 names the site's, "prefix_cache_summary.<field>".
SUMMARY_FIELDS = ("prefix_cache_summary.num_held",)


def _num_hashes(summary: PrefixCacheSummary | None) -> int:
    return 0 if summary is None else summary.num_hashes


def pack_cache_hashes(hashes: list[str]) -> str:
    """Hex cache hashes (as `PrefixCacheSummary` holds them) as the packed format's `packed_hashes`."""
    return binascii.b2a_base64(bytes.fromhex("".join(hashes)), newline=False).decode("ascii")


class SnapshotCacheSummary(PrefixCacheSummary):
    """A prefix-cache summary as the routers' snapshot carries it: `hashes`, or in the packed format
    `packed_hashes`, which a router turns into integers with no string per hash."""

    model_config = ConfigDict(extra="ignore")  # fields a newer registry adds

    packed_hashes: str | None = Field(None, max_length=MAX_PACKED_HASH_CHARS,
                                      description="the hashes as base64 of 8-byte big-endian words, in order")
    _packed: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _checked(self) -> SnapshotCacheSummary:  # in place of the base's: num_held is checked once unpacked
        if self.packed_hashes is None:
            return self._held_within_hashes()
        if self.hashes:
            raise ValueError("a prefix-cache summary carries either hashes or packed_hashes, not both")
        try:
            packed = binascii.a2b_base64(self.packed_hashes, strict_mode=True)
        except ValueError as exc:  # binascii.Error, or a character that is not ASCII
            raise ValueError(f"packed_hashes is not valid base64 ({exc})") from None
        if len(packed) % CACHE_HASH_BYTES:
            raise ValueError(f"packed_hashes decodes to {len(packed)} bytes, not a whole number of "
                             f"{CACHE_HASH_BYTES}-byte hashes")
        self._packed = packed
        return self._held_within_hashes()

    @property
    def num_hashes(self) -> int:
        return len(self.hashes) if self._packed is None else len(self._packed) // CACHE_HASH_BYTES

    def hash_words(self) -> tuple[int, ...]:
        if self._packed is None:
            return super().hash_words()
        return struct.unpack(f">{self.num_hashes}Q", self._packed)


class ModelCapacity(WireModel):
    """One model's own figures at a site that hosts several: its engine's KV pool and prefix cache."""

    kv_blocks_total: LargeCount
    kv_blocks_free: LargeCount
    prefix_cache_summary: PrefixCacheSummary | None = None

    @model_validator(mode="after")
    def _free_within_total(self) -> ModelCapacity:
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError("kv_blocks_free cannot exceed kv_blocks_total")
        return self


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
    # Each model's own KV pool and prefix cache, from an agent hosting several (None: one model, or an
    # older agent; the site's figures are then the only ones).
    models: dict[ModelId, ModelCapacity] | None = Field(None, max_length=MAX_MODELS_PER_SITE)

    @model_validator(mode="after")
    def _consistent(self) -> CapacityReport:
        # One validator, not two: every heartbeat passes here, and each is a Python call.
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError("kv_blocks_free cannot exceed kv_blocks_total")
        if self.models is not None:  # without them the site's summary alone is capped by its max_length
            num_hashes = _num_hashes(self.prefix_cache_summary) + sum(
                _num_hashes(own.prefix_cache_summary) for own in self.models.values())
            if num_hashes > MAX_CACHE_HASHES:
                raise ValueError(f"the prefix-cache summaries hold {num_hashes} hashes in all, over the cap of "
                                 f"{MAX_CACHE_HASHES}: share the cap among the models")
        return self

    def to_json(self, left_out: Collection[str] = ()) -> dict:
        """The heartbeat body, less the optional fields in `left_out` (those a registry older than the agent
        does not know). `models` travels only when set. Left out, each model's hashes go into the site's
        summary instead, one list for all models as agents sent it before: an older registry and its routers
        keep the site's prefix-cache affinity."""
        body = self.model_dump(mode="json", exclude={"models", *left_out})
        if self.models is not None:
            if "models" not in left_out:
                body["models"] = {name: own.model_dump(mode="json") for name, own in self.models.items()}
            elif "prefix_cache_summary" not in left_out:
                body["prefix_cache_summary"] = self._folded_summary().model_dump(mode="json")
        summary_fields = [name.partition(".")[2] for name in left_out if name in SUMMARY_FIELDS]
        if summary_fields:
            summaries = [body.get("prefix_cache_summary"),
                         *(own.get("prefix_cache_summary") for own in (body.get("models") or {}).values())]
            for summary, name in product(summaries, summary_fields):
                if summary is not None:
                    summary.pop(name, None)
        return body

    def _folded_summary(self) -> PrefixCacheSummary:
        """The site's summary with every model's hashes (within the cap already): the models' held hashes
        interleaved, then their evictable ones, so the most recently used of each come first as in one
        engine's list, and the held ones lead as `num_held` says; equal hashes once. Unknown (None: all held)
        where a summary with hashes does not say."""
        site = self.prefix_cache_summary
        summaries = [own.prefix_cache_summary for own in self.models.values() if own.prefix_cache_summary]

        def held(summary: PrefixCacheSummary | None) -> list[str]:
            return summary.hashes[:summary.num_held] if summary else []

        def evictable(summary: PrefixCacheSummary | None) -> list[str]:
            return summary.hashes[summary.num_held:] if summary and summary.num_held is not None else []

        def interleaved(lists: list[list[str]]) -> Iterable[str]:
            return (h for h in chain.from_iterable(zip_longest(*lists)) if h is not None)

        held_hashes = dict.fromkeys(chain(held(site), interleaved([held(summary) for summary in summaries])))
        hashes = dict.fromkeys(chain(held_hashes, evictable(site),
                                     interleaved([evictable(summary) for summary in summaries])))
        unknown = any(summary.num_held is None and summary.hashes for summary in (site, *summaries)
                      if summary is not None)
        return PrefixCacheSummary(block_size=site.block_size if site else self.block_size, hashes=list(hashes),
                                  num_held=None if unknown else len(held_hashes))


class _CacheLookup:
    """What a router reads of a prefix-cache summary (mixed into the snapshot's capacity models, which
    hold the `prefix_cache_summary`)."""

    @property
    def cache_block_size(self) -> int:
        """Block size of the prefix-cache summary; 0 when it holds no cached blocks."""
        summary = self.prefix_cache_summary
        return summary.block_size if summary is not None and summary.num_hashes else 0

    @property
    def cached_hashes(self) -> frozenset[int]:
        """Every block hash the summary lists."""
        return self._cache_sets[0]

    @property
    def held_hashes(self) -> frozenset[int]:
        """Those of `cached_hashes` that running sequences or KV leases hold (all of them where the summary
        does not say): a request reusing one takes no free block for it."""
        return self._cache_sets[1]

    @cached_property
    def _cache_sets(self) -> tuple[frozenset[int], frozenset[int]]:
        summary = self.prefix_cache_summary
        if summary is None:
            return frozenset(), frozenset()
        words = summary.hash_words()
        cached = frozenset(words)
        if summary.num_held is None or summary.num_held >= len(words):
            return cached, cached
        return cached, frozenset(words[:summary.num_held])


class SnapshotModelCapacity(_CacheLookup, ModelCapacity):
    """A model's own figures as the routers' snapshot carries them."""

    model_config = ConfigDict(extra="ignore")  # fields a newer registry adds

    prefix_cache_summary: SnapshotCacheSummary | None = None


class SnapshotCapacity(_CacheLookup, CapacityReport):
    """A site's capacity as the routers' snapshot carries it: the heartbeat plus when it arrived."""

    # Fields a newer registry adds are ignored, so routers can be upgraded after registries.
    model_config = ConfigDict(extra="ignore")

    reported_at: float | None = Field(None, allow_inf_nan=False,
                                      description="when the registry stored it (its clock, seconds since the epoch)")
    prefix_cache_summary: SnapshotCacheSummary | None = None
    models: dict[ModelId, SnapshotModelCapacity] | None = Field(None, max_length=MAX_MODELS_PER_SITE)

    def own(self, model: str) -> SnapshotCapacity | SnapshotModelCapacity:
        """The KV pool and prefix cache a request for `model` meets here: the model's own where the site
        reports it apart, else the site's (a single-model site, or an agent older than `models`)."""
        return self.models.get(model, self) if self.models else self


def offered_roles(site_roles: Iterable[str], model_role: str, active_role: str | None) -> tuple[str, ...]:
    """The roles a site takes one model's work in: those the operator allows the site (its `roles`),
    that it serves the model in (the model's role, where "both" is either), and that the pool
    planner's pick leaves it (`active_role`; None: no pick). The site's state (cordoned, draining)
    and liveness are not part of it: every view shows them beside the role."""
    return tuple(role for role in SITE_ROLES
                 if role in site_roles and model_role in (role, "both") and active_role in (None, role))


@dataclass(slots=True, frozen=True)
class RoleOffer:
    """Which roles a site offers, per model, now; a site with no models offers nothing."""

    by_model: dict[str, tuple[str, ...]]  # model -> the roles the site takes its work in
    flexible: bool  # without the planner's pick it offers both roles: the planner may move it between pools

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles the site takes any work in."""
        return tuple(role for role in SITE_ROLES if any(role in roles for roles in self.by_model.values()))

    def serves(self, model: str, role: str) -> bool:
        return role in self.by_model.get(model, ())

    def to_json(self) -> dict:
        return {"roles": list(self.roles), "by_model": {model: list(roles) for model, roles in self.by_model.items()},
                "flexible": self.flexible}


def role_offer(site_roles: Iterable[str], models: Iterable[tuple[str, str]], active_role: str | None) -> RoleOffer:
    """The offer of a site allowed `site_roles`, serving (model, model role) pairs, with the planner's pick."""
    site_roles, models = tuple(site_roles), list(models)
    unnarrowed = {role for _, model_role in models for role in offered_roles(site_roles, model_role, None)}
    return RoleOffer({model: offered_roles(site_roles, model_role, active_role) for model, model_role in models},
                     unnarrowed == set(SITE_ROLES))


def read_role_offer(site: dict) -> RoleOffer:
    """A snapshot site's `role_offer` as the registry published it; for a site from an older registry's
    snapshot, which has none, the offer by the same rule from its roles, models and active role.
    Raises TypeError when the field is malformed."""
    published = site.get("role_offer")
    if published is None:
        models = [(entry["model"], entry.get("role", "both")) for entry in site.get("models") or ()]
        return role_offer(site.get("roles") or SITE_ROLES, models, site.get("active_role"))
    if not isinstance(published, dict):
        raise TypeError("role_offer must be an object")
    by_model, flexible = published.get("by_model"), published.get("flexible")
    if not isinstance(by_model, dict) or not isinstance(flexible, bool):
        raise TypeError("role_offer must be an object with a 'by_model' object and a 'flexible' boolean")
    for model, roles in by_model.items():
        if not isinstance(roles, list) or not set(roles) <= set(SITE_ROLES) or len(set(roles)) != len(roles):
            raise TypeError(f"role_offer.by_model[{model!r}] must be a list of distinct roles from {list(SITE_ROLES)}")
    return RoleOffer({model: tuple(role for role in SITE_ROLES if role in roles) for model, roles in by_model.items()},
                     flexible)
