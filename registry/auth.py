"""Who may call what: the admin and router tokens given at start-up, and per-site agent tokens.

Missing or unknown tokens get 401; a valid token of the wrong kind gets 403. Site tokens are
cached for a few seconds so a heartbeat costs no database read; a token revoked on another
registry replica therefore stops working within SITE_TOKEN_CACHE_S (at once on this one).
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

SITE_TOKEN_CACHE_S = 5.0
MAX_CACHED_TOKENS = 100_000
ACTOR = re.compile(r"[\w.@:+-]{1,100}")


class Authenticator:
    def __init__(self, access: AccessStore, admin_token: str, router_token: str) -> None:
        if not admin_token or not router_token:
            raise ValueError("the registry needs both an admin token and a router token")
        self._access = access
        self._admin_token = admin_token
        self._router_token = router_token
        self._site_tokens: dict[str, tuple[SiteIdentity, float]] = {}
        self._lookups: dict[str, asyncio.Future] = {}  # tokens waiting for the next batched query
        self._lookup_task: asyncio.Task | None = None

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

    async def router(self, request: Request) -> None:
        token = _bearer(request)
        if not same_secret(token, self._router_token):
            await self._refuse(token, "the router API")

    async def site(self, request: Request) -> SiteIdentity:
        return await self.site_for_header(request.headers.get("authorization"))

    async def site_for_header(self, authorization: str | None) -> SiteIdentity:
        """`site` for a raw Authorization header value (the heartbeat fast path has no Request)."""
        token = _token(authorization)
        identity = await self._site_identity(token)
        if identity is None:
            await self._refuse(token, "the agent API", site_checked=True)
        return identity

    def forget_site_tokens(self) -> None:
        """After a rotation or site deletion on this replica: stop honouring cached tokens at once."""
        self._site_tokens.clear()

    async def _site_identity(self, token: str) -> SiteIdentity | None:
        cached = self._site_tokens.get(token)
        now = time.monotonic()
        if cached is not None and cached[1] > now:
            return cached[0]
        identity = await self._lookup(token)
        if identity is not None:
            if len(self._site_tokens) >= MAX_CACHED_TOKENS:
                self._site_tokens.clear()
            self._site_tokens[token] = (identity, now + SITE_TOKEN_CACHE_S)
        return identity

    async def _lookup(self, token: str) -> SiteIdentity | None:
        """Database lookups in batches: with thousands of sites, cache entries expire every few
        milliseconds, and one query per batch costs far less than a thread hop per heartbeat."""
        waiting = self._lookups.get(token)
        if waiting is None:
            waiting = self._lookups[token] = asyncio.get_running_loop().create_future()
            if self._lookup_task is None or self._lookup_task.done():
                self._lookup_task = asyncio.create_task(self._run_lookups())
        return await asyncio.shield(waiting)  # a caller that goes away must not cancel the others' lookup

    async def _run_lookups(self) -> None:
        while self._lookups:
            batch, self._lookups = self._lookups, {}
            try:
                found = await run_in_threadpool(self._access.sites_for_tokens, list(batch))
            except Exception as exc:  # every waiter gets the error (a database outage is a 503)
                for waiting in batch.values():
                    if not waiting.done():
                        waiting.set_exception(exc)
                continue
            for token, waiting in batch.items():
                if not waiting.done():
                    waiting.set_result(found.get(token))

    async def _refuse(self, token: str, api: str, site_checked: bool = False) -> None:
        known = same_secret(token, self._admin_token) or same_secret(token, self._router_token)
        if not known and not site_checked:
            known = await self._site_identity(token) is not None
        if known:
            raise ApiError(403, f"this token cannot use {api}", "wrong_token_kind")
        raise ApiError(401, "invalid bearer token", "invalid_token", {"WWW-Authenticate": "Bearer"})


def _bearer(request: Request) -> str:
    return _token(request.headers.get("authorization"))


def _token(header: str | None) -> str:
    if header is None:
        raise ApiError(401, "missing 'Authorization: Bearer <token>' header", "missing_token", {"WWW-Authenticate": "Bearer"})
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "the Authorization header must be 'Bearer <token>'", "missing_token", {"WWW-Authenticate": "Bearer"})
    return token.strip()
