"""The registry HTTP service: a FastAPI app over the store, for agents, routers and operators.

    app = create_app("sqlite:///var/edgefire/registry.db", admin_token, router_token)

The handlers are thin (routes_*.py); this module wires them to one RegistryService and owns its
lifetime: the snapshot is built and the heartbeat group-commit loop started before serving, and the
loop stops with the app; so does the pool planner when it is on (`planner=`). Heartbeats, nearly all of the traffic, are answered by heartbeat_endpoint
before FastAPI's middleware and routing (RegistryApp). `GET /metrics` serves Prometheus text to the
metrics or admin token (registry.metrics); `GET /dashboard` the operator's live map (registry.dashboard).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from registry import heartbeat_endpoint, http_errors
from registry.app_state import RegistryService, metrics_caller
from registry.auth import Authenticator
from registry.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from registry.dashboard import router as dashboard_routes
from registry.heartbeat_batcher import HeartbeatBatcher
from registry.metrics import RegistryMetrics
from registry.planner import Planner, PlannerSettings
from registry.routes_admin import router as admin_routes
from registry.routes_agent import HEARTBEAT_SCHEMAS
from registry.routes_agent import router as agent_routes
from registry.routes_router import router as router_routes
from registry.snapshot_cache import SnapshotCache
from registry.store import RegistryStore

log = logging.getLogger(__name__)


def create_app(db_url: str, admin_token: str, router_token: str, *,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, store: RegistryStore | None = None,
               planner: PlannerSettings | None = None, metrics_token: str | None = None) -> FastAPI:
    """The app for an already-migrated database. Pass `store` to share one (tests, a fake clock);
    `planner` runs the prefill/decode pool planner (registry.planner) beside the API;
    `metrics_token` may scrape /metrics (as may the admin token)."""
    store = store or RegistryStore.open(db_url)
    metrics = RegistryMetrics()
    service = RegistryService(
        store=store,
        auth=Authenticator(store.access, admin_token, router_token, metrics_token),
        batcher=HeartbeatBatcher(store.telemetry.write_capacity_rows,
                                 on_commit=metrics.heartbeat_commit_rows.observe),
        snapshots=SnapshotCache(store.engine, clock=store.telemetry.now, metrics=metrics),
        metrics=metrics,
    )
    metrics.follow(service.snapshots)
    store.telemetry.capacity_listeners.append(service.snapshots.capacity_written)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Everything loaded so far (FastAPI, SQLAlchemy, pydantic) lives as long as the process;
        # freezing it keeps the collector from rescanning it on every full collection.
        gc.freeze()
        await _warm_snapshot(service.snapshots)
        service.batcher.start()
        stop_planner = asyncio.Event()
        planner_task = None
        if planner is not None:
            pool_planner = Planner(store, lambda: service.snapshots.get().body, planner, clock=store.telemetry.now)
            planner_task = asyncio.create_task(pool_planner.run(stop_planner), name="planner")
        try:
            yield
        finally:
            stop_planner.set()
            if planner_task is not None:
                await planner_task
            await service.batcher.stop()
            await service.auth.close()
            store.close()

    app = RegistryApp(title="edgefire registry", version="1", lifespan=lifespan,
                      description="Sites, their capacity and liveness; the operator admin API.")
    app.max_body_bytes = max_body_bytes
    app.state.registry = service
    http_errors.install(app)
    app.include_router(agent_routes)
    app.include_router(router_routes)
    app.include_router(admin_routes)
    app.include_router(dashboard_routes)
    app.add_api_route("/healthz", _healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", _metrics, methods=["GET"], include_in_schema=False,
                      dependencies=[Depends(metrics_caller)])
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app


class RegistryApp(FastAPI):
    """FastAPI, except that heartbeats are answered before its middleware and routing (heartbeat_endpoint)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def openapi(self) -> dict:
        if self.openapi_schema is None:
            components = super().openapi().setdefault("components", {}).setdefault("schemas", {})
            components.update(HEARTBEAT_SCHEMAS)
        return self.openapi_schema

    async def __call__(self, scope, receive, send) -> None:
        if heartbeat_endpoint.is_heartbeat(scope):
            scope["app"] = self  # as Starlette would set it: the error handlers find the service through it
            await heartbeat_endpoint.serve(self.state.registry, self.max_body_bytes, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


async def _warm_snapshot(snapshots: SnapshotCache) -> None:
    """Builds the snapshot before serving, so the routers' first GET does not pay for reading and
    encoding every site (~0.5-1 s at 10,000 sites)."""
    try:
        await asyncio.to_thread(snapshots.get)
    except OperationalError as exc:  # the database is down: start anyway; snapshot GETs answer 503 until it is back
        log.warning("could not build the snapshot at start-up: %s", exc.orig)


async def _healthz() -> dict:
    return {"ok": True}


async def _metrics(request: Request) -> Response:
    # off the event loop: the site gauges may read the database
    text = await run_in_threadpool(request.app.state.registry.metrics.render)
    return Response(text, media_type=CONTENT_TYPE_LATEST)
