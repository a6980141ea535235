"""A completion from request to response, knowing nothing of HTTP.

`CompletionService.start` authenticates nothing (the caller passed an ApiKey) but does everything
else that can still fail with a clean 4xx/5xx: tokenization, limits, rate limits, placement and
the first token. The returned `CompletionRun` then yields stream chunks or one response body.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from engine.grammar import GrammarSpec
from engine.tokenizer import TemplateError
from node_agent.proto import agent_pb2
from router import responses
from router.api_keys import ApiKey
from router.errors import ApiError, bad_request, no_capacity, not_in_regions, rate_limited, unknown_model
from router.generation import AgentRejected, FailoverPolicy, Generation, GenerationFailed, TokenStep
from router.geo import Location
from router.health import PassiveHealth
from router.ledger import InflightLedger
from router.metrics import RouterMetrics, elapsed_s
from router.model_assets import ModelAssets, ModelAssetsCache
from router.openai_request import MAX_PREDICTION_TOKENS, MAX_SEED, CompletionRequest
from router.placement import CostModel, PlacementRequest, model_availability, rank
from router.fleet_reporter import FleetReporter
from router.rate_limit import Charge, Refusal
from router.reasoning import ReasoningStream, template_effort, with_reasoning
from router.sessions import SessionTable
from router.snapshot_feed import SnapshotFeed
from router.text_stream import TextStream
from router.tool_calls import ToolCall, ToolCallStream, has_strict_tool

log = logging.getLogger(__name__)

PROMPT_TOKENIZE_OFF_LOOP_CHARS = 16_384  # longer prompts are tokenized in a thread


async def tokenized(size: int, encode: Callable[..., list[int]], *args) -> list[int]:
    """encode(*args) for a text of `size` characters: in a thread when it is long, so that a long prompt
    never holds the event loop (every other request's stream) while it is tokenized."""
    if size > PROMPT_TOKENIZE_OFF_LOOP_CHARS:
        return await asyncio.to_thread(encode, *args)
    return encode(*args)


@dataclass(slots=True)
class RequestContext:
    request_id: str
    api_key: ApiKey
    location: Location
    session_key: str | None = None   # router.sessions.session_key: header or `user`, within the API key
    started_at: float = field(default_factory=time.perf_counter)  # the request's arrival (latency metrics)
    trace_id: str = ""               # the W3C trace the request belongs to (node_agent.trace)


@dataclass(slots=True)
class Limits:
    max_prompt_tokens: int = 32768
    default_max_tokens: int = 0  # for requests without max_tokens; 0: up to the model's context
    retry_after_s: float = 1.0
    router_site: str | None = None
    max_choices: int = 128  # a request's prompts times its n


class CompletionService:
    def __init__(self, feed: SnapshotFeed, assets: ModelAssetsCache, agents, health: PassiveHealth,
                 fleet: FleetReporter, cost: CostModel, policy: FailoverPolicy, limits: Limits,
                 sessions: SessionTable | None = None, metrics: RouterMetrics | None = None) -> None:
        self.feed, self.assets, self.agents, self.health = feed, assets, agents, health
        self.fleet, self.cost, self.policy, self.limits = fleet, cost, policy, limits
        self.metrics = metrics or RouterMetrics()
        self.ledger = InflightLedger()
        self.sessions = sessions or SessionTable()

    async def start(self, request: CompletionRequest, ctx: RequestContext) -> CompletionRun | Choices:
        snapshot = self.feed.current()
        self._check_served(request.model, snapshot, ctx.api_key.allowed_regions)
        if request.num_choices > self.limits.max_choices:
            raise bad_request(f"The request asks for {request.num_choices} choices ({request.num_prompts} prompts "
                              f"times n={request.n}); this endpoint answers at most {self.limits.max_choices} per "
                              f"request. Send fewer prompts or a smaller n.", "prompt" if request.n == 1 else "n")
        assets = await self.assets.get(request.model, snapshot, ctx.request_id)
        if request.chat:
            request.template_kwargs = template_effort(request.template_kwargs, assets.reasoning,
                                                      assets.tokenizer.template, request.model)
        prompts = [await self._tokenize(request, assets, i) for i in range(request.num_prompts)]
        max_tokens = [self._check_lengths(request, ids, assets, self._prompt_param(request, i))
                      for i, ids in enumerate(prompts)]
        if request.prediction:
            request.prediction_ids = await self._tokenize_prediction(request, assets)
        # A tool-call grammar is built off the event loop: the first one of a model reads its vocabulary as
        # the grammar library does (about a second for 128k tokens, then cached).
        grammar = (await asyncio.to_thread(request_grammar, request, assets) if _tool_grammar(request)
                   else request_grammar(request, assets))
        key = ctx.api_key
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        if request.max_tokens is None and key.tokens_per_minute:
            # Up to the context, but never more than a minute's allowance: the charge must fit the bucket.
            share = (key.tokens_per_minute - num_prompt_tokens) // request.num_choices
            max_tokens = [max(1, min(m, share)) for m in max_tokens]
        charge = await self.fleet.admit(key.id, key.requests_per_minute, key.tokens_per_minute,
                                        num_prompt_tokens + request.n * sum(max_tokens))
        if isinstance(charge, Refusal) and charge.never:
            raise _over_token_limit(request, num_prompt_tokens, max_tokens, key.tokens_per_minute)
        if isinstance(charge, Refusal):
            self.metrics.rate_limited.labels(charge.limit).inc()
            raise rate_limited(f"Rate limit on {charge.limit} per minute reached for this API key; retry after "
                               f"the Retry-After delay.", charge.retry_after_s)
        served = Served(self.fleet, charge, key.id, request.model, request.stream, request.num_choices)
        runs: list[CompletionRun] = []
        try:
            for i, ids in enumerate(prompts):
                runs.append(self._new_run(request, ctx, snapshot, assets, ids, max_tokens[i], grammar, served,
                                          i * request.n, self._echo(request, assets, i)))
            await _begin(runs)
            self.sessions.remember(ctx.session_key, runs[0].generation.prefill_site, runs[0].generation.decode_site)
            for run in runs:
                placed = run.generation.placed
                self.metrics.placed(placed.prefill_site.name, placed.decode_site.name, placed.decode_site.region)
            if request.num_choices == 1:
                return runs[0]
            # The other choices of each prompt start once its first has its first token: the prompt is in
            # the prefix cache then, so theirs is read from it rather than computed again.
            more = [self._new_run(request, ctx, snapshot, assets, ids, max_tokens[i], grammar, served,
                                  i * request.n + j, self._echo(request, assets, i))
                    for i, ids in enumerate(prompts) for j in range(1, request.n)]
            runs.extend(more)
            await _begin(more)
        except BaseException:
            served.failed_to_start()
            for run in runs:
                await run.close()
            raise
        runs.sort(key=lambda run: run.index)
        for run in runs[1:]:
            run.id, run.created = runs[0].id, runs[0].created  # one response, one id
        return Choices(runs)

    @staticmethod
    def _prompt_param(request: CompletionRequest, index: int) -> str:
        """The parameter an error about prompt `index` names: `prompt[i]` when the request sent several."""
        if request.chat:
            return "messages"
        return f"prompt[{index}]" if len(request.prompts) > 1 else "prompt"

    @staticmethod
    def _echo(request: CompletionRequest, assets: ModelAssets, index: int) -> str:
        """What the choices of prompt `index` start with under `echo`: the string as sent, or the ids decoded."""
        if not request.echo:
            return ""
        prompt = request.prompts[index]
        return prompt if isinstance(prompt, str) else assets.tokenizer.decode(prompt, skip_special_tokens=False)

    def _new_run(self, request, ctx, snapshot, assets, prompt_ids, max_tokens, grammar, served: Served,
                 index: int = 0, echo: str = "") -> CompletionRun:
        placement = PlacementRequest(
            model=request.model, prompt_ids=prompt_ids, max_tokens=max_tokens, client_lat=ctx.location.lat,
            client_lon=ctx.location.lon,
            client_site=self.limits.router_site if ctx.location.source == "router" else None,
            allowed_regions=ctx.api_key.allowed_regions, session_key=ctx.session_key,
            session_pair=self.sessions.pair(ctx.session_key), kv_bytes_per_token=assets.kv_bytes_per_token)
        candidates = rank(snapshot, placement, self.cost, self.health.cooling(), self.ledger.pending(snapshot))
        if not candidates:
            raise no_capacity(f"No site with free capacity serves `{request.model}` in the regions this key may "
                              f"use; retry shortly.", self.limits.retry_after_s)
        if grammar is not None and request.chat and assets.reasoning is not None:
            grammar = with_reasoning(grammar, assets.reasoning, prompt_ids, assets.tokenizer, request.template_kwargs)
        sampling = sampling_params(request, assets, max_tokens, grammar, index)
        request_id = ctx.request_id if not index else f"{ctx.request_id}.{index}"

        def replan() -> list:
            """The pairs the current snapshot offers now (the placement's own may all have failed)."""
            try:
                current = self.feed.current()
            except ApiError:
                return []
            return rank(current, placement, self.cost, self.health.cooling(), self.ledger.pending(current))

        generation = Generation(request_id, request.model, prompt_ids, sampling, candidates, self.agents,
                                self.health, self.policy, self.ledger, metrics=self.metrics, replan=replan,
                                site_alive=self._site_alive)
        return CompletionRun(request, ctx, assets, generation, served, max_tokens, self.limits.retry_after_s,
                             self.metrics, index, echo)

    def _site_alive(self, name: str) -> bool:
        """Whether the router's current view counts the site alive (with no view, nothing says it is not)."""
        try:
            view = self.feed.current()
        except ApiError:
            return True
        return any(site.name == name and site.alive for site in view.sites)

    def _check_served(self, model: str, snapshot, allowed_regions: frozenset[str]) -> None:
        """404 for a model no site offers; 403 for one served only outside the key's regions (retrying
        cannot help); 503 + Retry-After for one whose sites in them served it lately but none is live
        now (stale heartbeats, restarts): that is a wait, not an unknown model."""
        available = model_availability(snapshot, self.cost, model, allowed_regions)
        if available.live:
            return
        if available.resting:
            raise no_capacity(f"No site serving `{model}` is live right now; retry after the Retry-After delay.",
                              self.limits.retry_after_s)
        if available.outside_regions:
            raise not_in_regions(model, allowed_regions, available.outside_regions)
        raise unknown_model(model)

    async def _tokenize(self, request: CompletionRequest, assets: ModelAssets, index: int = 0) -> list[int]:
        """The token ids of the chat's messages, or of the completion's prompt `index`."""
        tokenizer = assets.tokenizer
        try:
            if request.chat:
                size = sum(len(m["content"]) for m in request.messages)
                # tool_choice "none": the model is not told of the tools, so it answers in words
                tools = request.tools if request.tool_choice != "none" else None
                encode = functools.partial(tokenizer.encode_chat, tools=tools, documents=request.documents,
                                           **request.template_kwargs)
                args = (assets.template_messages(request.messages),)
            elif isinstance(prompt := request.prompts[index], list):
                if max(prompt) >= tokenizer.vocab_size:
                    param = self._prompt_param(request, index)
                    raise bad_request(f"`{param}` holds token ids beyond the vocabulary ({tokenizer.vocab_size}).",
                                      param)
                return prompt
            else:
                size, encode, args = len(prompt), tokenizer.encode, (prompt,)
            return await tokenized(size, encode, *args)
        except TemplateError as exc:
            raise bad_request(f"The model's chat template rejected these messages: {exc}", "messages") from exc

    async def _tokenize_prediction(self, request: CompletionRequest, assets: ModelAssets) -> list[int]:
        """The predicted output's token ids, as the model would write them (no special tokens added)."""
        text = request.prediction
        ids = await tokenized(len(text), assets.tokenizer.encode, text, False)
        context = assets.context_length or (self.limits.max_prompt_tokens + self.limits.default_max_tokens)
        if len(ids) > context:
            raise bad_request(f"`prediction.content` is {len(ids)} tokens, more than the model's whole context "
                              f"({context}); predict the answer only.", "prediction.content")
        if len(ids) > MAX_PREDICTION_TOKENS:
            raise bad_request(f"`prediction.content` is {len(ids)} tokens; a prediction may have at most "
                              f"{MAX_PREDICTION_TOKENS}. Predict the part of the answer you expect to change least, "
                              f"or send the request without `prediction`.", "prediction.content")
        return ids

    def _check_lengths(self, request: CompletionRequest, prompt_ids: list[int], assets: ModelAssets,
                       param: str) -> int:
        """The max_tokens of one prompt (`param` names it), or a 4xx when the prompt does not fit."""
        num_prompt = len(prompt_ids)
        context = assets.context_length or (self.limits.max_prompt_tokens + self.limits.default_max_tokens)
        limit = min(self.limits.max_prompt_tokens, context - 1)
        named = param.endswith("]")  # one of several prompts: the messages say which
        prompt, shorten = (f"The prompt `{param}`", f"`{param}`") if named else ("The prompt", f"the {param}")
        if num_prompt > limit:  # a 400 with OpenAI's code, which clients catch to shorten a conversation
            raise bad_request(f"{prompt} is {num_prompt} tokens; this endpoint accepts at most {limit}. "
                              f"Shorten {shorten}.", param, "context_length_exceeded")
        if request.max_tokens is None:  # up to the context, unless the operator set a default
            room = context - num_prompt
            return min(self.limits.default_max_tokens, room) if self.limits.default_max_tokens else room
        if num_prompt + request.max_tokens > context:
            name = request.max_tokens_param
            raise bad_request(f"{prompt} ({num_prompt} tokens) plus {name} ({request.max_tokens}) exceeds the "
                              f"model's context length ({context}); lower {name}.", name, "context_length_exceeded")
        return request.max_tokens


async def _begin(runs: list[CompletionRun]) -> None:
    """Every run's first token; when one fails, the others' waits are cancelled before the error is raised."""
    tasks = [asyncio.ensure_future(run.begin()) for run in runs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def request_grammar(request: CompletionRequest, assets: ModelAssets) -> GrammarSpec | None:
    """What the answer must follow (a reasoning model's block comes in front in `_new_run`): the response
    format, the model's tool-call format wrapping the required function(s), under auto with a response
    format the JSON answer or calls of the tools, or (auto, with `strict` functions) free text or calls whose
    arguments follow the strict functions' schemas; a 400 when a required call's format is not known or a
    token id is not the model's."""
    vocab = assets.tokenizer.vocab_size
    bad = next((t for t in request.logit_bias if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"`logit_bias` names token id {bad}, beyond this model's vocabulary ({vocab}).",
                          "logit_bias")
    if request.tool_choice == "auto" and _tool_grammar(request) and assets.tool_calls is not None:
        if request.grammar is not None:  # an agent with an output type: its final answer, or calls on the way
            return assets.tool_calls.answer_or_calls_grammar(request.grammar, request.tools,
                                                             request.parallel_tool_calls, assets.tokenizer)
        # Strict tools keep their guarantee where the model may also answer in words: free text, or calls
        # that follow the schemas. Without a strict tool the answer runs free, with no grammar to pay for.
        return assets.tool_calls.auto_grammar(request.tools, request.parallel_tool_calls, assets.tokenizer)
    if request.tool_choice != "required" and request.named_tool is None:
        return request.grammar
    if assets.tool_calls is None:
        raise bad_request(f"The model `{request.model}` has no tool-call format this router recognises in its chat "
                          f"template, so a call cannot be required; use tool_choice \"auto\" or \"none\" (an operator "
                          f"can name the format in the router's `tool_call_parsers`).", "tool_choice")
    tools = [t for t in request.tools if request.named_tool in (None, t["function"]["name"])]
    return assets.tool_calls.grammar(tools, request.parallel_tool_calls and request.named_tool is None,
                                     assets.tokenizer)


def _tool_grammar(request: CompletionRequest) -> bool:
    """The output follows a grammar of tool calls: a required or named call, or `auto` with a response format
    (the answer or calls) or with strict tools."""
    if request.tool_choice == "required" or request.named_tool is not None:
        return True
    return request.tool_choice == "auto" and (request.grammar is not None or has_strict_tool(request.tools))


# The smallest normal float32: the agent API carries the penalty as a float32, in which a smaller one
# (1e-46) becomes 0, which agents read as "unset" and run without a penalty. Every penalty below this
# one gives the same distribution (engine.sampling: the seen token with the largest logit takes it all).
MIN_WIRE_REPETITION_PENALTY = 1.1754943508222875e-38


def _wire_penalty(penalty: float) -> float:
    return max(penalty, MIN_WIRE_REPETITION_PENALTY)


def sampling_params(request: CompletionRequest, assets: ModelAssets, max_tokens: int,
                    grammar: GrammarSpec | None = None, index: int = 0) -> agent_pb2.SamplingParams:
    """The request's sampling; what it leaves unset comes from the checkpoint's generation config, then
    from the OpenAI defaults (temperature 1, top_p 1, no top_k, no repetition penalty). Choice `index`
    (prompt-major: prompt i's choice j is i * n + j) of a seeded request draws with seed + j, so a prompt's
    n choices differ and each is reproducible, and a prompt gets the same text alone or among others."""
    defaults = assets.sampling_defaults
    sampling = agent_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=_first(request.temperature, defaults.temperature, 1.0),
        top_p=_first(request.top_p, defaults.top_p, 1.0), top_k=_first(request.top_k, defaults.top_k, 0),
        repetition_penalty=_wire_penalty(_first(request.repetition_penalty, defaults.repetition_penalty, 1.0)),
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias, min_p=request.min_p or 0.0,
        stop_token_ids=assets.eos_token_ids, logprobs=request.logprobs, no_speculation=request.no_speculation,
        prediction_ids=request.prediction_ids)
    if grammar is not None:
        setattr(sampling.grammar, grammar.kind, grammar.source)  # Grammar's oneof is named by the kinds
    if request.seed is not None:
        sampling.seed = (request.seed + index % request.n) % (MAX_SEED + 1)
    return sampling


def _first(*values):
    return next(v for v in values if v is not None)


class CompletionRun:
    """One choice of a completion: its generation across sites, its text, reasoning and tool calls."""

    def __init__(self, request: CompletionRequest, ctx: RequestContext, assets: ModelAssets, generation: Generation,
                 served: Served, max_tokens: int, retry_after_s: float,
                 metrics: RouterMetrics | None = None, index: int = 0, echo: str = "") -> None:
        self.request, self.ctx, self.assets, self.generation = request, ctx, assets, generation
        self.served, self.max_tokens, self.retry_after_s = served, max_tokens, retry_after_s
        self.metrics = (metrics or RouterMetrics()).for_model(request.model)
        self.index = index  # prompt-major: prompt i's choice j is i * n + j
        self.echo = echo    # the prompt text the choice's text begins with (`echo: true`)
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + os.urandom(16).hex()
        self.created = int(time.time())
        parse_tools = (request.chat and request.tool_choice not in (None, "none") and assets.tool_calls is not None)
        forced = request.tool_choice == "required" or request.named_tool is not None
        names = frozenset(t["function"]["name"] for t in request.tools or ())
        # Under auto with a response format the answer is JSON unless it opens with calls (answer_or_calls_grammar).
        answer_or_calls = request.tool_choice == "auto" and request.grammar is not None
        self.tool_calls = (ToolCallStream(assets.tool_calls.with_tools(request.tools or []), forced,
                                          request.parallel_tool_calls, names,
                                          deltas=request.stream, answer_or_calls=answer_or_calls)
                           if parse_tools else None)
        # A required call's answer is the calls alone, which a stop string could only break (arguments cut into
        # JSON that does not parse): stop strings apply to words, and such an answer has none.
        stop = [] if forced and self.tool_calls is not None else request.stop
        # Tool-call markers may be special tokens, which plain detokenization drops; the end-of-sequence
        # tokens are then left out by id instead.
        self.text = TextStream(assets.tokenizer, stop, skip_special_tokens=self.tool_calls is None,
                               calls=assets.tool_calls if self.tool_calls is not None else None, names=names)
        self._hidden_ids = frozenset(assets.eos_token_ids) if self.tool_calls is not None else frozenset()
        self.reasoning = (ReasoningStream(assets.reasoning, assets.reasoning.starts_open(generation.prompt_ids,
                                                                                       assets.tokenizer),
                                          assets.tokenizer, frozenset(assets.eos_token_ids),
                                          assets.reasoning.starts_closed(generation.prompt_ids, assets.tokenizer))
                          if request.chat and assets.reasoning is not None else None)
        self.first_step: TokenStep | None = None
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.calls: list[ToolCall] = []
        self.emit_usage = request.include_usage and request.num_choices == 1  # Choices sends one usage for all
        self._steps = generation.steps()
        self._settled = False
        self._last_step_at = 0.0
        self._text_offset = 0  # the legacy logprobs' text_offset of the next token
        # Tool calls parsed: answer tokens whose text is held back, and those read as calls' markup (_content_tokens)
        self._held_tokens: list = []
        self._markup_tokens: list = []

    async def begin(self) -> None:
        """Waits for the first token, so placement failures are still plain HTTP errors."""
        try:
            self.first_step = await anext(self._steps)
            self._last_step_at = time.perf_counter()
            self.metrics.ttft.observe(self._last_step_at - self.ctx.started_at)
        except StopAsyncIteration:
            raise no_capacity("The site ended the stream before any token; retry.", self.retry_after_s) from None
        except GenerationFailed as exc:
            raise no_capacity(f"Every site tried failed ({exc}); retry shortly.", self.retry_after_s) from exc
        except AgentRejected as exc:
            raise bad_request(f"The request was rejected by the serving site: {exc}") from exc

    async def close(self) -> None:
        """Ends the generation early (the agent call is cancelled) and gives back what it did not use."""
        await self._steps.aclose()
        self._settle()

    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.ctx.request_id, "x-edgefire-trace-id": self.ctx.trace_id,
                "x-edgefire-prefill-site": self.generation.prefill_site or "",
                "x-edgefire-decode-site": self.generation.decode_site or "",
                "x-edgefire-attempts": str(self.generation.num_attempts)}

    @property
    def num_prompt_tokens(self) -> int:
        return self.generation.num_prompt_tokens or len(self.generation.prompt_ids)

    @property
    def counts_prompt(self) -> bool:
        """Whether this is its prompt's first choice, the one whose prompt (and cached) tokens are counted."""
        return self.index % self.request.n == 0

    def usage(self) -> dict:
        num_reasoning = self.reasoning.num_reasoning_tokens if self.reasoning is not None else None
        g = self.generation
        prediction = g.prediction_counts(self.num_completion_tokens) if self.request.prediction is not None else None
        return responses.usage(self.num_prompt_tokens, self.num_completion_tokens, g.num_cached_tokens,
                               num_reasoning, prediction)

    async def _deltas(self) -> AsyncIterator[tuple[str, str, list, str | None]]:
        """(answer text, reasoning text, tokens, finish_reason) per step; stops the generation at a stop
        string (stop strings apply to the answer, not to the reasoning). Tool calls found in the answer are
        in `self.calls` when the finish reason comes (it is then "tool_calls", or "length" when they were cut)."""
        step = self.first_step
        try:
            while True:
                delta, reasoning, tokens, finish = self._step_delta(step)
                yield delta, reasoning, tokens, finish
                if finish is not None:
                    return
                try:
                    step = await anext(self._steps)
                except StopAsyncIteration:
                    raise GenerationFailed("the stream ended without a finish reason", True) from None
                now = time.perf_counter()
                self.metrics.inter_token.observe(now - self._last_step_at)
                self._last_step_at = now
        finally:
            await self._steps.aclose()  # cancels the agent call when we stop early
            self._settle()
            self._observe_end()

    def _step_delta(self, step: TokenStep) -> tuple[str, str, list, str | None]:
        """One step's answer text, reasoning text, tokens and finish reason. A step of several tokens (a
        speculative step's) is read token by token, so an answer that ends inside it (a stop string, the
        end of a tool call) ends at that token: the ones after it are neither counted nor given logprobs."""
        deltas, reasonings, logprob_tokens = [], [], []
        for i, token in enumerate(step.tokens):
            last = i == len(step.tokens) - 1
            delta, reasoning, answered, finish = self._token_delta(token, step.finish_reason if last else None)
            deltas.append(delta)
            reasonings.append(reasoning)
            logprob_tokens += self._content_tokens(token, delta, answered, finish)
            if finish is not None:
                return "".join(deltas), "".join(reasonings), logprob_tokens, finish
        return "".join(deltas), "".join(reasonings), logprob_tokens, None

    def _content_tokens(self, token, delta: str, answered: bool, finish: str | None) -> list:
        """The tokens whose logprobs go out with this token's text. Where tool calls are parsed, the tokens of
        their markup carry none (OpenAI's `logprobs.content` covers content tokens only), and a token whose text
        is held back (what may still open a call) waits for the content it turns out to be: logprobs come with
        content alone, never in a chunk of their own or beside a call's arguments, so the stream's and the whole
        answer's are the same. Reasoning tokens' go out as they come, as every reasoning model's do."""
        if self.tool_calls is None or not answered:
            return [token]
        in_calls = self.tool_calls.in_calls
        if finish is not None:
            # Calls that are no calls come back whole as content, their tokens' logprobs with them; tokens whose
            # text never reaches the answer (the end of sequence, a stop string, markup it ends in) carry none.
            out = ([*self._markup_tokens] if not self.calls else []) + [*self._held_tokens, token] if delta else []
            self._markup_tokens, self._held_tokens = [], []
            return out
        if delta:
            out, self._held_tokens = [*self._held_tokens, token], []
            if not in_calls:  # words after calls: the calls' markup is final
                self._markup_tokens = []
            return out
        if in_calls:
            self._markup_tokens += [*self._held_tokens, token]
            self._held_tokens = []
        else:
            self._held_tokens.append(token)
        return []

    def _token_delta(self, token, finish_reason: str | None) -> tuple[str, str, bool, str | None]:
        """The answer text and reasoning text one token adds, whether the token is the answer's (not the
        reasoning's), and the finish reason it reaches (None while the answer goes on)."""
        self.num_completion_tokens += 1
        token_ids = [token.token_id]
        reasoning = ""
        if self.reasoning is not None:
            reasoning, token_ids = self.reasoning.add(token_ids, last=bool(finish_reason))
        answered = bool(token_ids)
        if self._hidden_ids:
            token_ids = [t for t in token_ids if t not in self._hidden_ids]
        delta = self.text.add(token_ids)
        finish = None
        if self.text.stopped:
            finish = "stop"
        elif finish_reason:
            delta += self.text.flush()
            finish = "stop" if self.text.stopped else finish_reason
        if self.tool_calls is not None:
            delta = self.tool_calls.add(delta)
            if finish is not None:
                # Cut by max_tokens, the calls so far are still calls (the last as far as it got), and the
                # finish reason stays "length", as OpenAI's: the client knows the last call may be incomplete.
                tail, self.calls = self.tool_calls.finish(cut=finish == "length")
                delta += tail
                if self.tool_calls.dropped:
                    self._dropped_calls(self.tool_calls.dropped)
                finish = "tool_calls" if self.calls and finish != "length" else finish
        if finish is not None:
            self.finish_reason = finish
        if self.reasoning is not None:
            delta = self.reasoning.answer_delta(delta)
        if self.echo:  # the first delta: stop strings and logprobs are the completion's alone
            delta, self.echo = self.echo + delta, ""
        return delta, reasoning, answered, finish

    def _dropped_calls(self, names: list[str]) -> None:
        """Calls of functions the request did not offer, left out of an answer with other calls: the client
        never sees them, the operator does."""
        log.warning("request %s: the model called %s, not offered by the request; left out of its tool calls",
                    self.ctx.request_id, ", ".join(repr(name) for name in names))
        self.metrics.tool_calls_dropped.inc(len(names))

    def _observe_end(self) -> None:
        m, g = self.metrics, self.generation
        m.e2e.observe(elapsed_s(self.ctx.started_at))
        m.generation_tokens.inc(self.num_completion_tokens)
        if self.counts_prompt:  # n > 1: each prompt is counted once, as the response's usage counts it
            m.prompt_tokens.inc(self.num_prompt_tokens)
            m.cached_tokens.inc(g.num_cached_tokens)

    def _settle(self) -> None:
        if not self._settled:
            self._settled = True
            self.served.settled(self)

    async def chunks(self) -> AsyncIterator[list[bytes]]:
        """JSON bodies of the stream chunks, one list per agent step (sent in one write); the final list
        ends with the finish chunk and, if asked for, usage. Raises GenerationFailed/AgentRejected when
        the stream breaks for good."""
        r = self.request
        encoder = responses.ChunkEncoder(self.id, self.created, r.model, r.chat, self.index)
        batch = [encoder.encode(self._chat_chunk({"role": "assistant", "content": ""}, None, None))] if r.chat else []
        async with aclosing(self._deltas()) as deltas:
            async for delta, reasoning, tokens, finish in deltas:
                if reasoning:
                    batch.append(encoder.encode(self._chat_chunk({"reasoning_content": reasoning}, None, None)))
                self._step_chunks(encoder, delta, tokens, finish, batch)
                if batch:
                    yield batch
                    batch = []

    def _chat_chunk(self, delta: dict, finish: str | None, logprobs: list[dict] | None) -> dict:
        return responses.chat_chunk(self.id, self.created, self.request.model, delta, finish, logprobs, self.index)

    def _step_chunks(self, encoder: responses.ChunkEncoder, delta: str, tokens: list, finish: str | None,
                     out: list[bytes]) -> None:
        r, tokenizer, encode = self.request, self.assets.tokenizer, encoder.encode
        # Tool calls stream as they are written (ToolCallStream), after the step's content.
        call_deltas = self.tool_calls.take_deltas() if self.tool_calls is not None else ()
        if r.logprobs is None and finish is None and not call_deltas:  # the chunk of nearly every token
            if delta:
                out.append(encoder.text(delta))
            return
        if r.chat:
            logprobs = (responses.chat_logprobs(tokenizer, tokens, self.assets.token_bytes) if r.logprobs is not None
                        else None)
            if delta or logprobs:
                out.append(encode(self._chat_chunk({"content": delta}, None, logprobs)))
            for call_delta in call_deltas:
                out.append(encode(self._chat_chunk(call_delta, None, None)))
            if finish is not None:
                out.append(encode(self._chat_chunk({}, finish, None)))
        else:
            logprobs = self._completion_logprobs(tokens) if r.logprobs is not None else None
            if delta or logprobs or finish is not None:
                out.append(encode(responses.completion_chunk(self.id, self.created, r.model, delta, finish,
                                                             logprobs, self.index)))
        if finish is not None and self.emit_usage:
            out.append(encode(responses.usage_chunk(self.id, self.created, r.model, r.chat, self.usage())))

    def _completion_logprobs(self, tokens: list) -> dict:
        """The legacy logprobs of a step's tokens. Each token's `text_offset` is where its text starts in the
        choice's: the sum of the lengths of the tokens before it, whatever text a stop string still holds
        back when the step's chunk is sent."""
        body = responses.completion_logprobs(self.assets.tokenizer, tokens, self._text_offset)
        self._text_offset += sum(len(text) for text in body["tokens"])
        return body

    async def response(self) -> dict:
        r, tokenizer = self.request, self.assets.tokenizer
        parts, reasoning_parts, chat_lp, completion_lp = [], [], [], None
        try:
            async with aclosing(self._deltas()) as deltas:
                async for delta, reasoning, tokens, _finish in deltas:
                    reasoning_parts.append(reasoning)
                    if r.logprobs is not None and r.chat:
                        chat_lp.extend(responses.chat_logprobs(tokenizer, tokens, self.assets.token_bytes))
                    elif r.logprobs is not None:
                        completion_lp = responses.merge_completion_logprobs(completion_lp,
                                                                            self._completion_logprobs(tokens))
                    parts.append(delta)
        except GenerationFailed as exc:
            # Nothing has reached the client yet, so this is still an ordinary 503.
            raise no_capacity(f"Every site tried failed ({exc}); retry shortly.", self.retry_after_s) from exc
        except AgentRejected as exc:
            raise ApiError(502, f"The serving site failed this request: {exc}", "server_error", None,
                           "upstream_error") from exc
        text = "".join(parts)
        if r.chat:
            reasoning = "".join(reasoning_parts) or None if self.reasoning is not None else None
            return responses.chat_response(self.id, self.created, r.model, text, self.finish_reason,
                                           chat_lp if r.logprobs is not None else None, self.usage(),
                                           reasoning, self.reasoning is not None,
                                           [call.body() for call in self.calls], self.index)
        return responses.completion_response(self.id, self.created, r.model, text, self.finish_reason,
                                             completion_lp, self.usage(), self.index)


def _over_token_limit(request: CompletionRequest, num_prompt_tokens: int, max_tokens: list[int],
                      tokens_per_minute: int) -> ApiError:
    """A 400 for a request whose own tokens exceed its key's whole minute: waiting would never admit it."""
    prompt_param = "messages" if request.chat else "prompt"
    if num_prompt_tokens + request.num_choices > tokens_per_minute:
        return bad_request(f"The prompt is {num_prompt_tokens} tokens; with {request.num_choices} choice(s) of at "
                           f"least one token it is over this API key's limit of {tokens_per_minute} tokens per "
                           f"minute, so it can never be admitted. Shorten the prompt.", prompt_param,
                           "rate_limit_too_small")
    needed = num_prompt_tokens + request.n * sum(max_tokens)
    return bad_request(f"This request may use {needed} tokens ({num_prompt_tokens} prompt tokens + up to "
                       f"{needed - num_prompt_tokens} completion tokens over {request.num_choices} choice(s)), more "
                       f"than this API key's limit of {tokens_per_minute} tokens per minute, so it can never be admitted. Lower "
                       f"{request.max_tokens_param} (or n) so the total fits.", request.max_tokens_param,
                       "rate_limit_too_small")


class Served:
    """What one request (its prompts' choices) took from its key's rate limit and gave the client, settled
    once every choice has ended: the unused tokens go back to the limit, and the usage the client saw is
    metered for the registry (router/fleet_reporter.py) — a stream's tokens as they were sent, a whole
    response only when every choice completed (a failed one is an error, not text). Each prompt counts once."""

    def __init__(self, fleet: FleetReporter, charge: Charge | None, key_id, model: str, stream: bool,
                 num_choices: int) -> None:
        self.fleet, self.charge, self.key_id, self.model, self.stream = fleet, charge, key_id, model, stream
        self.runs: list[CompletionRun] = []
        self.num_runs = num_choices

    def failed_to_start(self) -> None:
        """Not every choice got a first token: the whole token charge goes back; nothing was served."""
        if self.charge is not None:
            self.fleet.limiter.give_back(self.charge, self.charge.tokens)
        self.num_runs = -1

    def settled(self, run: CompletionRun) -> None:
        if self.num_runs < 0:  # failed_to_start gave everything back
            return
        if self.charge is not None:
            self.fleet.limiter.give_back(self.charge, run.max_tokens - run.num_completion_tokens)
        self.runs.append(run)
        if len(self.runs) != self.num_runs or not isinstance(self.key_id, int):
            return
        completion = sum(r.num_completion_tokens for r in self.runs)
        delivered = completion > 0 if self.stream else all(r.finish_reason is not None for r in self.runs)
        if delivered:
            num_prompt, num_cached = prompts_usage(self.runs)
            self.fleet.meter.record(self.key_id, self.model, num_prompt, num_cached, completion)


def prompts_usage(runs: list[CompletionRun]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a request's choices: each prompt counted once, by its first choice
    (the others share its prompt and read it from the prefix cache)."""
    firsts = [run for run in runs if run.counts_prompt]
    return sum(run.num_prompt_tokens for run in firsts), sum(run.generation.num_cached_tokens for run in firsts)


class Choices:
    """The choices of one request (n of each of its prompts, more than one in all), answered as one
    response or one stream, in index order (prompt-major).

    Stream chunks carry each choice's index and interleave as the choices produce them; the stream
    ends (finish_reason set) once every choice has finished. Usage counts each prompt once and every
    choice's completion tokens; cached tokens are each prompt's first choice's (the prompt it shares with
    the rest).
    """

    def __init__(self, runs: list[CompletionRun]) -> None:
        self.runs = runs
        first = runs[0]
        self.request, self.ctx, self.generation = first.request, first.ctx, first.generation
        self.metrics = first.metrics
        self.finish_reason: str | None = None

    @property
    def num_completion_tokens(self) -> int:
        return sum(run.num_completion_tokens for run in self.runs)

    def headers(self) -> dict[str, str]:
        return self.runs[0].headers()

    def usage(self) -> dict:
        body = self.runs[0].usage()
        body["prompt_tokens"], body["prompt_tokens_details"]["cached_tokens"] = prompts_usage(self.runs)
        body["completion_tokens"] = self.num_completion_tokens
        body["total_tokens"] = body["prompt_tokens"] + body["completion_tokens"]
        details = body.get("completion_tokens_details", {})
        if "reasoning_tokens" in details:
            details["reasoning_tokens"] = sum(
                run.reasoning.num_reasoning_tokens for run in self.runs if run.reasoning is not None)
        if "accepted_prediction_tokens" in details:
            counts = [r.generation.prediction_counts(r.num_completion_tokens) for r in self.runs]
            details["accepted_prediction_tokens"] = sum(accepted for accepted, _ in counts)
            details["rejected_prediction_tokens"] = sum(rejected for _, rejected in counts)
        return body

    async def response(self) -> dict:
        tasks = [asyncio.ensure_future(run.response()) for run in self.runs]
        try:
            bodies = await asyncio.gather(*tasks)
        except BaseException:  # one choice failed (or the client left): end the others' generations too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = self.usage()
        return body

    async def chunks(self) -> AsyncIterator[list[bytes]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(run: CompletionRun) -> None:
            # Whether a batch is its run's last is read as it is queued: a run reads ahead of the consumer
            # (a step's tokens for every choice arrive at once), so by the time an earlier batch of it is
            # taken, it may have finished, and its last batch, still queued, would be left unsent.
            try:
                async with aclosing(run.chunks()) as batches:
                    async for batch in batches:
                        await queue.put((run, batch, None, run.finish_reason is not None))
            except Exception as exc:  # handed to the consumer, which raises it as the stream's failure
                await queue.put((run, None, exc, True))

        tasks = [asyncio.ensure_future(pump(run)) for run in self.runs]
        try:
            running = set(self.runs)
            while running:
                run, batch, error, last = await queue.get()
                if error is not None:
                    raise error
                if last:
                    running.discard(run)
                if not running:
                    r = self.request
                    if r.include_usage:
                        batch.append(responses.ChunkEncoder.encode(responses.usage_chunk(
                            self.runs[0].id, self.runs[0].created, r.model, r.chat, self.usage())))
                    self.finish_reason = self.runs[0].finish_reason
                yield batch
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
