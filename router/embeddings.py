"""POST /v1/embeddings: OpenAI's embeddings endpoint, served by the sites' engines.

The body is read and checked here (`parse_embedding_request`); `EmbeddingService.embed` then does what
the completion service does for a prompt, with the completion service's own parts: the model must be
served, the inputs are tokenized (special tokens added, as the model's sentence-transformers pipeline
does) and held to the model's context, the key's rate limit is charged the prompt tokens, and the
placement code ranks the sites (embeddings are prefill-only work: no token generated, no decode site;
the ranked prefill sites, best first, are the failover order). One `Embed` call carries every input to
one site, which batches them, under a deadline that grows with the call's tokens (`embed_timeout_s`);
a site that cannot connect, is full, draining or fails is left for the next, as completions do before
their first token. What the site answers is per input a float32 vector, already cut to `dimensions`
(and re-normalized when the model normalizes its vectors); it goes out as JSON floats or, with
`encoding_format: "base64"`, as the little-endian float32 bytes the OpenAI SDK decodes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from dataclasses import dataclass

import grpc
import numpy as np

from node_agent.proto import agent_pb2
from router.completions import CompletionService, RequestContext, tokenized
from router.errors import ApiError, bad_request, no_capacity, rate_limited
from router.generation import FULL_RETRY_MAX_S, FULL_RETRY_S, RETRYABLE_CODES, FailoverPolicy
from router.model_assets import ModelAssets
from router.placement import PlacementRequest, rank
from router.rate_limit import Refusal
from router.snapshot import Site

log = logging.getLogger(__name__)

EMBEDDINGS_PATH = "/v1/embeddings"
MAX_INPUTS = 2048          # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = ("float", "base64")
MAX_DIMENSIONS = 2**32 - 1  # the Embed call's uint32 field; sites refuse anything past their model's hidden size
# A site's measured prefill rate is an average over its recent batches; a call that runs beside other work
# goes slower, so an Embed call is allowed this many times the time its tokens take at that rate.
EMBED_RATE_SLACK = 2.0
FIELDS = ("model", "input", "encoding_format", "dimensions", "user")


@dataclass(slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]   # each a text, or token ids
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_embedding_request(body: dict) -> EmbeddingRequest:
    """The body as an EmbeddingRequest, or a 400 whose `param` names the field to change."""
    unknown = next((key for key in body if key not in FIELDS), None)
    if unknown is not None:
        raise bad_request(f"`{unknown}` is not a parameter of the embeddings endpoint (it takes "
                          f"{', '.join(FIELDS)}).", unknown, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required: the id of the model to embed with (a string).", "model")
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise bad_request(f"`encoding_format` must be \"float\" or \"base64\", got {encoding!r}.", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise bad_request(f"`dimensions` must be an integer >= 1, got {dimensions!r}.", "dimensions")
    if dimensions is not None and dimensions > MAX_DIMENSIONS:
        raise bad_request(f"`dimensions` is {dimensions}, more values than any model's embedding has; send at most "
                          f"the model's embedding size, or leave it out for the whole vector.", "dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("`user` must be a string.", "user")
    return EmbeddingRequest(model, _inputs(body.get("input")), encoding, dimensions, user)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inputs(value) -> list[str | list[int]]:
    """`input` in OpenAI's four shapes: a string, strings, token ids, or lists of token ids."""
    shape = ("`input` must be a string, an array of strings, an array of token ids or an array of arrays of "
             "token ids")
    if isinstance(value, str):
        value = [value]
    elif value is None:
        raise bad_request(f"`input` is required; {shape[8:]}.", "input")
    elif not isinstance(value, list):
        raise bad_request(f"{shape}.", "input")
    if not value:
        raise bad_request("`input` is empty; send at least one input.", "input")
    if len(value) > MAX_INPUTS:
        raise bad_request(f"`input` has {len(value)} items; at most {MAX_INPUTS} per request.", "input")
    if all(_is_int(item) for item in value):
        _check_ids(value, "input")
        return [value]
    inputs = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"`{param}` is an empty string; every input needs some text.", param)
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            if not item:
                raise bad_request(f"`{param}` is an empty array of token ids; every input needs a token.", param)
            _check_ids(item, param)
        else:
            raise bad_request(f"{shape}; `{param}` is {type(item).__name__}.", param)
        if inputs and type(item) is not type(inputs[0]):
            raise bad_request(f"{shape}, not a mix of strings and token ids; `{param}` differs from `input[0]`.",
                              param)
        inputs.append(item)
    return inputs


def _check_ids(ids: list[int], param: str) -> None:
    bad = next((t for t in ids if t < 0 or t >= 2**32), None)
    if bad is not None:
        raise bad_request(f"`{param}` holds token id {bad}, which is no token id.", param)


class EmbeddingService:
    """Embeddings with the completion service's snapshot, assets, agents, health, limits and metrics."""

    def __init__(self, service: CompletionService) -> None:
        self.service = service

    async def embed(self, request: EmbeddingRequest, ctx: RequestContext) -> tuple[dict, dict[str, str]]:
        """The response body and its headers; an ApiError for what fails cleanly."""
        service = self.service
        snapshot = service.feed.current()
        service._check_served(request.model, snapshot, ctx.api_key.allowed_regions)
        assets = await service.assets.get(request.model, snapshot, ctx.request_id)
        inputs = [await self._tokenize(item, assets, self._param(request, i)) for i, item in enumerate(request.inputs)]
        num_tokens = sum(len(ids) for ids in inputs)
        key = ctx.api_key
        charge = await service.fleet.admit(key.id, key.requests_per_minute, key.tokens_per_minute, num_tokens)
        if isinstance(charge, Refusal) and charge.never:
            raise bad_request(f"The input is {num_tokens} tokens, over this API key's limit of {key.tokens_per_minute} "
                              f"tokens per minute, so it can never be admitted. Send fewer or shorter inputs.",
                              "input", "rate_limit_too_small")
        if isinstance(charge, Refusal):
            service.metrics.rate_limited.labels(charge.limit).inc()
            raise rate_limited(f"Rate limit on {charge.limit} per minute reached for this API key; retry after "
                               f"the Retry-After delay.", charge.retry_after_s)
        try:
            site, answer = await self._call(request, ctx, snapshot, assets, inputs)
        except BaseException:
            if charge is not None:
                service.fleet.limiter.give_back(charge, charge.tokens)
            raise
        num_cached = sum(e.num_cached_tokens for e in answer.embeddings)
        service.metrics.prompt_tokens.labels(request.model).inc(num_tokens)
        service.metrics.cached_tokens.labels(request.model).inc(num_cached)
        if isinstance(key.id, int):
            service.fleet.meter.record(key.id, request.model, num_tokens, num_cached, 0)
        body = {"object": "list", "data": [_datum(i, e.data, request.encoding_format)
                                           for i, e in enumerate(answer.embeddings)],
                "model": request.model, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
        headers = {"x-request-id": ctx.request_id, "x-edgefire-trace-id": ctx.trace_id,
                   "x-edgefire-prefill-site": site}
        return body, headers

    @staticmethod
    def _param(request: EmbeddingRequest, index: int) -> str:
        return f"input[{index}]" if len(request.inputs) > 1 else "input"

    async def _tokenize(self, item: str | list[int], assets: ModelAssets, param: str) -> list[int]:
        tokenizer = assets.tokenizer
        if isinstance(item, list):
            if max(item) >= tokenizer.vocab_size:
                raise bad_request(f"`{param}` holds token ids beyond the vocabulary ({tokenizer.vocab_size}).", param)
            ids = item
        else:
            ids = await tokenized(len(item), tokenizer.encode, item)
        context = assets.context_length or self.service.limits.max_prompt_tokens
        if len(ids) > context:   # OpenAI's code, which clients catch to shorten their input
            raise bad_request(f"`{param}` is {len(ids)} tokens; this model embeds at most {context}. Shorten it.",
                              param, "context_length_exceeded")
        if not ids:
            raise bad_request(f"`{param}` has no tokens once tokenized; send some text.", param)
        return ids

    async def _call(self, request: EmbeddingRequest, ctx: RequestContext, snapshot, assets: ModelAssets,
                    inputs: list[list[int]]) -> tuple[str, agent_pb2.EmbedResponse]:
        """One site's answer: the ranked prefill sites in order, each tried once, up to max_attempts failures
        (a full or draining site's refusal costs no attempt). When only full sites are left, the request
        waits for room and places itself again, backing off as completions do, for up to max_full_wait_s
        (never past the first-token timeout)."""
        service = self.service
        # A site takes the call when its free KV holds the longest input (the inputs then queue in its engine and
        # run as blocks free up: node_agent.core.accept_embedding), so sites are placed by that input, not by the
        # inputs' sum, which a call larger than every site's free KV would exceed on all of them. The ledger
        # charges the site every input's tokens: its queue holds them all.
        placement = PlacementRequest(
            model=request.model, prompt_ids=max(inputs, key=len), max_tokens=0, prefill_only=True,
            client_lat=ctx.location.lat, client_lon=ctx.location.lon,
            client_site=service.limits.router_site if ctx.location.source == "router" else None,
            allowed_regions=ctx.api_key.allowed_regions, session_key=ctx.session_key,
            kv_bytes_per_token=assets.kv_bytes_per_token)
        embed = agent_pb2.EmbedRequest(request_id=ctx.request_id, model=request.model,
                                       inputs=[agent_pb2.EmbedInput(token_ids=ids) for ids in inputs],
                                       dimensions=request.dimensions or 0)
        policy, failures, reasons, failed = service.policy, 0, [], set()
        num_tokens = sum(len(ids) for ids in inputs)
        loop = asyncio.get_running_loop()
        waiting_since, num_waits, tried = loop.time(), 0, False
        while True:
            candidates = rank(snapshot, placement, service.cost, service.health.cooling(),
                              service.ledger.pending(snapshot))
            seen: set[str] = set(failed)
            sites = [c for c in candidates if not (c.prefill_site.name in seen or seen.add(c.prefill_site.name))]
            if not sites and not tried:
                raise no_capacity(f"No site with free capacity serves `{request.model}` in the regions this key "
                                  f"may use; retry shortly.", service.limits.retry_after_s)
            full = False
            for candidate in sites:
                if failures >= policy.max_attempts:
                    break
                site = candidate.prefill_site
                if tried:
                    service.metrics.moved_on(reasons[-1], False)
                tried = True
                attempt = service.ledger.record(candidate, num_tokens, 0)
                try:
                    answer = await service.agents.client(site.grpc_address).embed(
                        embed, embed_timeout_s(site, num_tokens, policy))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE_CODES:
                        raise _site_refusal(exc) from exc
                    reason = "full" if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else exc.code().name.lower()
                    reasons.append(reason)
                    full = full or reason == "full"
                    if reason != "full":
                        failed.add(site.name)
                        # a draining site, or an agent older than the Embed call, is no broken site
                        if not _draining(exc) and exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                            failures += 1
                            service.health.record_failure(site.name)
                            service.metrics.site_failed(site.name, reason)
                    log.warning("request %s: embeddings on site %s failed (%s: %s); next site", ctx.request_id,
                                site.name, exc.code().name, exc.details())
                    continue
                finally:
                    service.ledger.finished(attempt)
                service.health.record_success(site.name)
                service.metrics.placed(site.name, site.name, site.region)
                return site.name, answer
            remaining_s = min(policy.max_full_wait_s, policy.first_token_timeout_s) - (loop.time() - waiting_since)
            if not full or failures >= policy.max_attempts or remaining_s <= 0.001:
                break
            delay_s = min(FULL_RETRY_S * 2 ** num_waits, FULL_RETRY_MAX_S, remaining_s)
            num_waits += 1
            log.info("request %s: every site left for its embeddings is full; trying again in %.2f s",
                     ctx.request_id, delay_s)
            await asyncio.sleep(delay_s)
            snapshot = service.feed.current()
        if reasons and set(reasons) == {"unimplemented"}:
            raise no_capacity(f"No site serving `{request.model}` can embed yet: their agents predate embeddings "
                              f"(the Embed call); upgrade them.", service.limits.retry_after_s)
        raise no_capacity(f"Every site tried failed ({', '.join(reasons)}); retry shortly.",
                          service.limits.retry_after_s)


def embed_timeout_s(site: Site, num_tokens: int, policy: FailoverPolicy) -> float:
    """The deadline of one Embed call of num_tokens on a site: the first-token timeout (the queue, the first
    batch) plus EMBED_RATE_SLACK times those tokens at the prefill rate the site measured, never past the
    request timeout; the request timeout itself where the site has measured no rate yet."""
    rate = site.capacity.prefill_tokens_per_s if site.capacity is not None else 0.0
    if rate <= 0:
        return policy.request_timeout_s
    return min(policy.request_timeout_s, policy.first_token_timeout_s + EMBED_RATE_SLACK * num_tokens / rate)


def _draining(exc: grpc.aio.AioRpcError) -> bool:
    """UNAVAILABLE from the agent itself (draining): the site is fine, it takes no new work. A connection
    that fails answers UNAVAILABLE too, without the agent's words."""
    return "draining" in (exc.details() or "")


# An agent's INVALID_ARGUMENT starts with the Embed field it names (node_agent.core.check_embed_request)
_AGENT_FIELD = re.compile(r"^(inputs(?:\[(\d+)\])?|dimensions|model): ")


def _site_refusal(exc: grpc.aio.AioRpcError) -> ApiError:
    """A site refused the request itself (another would too): a 400 naming the field where the agent says."""
    details = exc.details() or exc.code().name
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(502, f"The serving site failed this request: {details}", "server_error", None,
                        "upstream_error")
    match = _AGENT_FIELD.match(details)
    param = None
    if match is not None:
        field = match.group(1)
        param = "dimensions" if field == "dimensions" else "model" if field == "model" else (
            f"input[{match.group(2)}]" if match.group(2) is not None else "input")
        details = details[match.end():]
    return bad_request(f"The request was rejected by the serving site: {details}", param)


def _datum(index: int, data: bytes, encoding: str) -> dict:
    embedding = (base64.b64encode(data).decode("ascii") if encoding == "base64"
                 else np.frombuffer(data, dtype="<f4").tolist())
    return {"object": "embedding", "index": index, "embedding": embedding}
