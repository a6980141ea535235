"""Who may call what: the admin, router and (optional) metrics tokens given at start-up, and
per-site agent tokens. The metrics token only scrapes `/metrics` (the admin token may too). The
tokens given at start-up must differ, or one role's token would carry another's rights.

Missing or unknown tokens get 401, and so does a request with two Authorization headers, whichever
holds the token: which one a hop in between added is not knowable (the agents refuse two
`authorization` metadata entries alike). A valid token of the wrong kind gets 403. A token of a
deleted site (registry.tombstones) gets 410 `site_deleted` on the agent API, naming the site, when and
by whom it was deleted, so that its agent stops instead of retrying a token it cannot tell from a
mistyped one. Site tokens are cached for a few seconds so a heartbeat costs no database read; a token revoked on another
registry replica therefore stops working within SITE_TOKEN_CACHE_S (at once on this one). A token
used in the last SITE_TOKEN_REFRESH_S of its cache entry is re-checked in the background, many in
one query, so agents heartbeating steadily never wait for a database read.
"""

from __future__ import annotations

import asyncio
import re
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from registry.access import AccessStore, SiteIdentity
from registry.credentials import same_secret
from registry.http_errors import ApiError
from registry.http_head import RepeatedHeader, single_header
from registry.tombstones import DeletedSite

SITE_TOKEN_CACHE_S = 5.0
SITE_TOKEN_REFRESH_S = 1.5
REFRESH_WINDOW_S = 0.1  # background re-checks gather this long into one query
MAX_CACHED_TOKENS = 100_000
ACTOR = re.compile(r"[\w.@:+-]{1,100}")


class Authenticator:
    def __init__(self, access: AccessStore, admin_token: str, router_token: str, metrics_token: str | None = None) -> None:
        if not admin_token or not router_token:
            raise ValueError("the registry needs both an admin token and a router token")
        check_distinct_tokens(admin_token, router_token, metrics_token or None)
        self._access = access
        self._admin_token = admin_token
        self._router_token = router_token
        self._metrics_token = metrics_token or None
        self._site_tokens: dict[str, tuple[SiteIdentity, float]] = {}
        self._lookups: dict[str, asyncio.Future] = {}  # tokens waiting for the next batched query
        self._lookup_task: asyncio.Task | None = None
        self._refreshes: set[str] = set()  # cached tokens to re-check after REFRESH_WINDOW_S
        self._refresh_task: asyncio.Task | None = None
        self._generation = 0  # moves when cached tokens are forgotten; older lookups must not re-add them

    async def admin(self, request: Request) -> str:
        """Returns the actor recorded in the audit log: 'admin', or 'admin:<X-Edgefire-Actor>'."""
        token = _bearer(request)
        if not same_secret(token, self._admin_token):
            await self._refuse(token, "the admin API")
        named = request.headers.get("x-edgefire-actor")
        if named is None:
            return "admin"
        if not ACTOR.fullmatch(named):
            raise ApiError(400, "X-Edgefire-Actor must be 1-100 characters of letters, digits and ._@:+-", "invalid_actor")
        return f"admin:{named}"

    async def metrics(self, request: Request) -> None:
        """Scrapes: the metrics token (read-only, for Prometheus) or the admin token."""
        token = _bearer(request)
        if not (same_secret(token, self._admin_token)
                or (self._metrics_token is not None and same_secret(token, self._metrics_token))):
            await self._refuse(token, "the metrics endpoint")

    async def router(self, request: Request) -> None:
        token = _bearer(request)
        if not same_secret(token, self._router_token):
            await self._refuse(token, "the router API")

    async def site(self, request: Request) -> SiteIdentity:
        return await self.site_for_header(authorization_header(request.scope["headers"]))

    async def site_for_header(self, authorization: str | None) -> SiteIdentity:
        """`site` for a raw Authorization header value (the heartbeat fast path has no Request)."""
        token = _token(authorization)
        found = await self._site_identity(token)
        if isinstance(found, SiteIdentity):
            return found
        if isinstance(found, DeletedSite):
            raise ApiError(410, found.message(), "site_deleted", fields=found.to_json())
        await self._refuse(token, "the agent API", site_checked=True)

    async def gone_site(self, authorization: str | None, site: SiteIdentity) -> ApiError:
        """The error for a caller whose token resolved to `site` (from this replica's cache) when the site
        turned out to be gone: deleted through another replica within SITE_TOKEN_CACHE_S, and perhaps
        created again under its name. The token is looked up afresh, so a tombstoned one is answered 410
        `site_deleted` at once (its agent stops) rather than a 404 it would retry; nothing of it reaches a
        site created again under the same name."""
        token = _token(authorization)
        cached = self._site_tokens.get(token)
        if cached is not None and cached[0] == site:
            self._site_tokens.pop(token, None)
        found = await asyncio.shield(self._lookup(token))
        if isinstance(found, DeletedSite):
            return ApiError(410, found.message(), "site_deleted", fields=found.to_json())
        return ApiError(404, f"site {site.name!r} no longer exists", "site_not_found")

    def forget_site_tokens(self) -> None:
        """After a rotation or site deletion on this replica: stop honouring cached tokens at once."""
        self._site_tokens.clear()
        self._generation += 1

    async def close(self) -> None:
        """Stops the background re-checks (at shutdown)."""
        for task in (self._refresh_task, self._lookup_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _site_identity(self, token: str) -> SiteIdentity | DeletedSite | None:
        """The token's site; for a token no site holds, the deleted site it belonged to, if any."""
        cached = self._site_tokens.get(token)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            if cached[1] - now < SITE_TOKEN_REFRESH_S:
                self._refresh_later(token)
            return cached[0]
        # a caller that goes away must not cancel the others' lookup
        return await asyncio.shield(self._lookup(token))

    def _refresh_later(self, token: str) -> None:
        self._refreshes.add(token)
        if self._refresh_task is None or self._refresh_task.done():
            self._refresh_task = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        await asyncio.sleep(REFRESH_WINDOW_S)
        tokens, self._refreshes = self._refreshes, set()
        for token in tokens:
            self._lookup(token)  # the lookup updates the cache; nobody waits for it

    def _lookup(self, token: str) -> asyncio.Future:
        """Database lookups in batches: every lookup asked for while one query runs goes into the
        next, so thousands of sites cost a few queries a second, not a thread hop per heartbeat."""
        waiting = self._lookups.get(token)
        if waiting is None:
            waiting = self._lookups[token] = asyncio.get_running_loop().create_future()
            waiting.add_done_callback(_retrieve)
            if self._lookup_task is None or self._lookup_task.done():
                self._lookup_task = asyncio.create_task(self._run_lookups())
        return waiting

    async def _run_lookups(self) -> None:
        while self._lookups:
            batch, self._lookups = self._lookups, {}
            generation, checked_at = self._generation, time.monotonic()
            try:
                found, deleted = await run_in_threadpool(self._find, list(batch))
            except Exception as exc:  # every waiter gets the error (a database outage is a 503)
                for waiting in batch.values():
                    if not waiting.done():
                        waiting.set_exception(exc)
                continue
            if generation == self._generation:
                self._remember(batch, found, checked_at + SITE_TOKEN_CACHE_S)
            for token, waiting in batch.items():
                if not waiting.done():
                    waiting.set_result(found.get(token) or deleted.get(token))

    def _find(self, tokens: list[str]) -> tuple[dict[str, SiteIdentity], dict[str, DeletedSite]]:
        """(the sites of the valid tokens, the deleted sites of the tombstoned ones): tombstones are read
        only for the tokens no site holds, rare beside the steady heartbeats' valid ones."""
        found = self._access.sites_for_tokens(tokens)
        unknown = [token for token in tokens if token not in found]
        return found, self._access.deleted_sites_for_tokens(unknown) if unknown else {}

    def _remember(self, tokens, found: dict[str, SiteIdentity], expires_at: float) -> None:
        for token in tokens:
            identity = found.get(token)
            if identity is None:
                self._site_tokens.pop(token, None)  # revoked (or never valid): refused from now on
                continue
            if token not in self._site_tokens and len(self._site_tokens) >= MAX_CACHED_TOKENS:
                self._site_tokens.clear()
            self._site_tokens[token] = (identity, expires_at)

    async def _refuse(self, token: str, api: str, site_checked: bool = False) -> None:
        known = (same_secret(token, self._admin_token) or same_secret(token, self._router_token)
                 or (self._metrics_token is not None and same_secret(token, self._metrics_token)))
        if not known and not site_checked:
            known = isinstance(await self._site_identity(token), SiteIdentity)
        if known:
            raise ApiError(403, f"this token cannot use {api}", "wrong_token_kind")
        raise ApiError(401, "invalid bearer token", "invalid_token", {"WWW-Authenticate": "Bearer"})


def check_distinct_tokens(admin_token: str, router_token: str, metrics_token: str | None) -> None:
    """A token given to two roles would carry both roles' rights wherever it is kept (a router's
    config, Prometheus'), so each role needs its own."""
    named = [("admin", admin_token), ("router", router_token), ("metrics", metrics_token)]
    for index, (role, token) in enumerate(named):
        for other, other_token in named[index + 1:]:
            if token is not None and other_token is not None and same_secret(token, other_token):
                raise ValueError(f"the {role} token and the {other} token must differ: "
                                 f"each role needs a token of its own")


def _retrieve(future: asyncio.Future) -> None:
    # A background re-check's failure has no waiter; the entry simply expires. Marking the
    # exception retrieved keeps asyncio from logging it as lost.
    if not future.cancelled():
        future.exception()


def authorization_header(raw_headers) -> str | None:
    """The one Authorization header's value in ASGI raw headers (lowercase names), None when absent;
    401 when it is sent more than once. One pass, and nothing allocated beyond the value's text,
    since the heartbeat fast path calls this on every heartbeat."""
    try:
        return single_header(raw_headers, b"authorization")
    except RepeatedHeader:
        raise ApiError(401, "send one 'Authorization: Bearer <token>' header, not several",
                       "repeated_authorization", {"WWW-Authenticate": "Bearer"}) from None


def _bearer(request: Request) -> str:
    return _token(authorization_header(request.scope["headers"]))


def _token(header: str | None) -> str:
    if header is None:
        raise ApiError(401, "missing 'Authorization: Bearer <token>' header", "missing_token", {"WWW-Authenticate": "Bearer"})
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "missing_token", {"WWW-Authenticate": "Bearer"})
    return token.strip()
