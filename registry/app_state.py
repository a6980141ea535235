"""What the HTTP handlers share (store, auth, heartbeat batcher, snapshot cache), the FastAPI
dependencies that hand it to them, and `CredentialFirstRoute`, the route class of every API router:
the caller's credential is checked before the request body is read."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from registry.access import SiteIdentity
from registry.auth import Authenticator
from registry.heartbeat_batcher import HeartbeatBatcher
from registry.log_limit import LogLimiter
from registry.metrics import RegistryMetrics
from registry.snapshot_cache import SnapshotCache
from registry.store import RegistryStore


@dataclass(slots=True)
class RegistryService:
    store: RegistryStore
    auth: Authenticator
    batcher: HeartbeatBatcher
    snapshots: SnapshotCache
    # One line per site and interval for rejected heartbeats: a site looping a bad one must not flood the log.
    rejections: LogLimiter = field(default_factory=lambda: LogLimiter(logging.getLogger("registry.heartbeats")))
    metrics: RegistryMetrics = field(default_factory=RegistryMetrics)


async def registry(request: Request) -> RegistryService:
    # async: a plain def dependency would cost a thread-pool hop on every heartbeat
    return request.app.state.registry


async def admin_actor(request: Request) -> str:
    return await _checked_once(request, request.app.state.registry.auth.admin)


async def metrics_caller(request: Request) -> None:
    await request.app.state.registry.auth.metrics(request)


async def router_caller(request: Request) -> None:
    await _checked_once(request, request.app.state.registry.auth.router)


async def site_caller(request: Request) -> SiteIdentity:
    return await _checked_once(request, request.app.state.registry.auth.site)


CALLERS = (admin_actor, router_caller, site_caller)


class CredentialFirstRoute(APIRoute):
    """FastAPI parses a JSON body before it runs any dependency, so an unauthenticated request with
    a malformed body would learn about body parsing (400) instead of getting its 401. This route
    runs the route's credential dependency first; the dependency then reuses the result."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        caller = _caller_of(self.dependant)
        if caller is None:
            return handler

        async def credential_first(request: Request):
            await caller(request)
            return await handler(request)

        return credential_first


def _caller_of(dependant: Dependant):
    for dependency in dependant.dependencies:
        if dependency.call in CALLERS:
            return dependency.call
        found = _caller_of(dependency)
        if found is not None:
            return found
    return None


async def _checked_once(request: Request, check):
    """The credential check's result, computed once per request (CredentialFirstRoute, then the
    route's own dependency); a refusal raises and ends the request."""
    checked = request.scope.setdefault("edgefire.credentials", {})
    if check not in checked:
        checked[check] = await check(request)
    return checked[check]
