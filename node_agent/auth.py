"""Token authentication for the agent's gRPC API, by caller role, on both sides of a call.

Two credentials, one per kind of caller, so that a site (which must hold the peer token to pull KV
from its peers) cannot use it to run work on, read the models of, or drain another site:

    agent token  routers present it      Generate, Prefill, Decode, Session, Embed, GetModelInfo, Drain
    peer token   agents, to each other   FetchKV, and the KV data port (node_agent.kv_data: pulls and probes)
    either                               Health (routers check sites; a puller learns its source's data
                                         port) and ReleaseKV (routers end leases they no longer need; a
                                         decode site ends its source's lease when it recomputes instead)

An agent only checks the agent token, never presents it, so it holds the token's SHA-256
(`agent_token_sha256`), not the token: a site whose files are read gives away the peer token, which
opens only what every site may do anyway, and no way to act as a router.

Drain is an operator's act; no router calls it. Operators drain through the registry (the agent learns
it with its next heartbeat) or with SIGTERM; a tool calling the RPC presents the agent token, never the
peer token, which every site holds.

Every call carries one `authorization: Bearer <token>` entry; the server interceptor checks it (in
constant time) before any handler runs. No entry, or a token that is neither: UNAUTHENTICATED. A valid
token of the other role: PERMISSION_DENIED, naming the token the method takes. The header is read as the
registry and the routers read theirs: the scheme in any case, the token with its surrounding spaces
dropped. A call carrying the entry twice is refused, whichever of them holds the token: which one a hop
in between added is not knowable here.

An agent given no agent token digest (configurations from before the split) takes its peer token for
every method, as it always did; the daemon says so in a warning at start.

Rotation: an agent accepts several agent token digests (routers switch to a new agent token one at a
time, after every agent accepts it) and, beside the peer token it sends, the peer tokens of
`accept_peer_tokens` (its peers switch one at a time: first every agent accepts the new one, then each
sends it, then the old one goes). Every accepted token is held as its SHA-256 and the presented token's
digest is compared with all of them, each comparison in constant time and none skipped once one
matches, so neither the time taken nor anything else tells which token, or which role, came close.
No accepted agent token may be an accepted peer token: one token would open both roles again.

Counting, for rotations: every accepted call (and every request a Session stream opens, as its own call
was) is counted by the role of the token that opened it and by that token's `credential` label, the first
8 hex digits of its SHA-256 (what `printf %s TOKEN | sha256sum` prints, and how agent_token_sha256 already
names an agent token). A position in the configured lists would name a different token once a rotation
step reorders or shortens them, and differ between agents mid-rotation; the digest prefix names the same
token on every agent and at every step, and gives away no more than the digest an agent holds anyway.
Which candidate matched is recorded inside the comparison loop by arithmetic on each comparison's result,
so finding it adds no branch and no early exit.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc import aio

ROUTER, PEER = "router", "peer"
CREDENTIALS = {ROUTER: "the agent token (routers present it: their agent_token)",
               PEER: "the peer token (agents present it to each other: peer_token)"}
SERVICE = "/edgefire.agent.v1.Agent/"
GRPC, KV_DATA = "grpc", "kv_data"                 # the ports a credential is checked on
UNAUTHENTICATED, PERMISSION_DENIED = "unauthenticated", "permission_denied"   # why a call was refused
CREDENTIAL_HEX_DIGITS = 8
# Method -> the roles whose token opens it. A method of the service not listed here opens to no one.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "Generate": frozenset({ROUTER}),
    "Prefill": frozenset({ROUTER}),
    "Decode": frozenset({ROUTER}),
    "Session": frozenset({ROUTER}),   # Generate and Decode for many requests over one stream
    "Embed": frozenset({ROUTER}),
    "GetModelInfo": frozenset({ROUTER}),
    "Drain": frozenset({ROUTER}),
    "FetchKV": frozenset({PEER}),
    "Health": frozenset({ROUTER, PEER}),
    "ReleaseKV": frozenset({ROUTER, PEER}),
}


def token_digest(token: str) -> str:
    """What an agent holds of the agent token: its SHA-256 as 64 lowercase hex digits
    (`printf %s TOKEN | sha256sum`)."""
    return hashlib.sha256(token.encode()).hexdigest()


def credential_label(digest: bytes) -> str:
    """How the metrics name an accepted token: the first hex digits of its SHA-256, enough to tell the
    tokens of a rotation apart, never the token."""
    return digest.hex()[:CREDENTIAL_HEX_DIGITS]


class AuthObserver(Protocol):
    """Counts checked credentials (node_agent.metrics.AgentMetrics)."""

    def observe_accepted(self, port: str, role: str, credential: str) -> None: ...

    def observe_refused(self, port: str, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class TokenMatch:
    """What a presented token is to this agent. roles is empty for a token it does not accept; role is the
    role the matching token is configured for (ROUTER: an agent token digest; PEER: peer_token or one of
    accept_peer_tokens, also on an agent with no agent token, where it opens every method) and credential
    its label (credential_label)."""

    roles: frozenset[str]
    role: str | None = None
    credential: str | None = None


NO_MATCH = TokenMatch(frozenset())


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _rejecting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only answers `code`."""
    if handler.response_streaming:
        async def reject_stream(_request, context: aio.ServicerContext):
            await context.abort(code, message)
            yield  # unreachable; makes this an async generator like the method it stands in for

        return grpc.unary_stream_rpc_method_handler(reject_stream, handler.request_deserializer,
                                                    handler.response_serializer)

    async def reject_unary(_request, context: aio.ServicerContext):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(reject_unary, handler.request_deserializer,
                                               handler.response_serializer)


class RoleTokens:
    """Which roles a presented token holds. Without an agent token digest every peer token holds both.

    peer_token is the one this agent sends its peers; accept_peer_tokens are accepted beside it, never
    sent. agent_token_sha256 is one digest or several (64 hex digits each)."""

    def __init__(self, peer_token: str, agent_token_sha256: str | Sequence[str] | None = None,
                 accept_peer_tokens: Sequence[str] = ()):
        peer_tokens = [peer_token, *accept_peer_tokens]
        if not all(peer_tokens):
            raise ValueError("a peer token must not be empty")
        self._peer_digests = _distinct(hashlib.sha256(token.encode()).digest() for token in peer_tokens)
        self._router_digests = _distinct(bytes.fromhex(digest) for digest in _as_list(agent_token_sha256))
        self._peer_labels = tuple(map(credential_label, self._peer_digests))
        self._router_labels = tuple(map(credential_label, self._router_digests))
        # The data port reads exactly a peer token's length, then compares (node_agent.kv_data).
        self.peer_token_lengths = frozenset(len(token.encode()) for token in peer_tokens)
        if any(_matches_any(digest, self._router_digests) for digest in self._peer_digests):
            raise ValueError("the agent token and the peer token must differ: one token would open both roles")

    @property
    def split(self) -> bool:
        return bool(self._router_digests)

    def roles_of(self, token: bytes) -> frozenset[str]:
        """The roles `token` holds (empty: it is no accepted token)."""
        return self.match(token).roles

    def match(self, token: bytes) -> TokenMatch:
        """The roles `token` holds and which accepted token it is. Its digest is compared with every
        accepted one, so the time taken does not tell which one, or which role, came close; only once all
        are compared does the result choose a label."""
        digest = hashlib.sha256(token).digest()
        peer_index = _match_index(digest, self._peer_digests)
        router_index = _match_index(digest, self._router_digests)
        if peer_index >= 0:
            return TokenMatch(frozenset({ROUTER, PEER}) if not self.split else frozenset({PEER}), PEER,
                              self._peer_labels[peer_index])
        if router_index >= 0:
            return TokenMatch(frozenset({ROUTER}), ROUTER, self._router_labels[router_index])
        return NO_MATCH


def _as_list(digests: str | Sequence[str] | None) -> list[str]:
    if not digests:
        return []
    return [digests] if isinstance(digests, str) else list(digests)


def _distinct(digests) -> tuple[bytes, ...]:
    return tuple(dict.fromkeys(digests))


def _matches_any(digest: bytes, candidates: Sequence[bytes]) -> bool:
    return _match_index(digest, candidates) >= 0


def _match_index(digest: bytes, candidates: Sequence[bytes]) -> int:
    """The position of `digest` among `candidates` (distinct), -1 when it is none of them. Every candidate
    is compared, in constant time, with no early exit once one matches; the position is summed from each
    comparison's 0 or 1 rather than chosen by a branch on it."""
    position_plus_one = 0
    for position, candidate in enumerate(candidates, start=1):
        position_plus_one += position * hmac.compare_digest(digest, candidate)
    return position_plus_one - 1


def _presented(metadata) -> tuple[bytes | None, str | None]:
    """The bearer token of a call's metadata, or why there is none to read."""
    presented = [value for key, value in metadata or () if key == "authorization"]
    if not presented:
        return None, "missing authorization metadata"
    if len(presented) > 1:
        return None, "send one authorization metadata entry, not several"
    scheme, _, token = str(presented[0]).partition(" ")
    if scheme.lower() != "bearer":
        return None, "the authorization metadata must be 'Bearer <token>'"
    return token.strip().encode(), None


def check_call(tokens: RoleTokens, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
    """Why the call of `method` (its full gRPC name) is refused, as (status, message); None: allowed."""
    return authorize(tokens, method, metadata)[0]


def authorize(tokens: RoleTokens, method: str, metadata) -> tuple[tuple[grpc.StatusCode, str] | None, TokenMatch]:
    """check_call's answer, with what the presented token is to this agent."""
    name = method.removeprefix(SERVICE)
    allowed = METHOD_ROLES.get(name, frozenset()) if method.startswith(SERVICE) else frozenset()
    wanted = " or ".join(CREDENTIALS[role] for role in sorted(allowed, reverse=True)) or "no credential"
    token, problem = _presented(metadata)
    if token is None:
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"{problem}; {name} takes 'authorization: Bearer <token>' with {wanted}"), NO_MATCH
    match = tokens.match(token)
    roles = match.roles
    if not roles:
        return (grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid for this agent"), match
    if roles & allowed:
        return None, match
    held = " and ".join(CREDENTIALS[role] for role in sorted(roles, reverse=True))
    if not allowed:
        return (grpc.StatusCode.PERMISSION_DENIED, f"{name} opens to no credential of this agent"), match
    return (grpc.StatusCode.PERMISSION_DENIED, f"{name} takes {wanted}, not {held}"), match


class TokenAuthInterceptor(aio.ServerInterceptor):
    """Checks every call against `tokens`, the same RoleTokens the agent's KV data port checks with, and
    counts it with `observer` (accepted by credential, refused by reason)."""

    def __init__(self, tokens: RoleTokens, observer: AuthObserver | None = None):
        self._tokens = tokens
        self._observer = observer

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        refused, match = authorize(self._tokens, handler_call_details.method,
                                   handler_call_details.invocation_metadata)
        if self._observer is not None:
            if refused is None:
                self._observer.observe_accepted(GRPC, match.role, match.credential)
            else:
                reason = UNAUTHENTICATED if refused[0] == grpc.StatusCode.UNAUTHENTICATED else PERMISSION_DENIED
                self._observer.observe_refused(GRPC, reason)
        if refused is None:
            if self._observer is not None and handler.request_streaming and handler.response_streaming:
                return _counting_opens(handler, self._observer, match)
            return handler
        return _rejecting_handler(handler, *refused)


def _counting_opens(handler: grpc.RpcMethodHandler, observer: AuthObserver, match: TokenMatch) -> grpc.RpcMethodHandler:
    """Session's handler, counting each request the stream opens as an accepted call, as its own Generate or
    Decode call was: a token still used over one long-lived session keeps its count growing (rotations)."""
    serve = handler.stream_stream

    async def counted(requests):
        async for message in requests:
            for _ in message.open:
                observer.observe_accepted(GRPC, match.role, match.credential)
            yield message

    async def session(requests, context: aio.ServicerContext):
        await serve(counted(requests), context)

    return grpc.stream_stream_rpc_method_handler(session, handler.request_deserializer, handler.response_serializer)
