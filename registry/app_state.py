"""What the HTTP handlers share (store, auth, heartbeat batcher, snapshot cache) and the FastAPI
dependencies that hand it to them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import Request

from registry.access import SiteIdentity
from registry.auth import Authenticator
from registry.heartbeat_batcher import HeartbeatBatcher
from registry.log_limit import LogLimiter
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


async def registry(request: Request) -> RegistryService:
    # async: a plain def dependency would cost a thread-pool hop on every heartbeat
    return request.app.state.registry


async def admin_actor(request: Request) -> str:
    return await request.app.state.registry.auth.admin(request)


async def router_caller(request: Request) -> None:
    await request.app.state.registry.auth.router(request)


async def site_caller(request: Request) -> SiteIdentity:
    return await request.app.state.registry.auth.site(request)
