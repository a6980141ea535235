"""Tokenizer, chat template, limits and sampling defaults of each model, fetched once from any agent serving it.

Concurrent first requests for a model share one fetch. Building the tokenizer parses a large JSON
document, so it runs off the event loop.

The checkpoint's `generation_config.json` supplies the sampling defaults (`temperature`, `top_p`,
`top_k`, `repetition_penalty`) a request gets for the parameters it leaves unset, as vLLM does;
values out of range there are ignored (and logged) rather than failing every request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import llguidance

from engine.errors import CheckpointError
from engine.tokenizer import ChatTokenizer
from node_agent.client import AgentPool
from router.errors import no_capacity
from router.reasoning import HarmonyFormat, ReasoningFormat, fold_preambles, reasoning_format
from router.tool_calls import ToolCallFormat, tool_call_format
from router.snapshot import Snapshot

log = logging.getLogger(__name__)
MODEL_INFO_TIMEOUT_S = 10.0


@dataclass(slots=True)
class ModelAssets:
    model: str
    tokenizer: ChatTokenizer
    context_length: int
    eos_token_ids: list[int]
    block_size: int
    kv_bytes_per_token: int
    generation_config: dict
    sampling_defaults: SamplingDefaults = field(default_factory=lambda: SamplingDefaults())
    reasoning: ReasoningFormat | HarmonyFormat | None = None  # how it marks its reasoning; None: it does not reason
    tool_calls: ToolCallFormat | None = None  # how the model writes tool calls; None: not recognised
    token_bytes: Callable[[int], bytes] | None = None  # a token's own bytes (logprobs' `bytes`); None: its text's

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """A chat request's messages as the model's template takes them: gpt-oss's refuses a calling turn with
        both a preamble and reasoning, which it gets folded (router.reasoning.fold_preambles)."""
        return fold_preambles(messages) if isinstance(self.reasoning, HarmonyFormat) else messages


@dataclass(slots=True)
class SamplingDefaults:
    """The checkpoint's recommended sampling; None where generation_config.json says nothing (or nonsense)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None


# generation_config key -> (lowest, highest, lowest allowed exclusive?)
_DEFAULT_RANGES = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True), "top_k": (0, 1 << 31, False),
                   "repetition_penalty": (0.0, 10.0, True)}


def sampling_defaults(model: str, generation_config: dict) -> SamplingDefaults:
    defaults = SamplingDefaults()
    for name, (low, high, exclusive) in _DEFAULT_RANGES.items():
        value = generation_config.get(name)
        if value is None:
            continue
        number_ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if number_ok and name == "top_k":
            number_ok = float(value).is_integer()
        if not number_ok or not (low < value if exclusive else low <= value) or value > high:
            log.warning("model %s: generation_config.json %s=%r is out of range; using the API default", model,
                        name, value)
            continue
        setattr(defaults, name, int(value) if name == "top_k" else float(value))
    return defaults


class ModelAssetsCache:
    def __init__(self, agents: AgentPool, retry_after_s: float = 1.0,
                 reasoning_parsers: dict[str, str] | None = None,
                 tool_call_parsers: dict[str, str] | None = None) -> None:
        self._agents = agents
        self._reasoning_parsers = reasoning_parsers or {}
        self._tool_call_parsers = tool_call_parsers or {}
        self._retry_after_s = retry_after_s
        self._assets: dict[str, ModelAssets] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def cached(self, model: str) -> ModelAssets | None:
        return self._assets.get(model)

    async def get(self, model: str, snapshot: Snapshot, request_id: str) -> ModelAssets:
        assets = self._assets.get(model)
        if assets is not None:
            return assets
        pending = self._pending.get(model)
        if pending is None:
            pending = self._pending[model] = asyncio.ensure_future(self._fetch(model, snapshot, request_id))
            pending.add_done_callback(lambda _f: self._pending.pop(model, None))
        return await asyncio.shield(pending)

    async def _fetch(self, model: str, snapshot: Snapshot, request_id: str) -> ModelAssets:
        sites = [s for s in snapshot.sites if model in s.models and s.alive and s.grpc_address]
        for site in sites:
            try:
                info = await self._agents.client(site.grpc_address).model_info(model, MODEL_INFO_TIMEOUT_S, request_id)
                assets = await asyncio.to_thread(build_assets, info, self._reasoning_parsers.get(model),
                                                 self._tool_call_parsers.get(model))
            except grpc.aio.AioRpcError as exc:
                log.warning("request %s: GetModelInfo(%s) on site %s failed: %s", request_id, model, site.name,
                            exc.code().name)
                continue
            except (CheckpointError, ValueError) as exc:
                log.error("request %s: site %s sent unusable tokenizer assets for %s: %s", request_id, site.name,
                          model, exc)
                continue
            self._assets[model] = assets
            return assets
        raise no_capacity(f"No site serving `{model}` answered; retry shortly.", self._retry_after_s)


def build_assets(info, reasoning_parser: str | None = None, tool_call_parser: str | None = None) -> ModelAssets:
    config = json.loads(info.tokenizer_config_json) if info.tokenizer_config_json else {}
    generation_config = json.loads(info.generation_config_json) if info.generation_config_json else {}
    tokenizer = ChatTokenizer(info.tokenizer_json, config, info.chat_template or None)
    reasoning, tool_calls = reasoning_format(tokenizer, reasoning_parser), tool_call_format(tokenizer, tool_call_parser)
    if tool_calls is not None and tool_calls.name == "harmony" and not isinstance(reasoning, HarmonyFormat):
        # Harmony calls are messages, which only the harmony reasoning parser reads out of the output.
        raise ValueError(f"the harmony tool-call format needs the harmony reasoning parser, not "
                         f"{reasoning.name if reasoning is not None else 'none'!r}; set both in the router config")
    return ModelAssets(info.model, tokenizer, int(info.context_length), list(info.eos_token_ids),
                       int(info.block_size) or 16, int(info.kv_bytes_per_token), generation_config,
                       sampling_defaults(info.model, generation_config), reasoning, tool_calls,
                       token_bytes_reader(info.model, tokenizer))


def token_bytes_reader(model: str, tokenizer: ChatTokenizer) -> Callable[[int], bytes] | None:
    """Each token's own bytes, which a token holding part of a multi-byte character needs: its text alone is
    U+FFFD, whose bytes would not join with its neighbours' into the answer. The tokenizer is read by the
    library the engine's grammars use (byte-level BPE, SentencePiece byte fallback and the rest alike)."""
    vocab_size = tokenizer.vocab_size
    try:
        byte_tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size)
    except (ValueError, RuntimeError) as exc:
        log.warning("model %s: tokens' bytes cannot be read (%s); logprobs carry the bytes of each token's text",
                    model, exc)
        return None

    def token_bytes(token_id: int) -> bytes:
        if not 0 <= token_id < vocab_size:  # an id past the tokenizer (a padded embedding row) has no text
            return b""
        return byte_tokenizer.decode_bytes([token_id])

    return token_bytes
