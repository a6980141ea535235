"""The agents' API (per-site token): registration, heartbeats, link measurements and the peers to
measure, deregistration."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool

from registry.access import SiteIdentity
from registry.api_models import LinksBody, RegistrationBody
from registry.app_state import CredentialFirstRoute, RegistryService, registry, site_caller
from registry.auth import authorization_header
from registry.errors import InvalidInput, NotFound
from registry.http_errors import ApiError, validation_problem
from registry.telemetry import HeartbeatWrite, capacity_row
from registry.wire import CapacityReport

router = APIRouter(prefix="/v1/agent", tags=["agent"], route_class=CredentialFirstRoute)

# The heartbeat's body is read by the fast path, not by FastAPI, so its schemas (the wire contract's
# models) are described here and added to the spec's components (RegistryApp.openapi).
_REFS, _SCHEMAS = models_json_schema([(CapacityReport, "validation")], ref_template="#/components/schemas/{model}")
HEARTBEAT_SCHEMAS: dict = _SCHEMAS["$defs"]
HEARTBEAT_OPENAPI = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _REFS[(CapacityReport, "validation")]}}}}


@router.put("/registration")
async def register(request: Request, body: RegistrationBody, site: SiteIdentity = Depends(site_caller),
                   svc: RegistryService = Depends(registry)) -> dict:
    if body.name is not None and body.name != site.name:
        raise ApiError(403, f"this token belongs to site {site.name!r}, not {body.name!r}", "wrong_site")
    try:
        # by the site the token resolved to, not by its name alone: another may hold the name by now
        updated = await run_in_threadpool(svc.store.sites.update, site.name, body.changes(), f"site:{site.name}",
                                          "site.register", site.site_id)
    except NotFound:
        raise await svc.auth.gone_site(authorization_header(request.scope["headers"]), site) from None
    return updated.to_json()


@router.delete("/registration")
def deregister(site: SiteIdentity = Depends(site_caller), svc: RegistryService = Depends(registry)) -> Response:
    svc.store.telemetry.clear_capacity(site.site_id)
    return Response(status_code=204)


@router.post("/heartbeat", openapi_extra=HEARTBEAT_OPENAPI)
async def heartbeat(request: Request) -> Response:
    """Stores the site's capacity; answers with the operator's intent (state, drain deadline).

    Served by registry.heartbeat_endpoint in front of FastAPI; this route documents the endpoint
    and serves paths the fast path leaves to FastAPI (it answers the same way).
    """
    reply = await store_heartbeat(request.app.state.registry, authorization_header(request.scope["headers"]),
                                  await request.body())
    return Response(reply, media_type="application/json")


async def store_heartbeat(svc: RegistryService, authorization: str | None, body: bytes) -> bytes:
    """The heartbeat itself, without HTTP: checks the token and the body (the wire contract), waits
    for the group commit that stores it and returns the JSON answer. Raises what the error handlers
    turn into 4xx/5xx; each rejection is logged in one line, at most one per site per interval.
    Counted by outcome, with its latency (registry.metrics)."""
    metrics, started = svc.metrics, time.perf_counter()
    try:
        reply = await _store_heartbeat(svc, authorization, body)
    except OperationalError:
        metrics.heartbeats.labels("failed").inc()
        raise
    except Exception:
        metrics.heartbeats.labels("rejected").inc()
        raise
    metrics.heartbeats.labels("stored").inc()
    metrics.heartbeat_latency.observe(time.perf_counter() - started)
    return reply


async def _store_heartbeat(svc: RegistryService, authorization: str | None, body: bytes) -> bytes:
    site = await svc.auth.site_for_header(authorization)
    try:
        report = CapacityReport.model_validate_json(body)
    except ValidationError as exc:
        error = RequestValidationError(exc.errors(include_url=False))
        _log_rejection(svc, site, validation_problem(error.errors())[1])
        raise error from exc
    try:
        status = await svc.batcher.submit(capacity_row(HeartbeatWrite(site.site_id, report, svc.store.telemetry.now())))
    except InvalidInput as exc:
        _log_rejection(svc, site, exc.message)
        raise
    if status is None:  # deleted since its token was checked (this replica's token cache)
        raise await svc.auth.gone_site(authorization, site)
    return json.dumps(status.to_json()).encode()


def _log_rejection(svc: RegistryService, site: SiteIdentity, reason: str) -> None:
    svc.rejections.warning(site.name, "heartbeat from site %s rejected: %s", site.name, reason)


@router.post("/links")
async def post_links(request: Request, body: LinksBody, site: SiteIdentity = Depends(site_caller),
                     svc: RegistryService = Depends(registry)) -> dict:
    try:
        stored = await run_in_threadpool(svc.store.telemetry.record_links, site.site_id, body.records())
    except NotFound:
        raise await svc.auth.gone_site(authorization_header(request.scope["headers"]), site) from None
    return {"stored": stored}


@router.get("/peers")
def peers(site: SiteIdentity = Depends(site_caller), svc: RegistryService = Depends(registry)) -> dict:
    """The live, active sites serving one of the caller's models: whose paths its agent measures."""
    return {"peers": [{"name": name, "grpc_address": address} for name, address in svc.store.sites.peers(site.site_id)]}
