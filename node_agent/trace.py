"""One request's W3C trace context across router and agents, and the log lines that name it.

The router takes a client's `traceparent` header (https://www.w3.org/TR/trace-context/) or starts a
trace, keeps the client's `tracestate` (vendors' entries, passed on unchanged when valid), and binds
(request id, trace) to the request's task (`bind`). Every gRPC call made from that task carries
`traceparent` and `tracestate` in its metadata (`node_agent.client` reads the bound trace), an agent
binds what it receives to the RPC's task, and so do the calls it makes on (a decode site pulling KV
from the prefill site); the KV data port, which carries no metadata, finds the trace of a lease by
its handle (`LeaseTraces`). `RequestLogFilter` appends ` [request_id=... trace_id=...]` to every log
line written while a request is bound, so `grep <trace id>` over the router's and the sites' logs
follows one request everywhere it went.

contextvars follow asyncio: a task started from a request's task inherits its binding, and nothing
else sees it.
"""

from __future__ import annotations

import logging
import random
import re
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass

HEADER = "traceparent"
STATE_HEADER = "tracestate"
# version-trace_id-parent_id-flags; a version after 00 may add fields after another dash
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
# tracestate list members: a simple key, or tenant@system, "=" a value of printable ASCII without "," and
# "=" that does not end in a space (W3C Trace Context, section 3.3.1.3)
_STATE_MEMBER = re.compile(r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
                           r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")
MAX_STATE_MEMBERS = 32
MAX_STATE_CHARS = 512   # what every hop must pass on; longer states are cut as the specification says
_LONG_STATE_MEMBER = 128
# Ids must be unique, not secret: a seeded generator costs a fraction of an os.urandom call per request.
_ids = random.Random()


def _random_hex(bits: int) -> str:
    return f"{_ids.getrandbits(bits) or 1:0{bits // 4}x}"  # never all zeros (invalid)


@dataclass(slots=True, frozen=True)
class TraceContext:
    trace_id: str   # 32 lowercase hex digits, not all zero
    span_id: str    # 16 lowercase hex digits: the caller's span, the parent of whoever receives it
    flags: str = "01"
    tracestate: str = ""  # the client's, normalized (members joined by ","); "" for none

    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    def child(self) -> TraceContext:
        """The same trace with a new span: what this process passes on as the parent of the next hop."""
        return TraceContext(self.trace_id, _random_hex(64), self.flags, self.tracestate)


def new_trace() -> TraceContext:
    return TraceContext(_random_hex(128), _random_hex(64))


def parse_traceparent(value: str | None) -> TraceContext | None:
    """A valid traceparent (version 00, or a later version read as 00 allows), else None: an invalid
    header starts a new trace, as the specification asks, rather than failing the request."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceContext(trace_id, span_id, flags)


def parse_tracestate(values: list[str]) -> str:
    """The tracestate of one or more header values (a list split over several headers is one list), with
    empty members left out: "" when it is malformed (a bad member, a key twice, more than 32 members),
    which drops it without failing the request. Over 512 characters, members longer than 128 go first,
    then members from the end, as the specification asks of a hop that must shorten it."""
    members = [member.strip(" \t") for value in values for member in value.split(",")]
    members = [member for member in members if member]
    if len(members) > MAX_STATE_MEMBERS or not all(_STATE_MEMBER.fullmatch(member) for member in members):
        return ""
    keys = [member.split("=", 1)[0] for member in members]
    if len(set(keys)) != len(keys):
        return ""
    if len(",".join(members)) > MAX_STATE_CHARS:
        members = [member for member in members if len(member) <= _LONG_STATE_MEMBER]
    while len(",".join(members)) > MAX_STATE_CHARS:
        members.pop()
    return ",".join(members)


def with_state(trace: TraceContext, tracestate: str) -> TraceContext:
    return TraceContext(trace.trace_id, trace.span_id, trace.flags, tracestate)


def from_metadata(metadata) -> TraceContext | None:
    """The trace a gRPC caller sent (invocation metadata: pairs of key, value), with its tracestate."""
    pairs = list(metadata or ())
    for key, value in pairs:
        if key == HEADER:
            trace = parse_traceparent(value)
            if trace is None:
                return None  # no trace to hold a state: a new one starts without the caller's
            return with_state(trace, parse_tracestate([v for k, v in pairs if k == STATE_HEADER]))
    return None


# -- the request this task works for -----------------------------------------------------------

@dataclass(slots=True, frozen=True)
class Bound:
    request_id: str
    trace: TraceContext


_bound: ContextVar[Bound | None] = ContextVar("edgefire_request", default=None)


def bind(request_id: str, trace: TraceContext) -> None:
    """From here on this task (and tasks it starts) works for this request: its logs and calls say so."""
    _bound.set(Bound(request_id, trace))


def current() -> Bound | None:
    return _bound.get()


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """`traceparent` (and `tracestate`, when the trace has one) for a call made on behalf of the bound
    request (none when nothing is bound)."""
    bound = _bound.get()
    if bound is None:
        return ()
    parent = ((HEADER, bound.trace.child().traceparent()),)
    return parent + ((STATE_HEADER, bound.trace.tracestate),) if bound.trace.tracestate else parent


class RequestLogFilter(logging.Filter):
    """Sets `record.request_context`: ` [request_id=... trace_id=...]` while a request is bound, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _bound.get()
        record.request_context = ("" if bound is None else
                                  f" [request_id={bound.request_id} trace_id={bound.trace.trace_id}]")
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_context)s"


class LeaseTraces:
    """The request a KV lease was made for, by handle: the KV data port's stream has no metadata, so
    the prefill site logs an export under the trace of the Prefill that made the lease. Bounded: a
    lease that expires unread is forgotten when newer ones push it out."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._entries: OrderedDict[str, Bound] = OrderedDict()
        self._max_entries = max_entries

    def remember(self, kv_handle: str) -> None:
        bound = _bound.get()
        if bound is None:
            return
        self._entries[kv_handle] = bound
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def bind(self, kv_handle: str) -> None:
        """Binds this task to the lease's request (its trace, with a new span), if it is known."""
        bound = self._entries.get(kv_handle)
        if bound is not None:
            bind(bound.request_id, bound.trace.child())

    def forget(self, kv_handle: str) -> None:
        self._entries.pop(kv_handle, None)
