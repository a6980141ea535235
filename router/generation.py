"""One request's token stream across sites: placement's ranked candidates, failover and resume.

Before the first token, a site that cannot connect, times out, is full (RESOURCE_EXHAUSTED) or is
draining (UNAVAILABLE) is skipped for the next candidate. When the only candidates left are sites
that answered RESOURCE_EXHAUSTED (full, not broken), the request waits and tries them again, backing
off from 50 ms to 1 s, for up to `max_full_wait_s` (and never past the first-token timeout, or the
token idle timeout once tokens were sent); refusals for fullness do not count as attempts.

After tokens have reached the client, a lost decode site is replaced by the next candidate's decode
site with `Decode(prompt_ids, generated_ids)` and no KV source: it re-prefills prompt + everything
already sent and continues, so the stream the caller sees has no gap and no repeat.
`sampling.max_tokens` always counts every output token, those already sent included. Attempts
(fresh starts and resumes) are bounded. When none of the placement's pairs is left, the request is
placed again on the router's current snapshot (failed sites still excluded): a site that was full or
late with its heartbeat when the request arrived may have room by the time its first site dies. When
that snapshot offers no usable pair either (the only other site was cordoned a moment ago, or its
heartbeat is late), the request waits for one the same way it waits for room, placing itself again
after each wait, rather than breaking a stream that a site a second later could finish.

A site that stops answering without closing its connections (a frozen process, a hung device) would
hold its attempt for the whole first-token or token idle timeout (30 s by default). So an attempt
whose site has been silent for `LOST_SILENCE_S` is given up as soon as the router's view no longer
counts that site alive (its heartbeats stopped, or it left the registry): a site that still streams
is never cut on the registry's word alone, and a registry outage does not make sites look dead (the
router keeps its last good view; see snapshot_feed.py).

Every KV lease a split attempt makes is ended by this request unless its decode site took it: each
Prefill carries a fresh lease id, so a Prefill given up on (the client hung up, a timeout, a lost
site) is released by that id even when the agent answered and the answer never arrived; a release
that overtakes its Prefill still ends the lease (node_agent.core.LeaseIds).

Predicted outputs. A site counts the proposals from the request's prediction it verified, as running
totals on every message; a message holds at most one step that verified any, its first, whose kept
proposals are the message's first tokens (engine.async_engine.TokenEvent.more). `prediction_counts`
gives the counts of an answer the router cut inside a message (a stop string, the end of its tool calls):
only proposals at positions before the cut count, kept ones as accepted, the others as rejected. A
proposal past the cut counts as neither: the usage describes the answer the client got as a site that
stopped at the cut would have counted it, as completion_tokens leaves out the tokens made past it. So
accepted_prediction_tokens never exceeds completion_tokens.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from node_agent.client import AgentPool
from node_agent.proto import agent_pb2
from router.health import PassiveHealth
from router.ledger import Attempt, InflightLedger
from router.metrics import RouterMetrics
from router.placement import Candidate

log = logging.getLogger(__name__)

# Errors after which another site may well succeed; anything else is the request's own fault.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION,
})
# Prefill failures after which the agent may have leased KV all the same: the call ended on this
# side (a deadline, a lost connection) or for a reason the agent did not choose, perhaps after it answered.
UNSURE_PREFILL_CODES = frozenset({
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
})
RELEASE_TIMEOUT_S = 5.0
SITE_WATCH_S = 1.0     # how often a silent attempt's site is looked up in the router's view
LOST_SILENCE_S = 2.0   # the silence after which a site the view no longer counts alive is given up
FULL_RETRY_S, FULL_RETRY_MAX_S = 0.05, 1.0  # the wait before placing again, doubling to the cap


@dataclass(slots=True)
class FailoverPolicy:
    max_attempts: int = 3
    first_token_timeout_s: float = 30.0
    token_idle_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    # how long a request waits for room on full sites, or for a site to take it when none is left
    # (within the first-token timeout, or the token idle timeout once tokens were sent)
    max_full_wait_s: float = 5.0


@dataclass(slots=True)
class TokenStep:
    tokens: list  # agent_pb2.Token
    finish_reason: str  # "" while streaming; stop | length on the last step


class GenerationFailed(Exception):
    """Every candidate failed (`started` says whether the client already had tokens)."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


class AgentRejected(Exception):
    """A site refused the request itself (e.g. INVALID_ARGUMENT): another site would too."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


class _StreamEnded(Exception):
    """The agent closed the stream without a finish reason."""


class _SiteLost(Exception):
    """The attempt's site fell silent and the router's view no longer counts it alive."""


@dataclass(slots=True)
class Generation:
    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: agent_pb2.SamplingParams
    candidates: list[Candidate]
    agents: AgentPool
    health: PassiveHealth
    policy: FailoverPolicy
    ledger: InflightLedger | None = None   # told of every attempt, so the next placement sees its load
    metrics: RouterMetrics | None = None   # failovers, resumes and site failures are counted there
    # The current snapshot's ranked pairs, asked for when none of `candidates` is left: a site that
    # was not viable when the request was placed (full, a late heartbeat) may be by the time it fails.
    replan: Callable[[], list[Candidate]] | None = None
    # Whether the router's current view counts a site alive (None: silent sites wait out their timeouts).
    site_alive: Callable[[str], bool] | None = None
    placed: Candidate | None = None        # the candidate that produced the first token
    generated_ids: list[int] = field(default_factory=list)
    prefill_site: str | None = None
    decode_site: str | None = None
    num_attempts: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Per message whose site verified proposals from the predicted output, over every attempt (a resumed
    # one's too): (its first token's position in generated_ids, proposals kept, proposals rejected)
    prediction_steps: list[tuple[int, int, int]] = field(default_factory=list)
    _failed: set[str] = field(default_factory=set)
    # (site, "prefill" | "decode") an agent refused for its role: the pool planner moved it and this
    # router's snapshot is behind. The site is fine for its other role, so it is not a failure.
    _wrong_role: set[tuple[str, str]] = field(default_factory=set)
    _full: set[str] = field(default_factory=set)   # sites that answered RESOURCE_EXHAUSTED since the last wait
    _num_full_refusals: int = 0
    _num_waits: int = 0
    _waiting_since: float | None = None
    _last_failure: str = ""   # why the last attempt failed: the reason a failover or resume is counted under

    async def steps(self) -> AsyncIterator[TokenStep]:
        while True:
            candidate = self._next_candidate()
            if candidate is None:
                if await self._waited():
                    continue
                raise GenerationFailed(self._failure_summary(), bool(self.generated_ids))
            self.num_attempts += 1
            if self.num_attempts > 1 and self.metrics is not None:
                self.metrics.moved_on(self._last_failure or "unknown", bool(self.generated_ids))
            attempt = self._record_attempt(candidate)
            site, call, lease = None, None, None
            try:
                if not self.generated_ids and not candidate.colocated:
                    site = candidate.prefill_site
                    self.prefill_site, self.decode_site = site.name, candidate.decode_site.name
                    result = await self._prefill(candidate)
                    self._prefilled(attempt, candidate)
                    step = TokenStep([result.first_token], result.finish_reason)
                    self._accept(step)
                    # Held from here: a caller that stops at this first token (its client left) closes
                    # the generator at the yield, and `finally` ends the lease no decode site will take.
                    lease = (site.grpc_address, result.kv_handle) if result.kv_handle else None
                    yield step
                    if step.finish_reason:
                        self.health.record_success(site.name)
                        return
                    site = candidate.decode_site
                    call = self._decode(site, lease)
                elif not self.generated_ids:
                    site = candidate.prefill_site
                    self.prefill_site = site.name
                    call = self.agents.client(site.grpc_address).generate(agent_pb2.GenerateRequest(
                        request_id=self.request_id, model=self.model, prompt_ids=self.prompt_ids,
                        sampling=self.sampling), self.policy.request_timeout_s)
                else:
                    site = candidate.decode_site
                    call = self._decode(site, None)
                self.decode_site = site.name
                async with aclosing(self._read(call, site.name)) as steps:  # closed here, not by the GC's finalizer task
                    async for step in steps:
                        lease = None  # the decode site has the KV now; its lease is its to end
                        self._prefilled(attempt, candidate)
                        yield step
                        if step.finish_reason:
                            self.health.record_success(site.name)
                            return
                raise _StreamEnded()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE_CODES:
                    raise AgentRejected(exc.details() or exc.code().name, bool(self.generated_ids)) from exc
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    role = "prefill" if not candidate.colocated and site is candidate.prefill_site else "decode"
                    self._wrong_role.add((site.name, role))
                    self._last_failure = "wrong_role"
                    log.info("request %s: site %s no longer takes %s work (%s); next candidate", self.request_id,
                             site.name, role, exc.details())
                    continue
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._refused_as_full(site.name, exc.details())
                    continue
                self._fail(site.name, exc.code().name.lower())
            except TimeoutError:
                self._fail(site.name, "timeout")
            except _SiteLost:
                self._fail(site.name, "site_lost")
            except _StreamEnded:
                self._fail(site.name, "stream_ended")
            finally:
                if call is not None:
                    call.cancel()
                if lease is not None:
                    self._release_later(*lease)
                if attempt is not None:
                    self.ledger.finished(attempt)

    def _attempts_spent(self) -> bool:
        return self.num_attempts - self._num_full_refusals >= self.policy.max_attempts

    def _next_candidate(self) -> Candidate | None:
        if self._attempts_spent():
            return None
        candidate = self._first_usable()
        if candidate is None and self.replan is not None:
            self.candidates = self.replan()
            candidate = self._first_usable()
            if candidate is not None:
                log.info("request %s: none of its placement's pairs is left; placed again on the current "
                         "snapshot: %s -> %s", self.request_id, candidate.prefill_site.name, candidate.decode_site.name)
        return candidate

    def _first_usable(self) -> Candidate | None:
        for candidate in self.candidates:
            if candidate.decode_site.name in self._failed or (candidate.decode_site.name, "decode") in self._wrong_role:
                continue
            # A resume needs only a decode site; a fresh start needs both of the pair.
            if not self.generated_ids and (candidate.prefill_site.name in self._failed
                                           or (candidate.prefill_site.name, "prefill") in self._wrong_role):
                continue
            return candidate
        return None

    async def _waited(self) -> bool:
        """No candidate is left: wait a little for room on the full ones, or (with a replan) for a site
        to come live, then let placement try again. False: attempts or time are spent."""
        if self._attempts_spent() or (not self._full and self.replan is None):
            return False
        now = asyncio.get_running_loop().time()
        if self._waiting_since is None:
            self._waiting_since = now
        timeout_s = self.policy.token_idle_timeout_s if self.generated_ids else self.policy.first_token_timeout_s
        remaining_s = min(self.policy.max_full_wait_s, timeout_s) - (now - self._waiting_since)
        if remaining_s <= 0.001:
            return False
        delay_s = min(FULL_RETRY_S * 2 ** self._num_waits, FULL_RETRY_MAX_S, remaining_s)  # the last try at the end
        self._num_waits += 1
        if self._full:
            log.info("request %s: every candidate left is full (%s); trying again in %.2f s", self.request_id,
                     ", ".join(sorted(self._full)), delay_s)
        else:
            log.info("request %s: no site left to take it (failed: %s); placing it again in %.2f s", self.request_id,
                     ", ".join(sorted(self._failed)) or "none", delay_s)
        await asyncio.sleep(delay_s)
        self._failed -= self._full
        self._full.clear()
        return True

    def _failure_summary(self) -> str:
        if self._full:
            return (f"every site that can take this request is full ({self._num_full_refusals} refusal(s) "
                    f"over {self._num_waits} wait(s))")
        if self._num_waits:
            return f"all {self.num_attempts} attempt(s) failed and no other site could take it within the wait"
        return f"all {self.num_attempts} attempt(s) failed"

    def _record_attempt(self, candidate: Candidate) -> Attempt | None:
        if self.ledger is None:
            return None
        if not self.generated_ids:
            return self.ledger.record(candidate, len(self.prompt_ids), self.sampling.max_tokens)
        return self.ledger.record_resume(candidate.decode_site, len(self.prompt_ids) + len(self.generated_ids),
                                         self.sampling.max_tokens - len(self.generated_ids), self.model)

    def _prefilled(self, attempt: Attempt | None, candidate: Candidate) -> None:
        if self.placed is None:
            self.placed = candidate
        if attempt is not None and not attempt.prefilled:
            self.ledger.prefilled(attempt)

    async def _prefill(self, candidate: Candidate):
        # Names the lease before any answer does: a call given up on (the client hung up, a timeout)
        # may end just after the agent answered, and then only this id reaches its lease.
        lease_id = secrets.token_hex(16)
        request = agent_pb2.PrefillRequest(request_id=self.request_id, model=self.model, prompt_ids=self.prompt_ids,
                                           sampling=self.sampling, lease_id=lease_id)
        timer = _ReadTimer(self._lost_check(candidate.prefill_site.name))
        address = candidate.prefill_site.grpc_address
        answer = asyncio.ensure_future(self.agents.client(address).prefill(request, self.policy.first_token_timeout_s))
        try:
            result = await timer.read(_Once(answer), self.policy.first_token_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNSURE_PREFILL_CODES:
                self._release_later(address, "", lease_id)
            raise
        except (asyncio.CancelledError, TimeoutError, _SiteLost):
            # Given up here: the agent may have leased the KV (answered or not), and the prefill site
            # would hold it until the lease expires. A release that overtakes the Prefill still ends it.
            self._release_later(address, _answered_handle(answer), lease_id)
            raise
        finally:
            timer.close()
        self.num_prompt_tokens = result.num_prompt_tokens or len(self.prompt_ids)
        self.num_cached_tokens = result.num_cached_tokens
        return result

    def _decode(self, site, lease: tuple[str, str] | None):
        request = agent_pb2.DecodeRequest(request_id=self.request_id, model=self.model, prompt_ids=self.prompt_ids,
                                          generated_ids=self.generated_ids, sampling=self.sampling)
        if lease is not None:
            request.kv_source.address, request.kv_source.kv_handle = lease
        return self.agents.client(site.grpc_address).decode(request, self.policy.request_timeout_s)

    def _lost_check(self, site: str) -> Callable[[float], bool] | None:
        """Given how long the site has been silent: whether to give it up (see the module docstring)."""
        if self.site_alive is None:
            return None
        return lambda silent_s: silent_s >= LOST_SILENCE_S and not self.site_alive(site)

    async def _read(self, call, site: str) -> AsyncIterator[TokenStep]:
        timeout, timer = self.policy.first_token_timeout_s, _ReadTimer(self._lost_check(site))
        first = True
        counted = (0, 0)  # this call's prediction counts already added (its chunks carry running totals)
        try:
            while True:
                chunk = await timer.read(call, timeout)
                if chunk is grpc.aio.EOF:
                    return
                if first and not self.num_prompt_tokens:
                    self.num_prompt_tokens = chunk.num_prompt_tokens or len(self.prompt_ids)
                    self.num_cached_tokens = chunk.num_cached_tokens
                first, timeout = False, self.policy.token_idle_timeout_s
                totals = (chunk.num_accepted_prediction_tokens, chunk.num_rejected_prediction_tokens)
                if totals != counted:
                    self.prediction_steps.append((len(self.generated_ids), totals[0] - counted[0],
                                                  totals[1] - counted[1]))
                    counted = totals
                step = TokenStep(list(chunk.tokens), chunk.finish_reason)
                self._accept(step)
                yield step
        finally:
            timer.close()

    def prediction_counts(self, num_tokens: int) -> tuple[int, int]:
        """(accepted, rejected) proposals from the predicted output at positions before `num_tokens`, the
        answer's length (see the module docstring). A message's kept proposals are its first tokens, and
        its rejected ones were proposed at the position after them: cut before that, they lie past the cut."""
        accepted = rejected = 0
        for start, num_accepted, num_rejected in self.prediction_steps:
            kept = num_tokens - start
            if kept <= 0:
                break
            accepted += min(num_accepted, kept)
            if kept > num_accepted:
                rejected += num_rejected
        return accepted, rejected

    def _accept(self, step: TokenStep) -> None:
        self.generated_ids.extend(token.token_id for token in step.tokens)
        self._waiting_since = None  # tokens flowed again: a later failure gets a wait budget of its own
        self._num_waits = 0

    def _fail(self, site: str, reason: str) -> None:
        self._failed.add(site)
        self.health.record_failure(site)
        self._last_failure = reason
        if self.metrics is not None:
            self.metrics.site_failed(site, reason)
        log.warning("request %s: site %s failed (%s) after %d token(s); attempt %d of %d", self.request_id, site,
                    reason, len(self.generated_ids), self.num_attempts, self.policy.max_attempts)

    def _refused_as_full(self, site: str, details: str | None) -> None:
        self._failed.add(site)
        self._full.add(site)
        self._num_full_refusals += 1
        self.health.record_failure(site)
        self._last_failure = "full"
        log.info("request %s: site %s is full (%s) after %d token(s); next candidate", self.request_id, site,
                 details or "RESOURCE_EXHAUSTED", len(self.generated_ids))

    def _release_later(self, address: str, kv_handle: str, lease_id: str = "") -> None:
        # A lease the decode site never took must be ended now rather than left to expire.
        task = asyncio.ensure_future(self._release(address, kv_handle, lease_id))
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _release(self, address: str, kv_handle: str, lease_id: str) -> None:
        try:
            await self.agents.client(address).release_kv(kv_handle, RELEASE_TIMEOUT_S, self.request_id, lease_id)
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: ReleaseKV on %s failed (%s); the lease will expire", self.request_id, address,
                     exc.code().name)


class _ReadTimer:
    """`await timer.read(call, timeout_s)`: the call's next message, or TimeoutError after timeout_s;
    with `lost` (given the seconds the read has waited), _SiteLost once it says the site is gone,
    asked every SITE_WATCH_S while a read waits.

    What `asyncio.timeout` around each read does, with one timer per stream instead of one set and
    cancelled per token: the timer is re-armed only when it fires, for the read then in progress.
    """

    def __init__(self, lost: Callable[[float], bool] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._lost = lost
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for = 0.0
        self._task: asyncio.Task | None = None
        self._deadline: float | None = None  # of the read in progress; None between reads
        self._started = 0.0                  # when the read in progress began
        self._expired: type[Exception] | None = None   # what the timer ended the read with

    async def read(self, call, timeout_s: float):
        self._started = now = self._loop.time()
        self._deadline = now + timeout_s
        self._task = task = asyncio.current_task()
        self._expired = None
        wake = self._next_wake(now)
        if self._handle is None or self._armed_for > wake:
            self._arm(wake)
        cancelling = task.cancelling()
        try:
            return await call.read()
        except asyncio.CancelledError:
            if self._expired is not None and task.uncancel() <= cancelling:
                raise self._expired from None
            raise
        finally:
            self._deadline = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _next_wake(self, now: float) -> float:
        return min(self._deadline, now + SITE_WATCH_S) if self._lost is not None else self._deadline

    def _arm(self, when: float) -> None:
        self.close()
        self._armed_for = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if self._deadline is None:
            return  # between reads: the next read arms the timer again
        now = self._loop.time()
        if now >= self._deadline - 0.001:  # a timer may fire a little early
            self._expire(TimeoutError)
        elif self._lost is not None and self._lost(now - self._started):
            self._expire(_SiteLost)
        else:
            self._arm(self._next_wake(now))

    def _expire(self, error: type[Exception]) -> None:
        self._expired = error
        self._task.cancel()


def _answered_handle(answer: asyncio.Future) -> str:
    """The KV handle of a Prefill answer that arrived, or "" (none yet, or a failure)."""
    if answer.done() and not answer.cancelled() and answer.exception() is None:
        return answer.result().kv_handle
    return ""


class _Once:
    """A unary call read like a stream's one message (for _ReadTimer)."""

    def __init__(self, call) -> None:
        self._call = call

    async def read(self):
        return await self._call


_background: set[asyncio.Task] = set()
