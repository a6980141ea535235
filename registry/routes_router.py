"""The routers' API (router token): the site snapshot with ETag revalidation, API-key lookup, the
placements routers report for the dashboard, and fleet reports (usage, rate-limit charges; answered
with the router's grants)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from registry.api_models import ApiKeyLookupBody, FleetReportBody, PlacementsBody
from registry.app_state import CredentialFirstRoute, RegistryService, registry, router_caller
from registry.http_errors import ApiError
from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE

router = APIRouter(prefix="/v1/router", tags=["router"], dependencies=[Depends(router_caller)],
                   route_class=CredentialFirstRoute)


@router.get("/snapshot")
async def snapshot(request: Request, svc: RegistryService = Depends(registry)) -> Response:
    """Every site with its latest capacity and liveness; 304 when If-None-Match holds the ETag of the
    representation this request selects. Compressed (`Content-Encoding: deflate`) for a client that accepts
    it, as httpx does by default: the body of a large fleet is mostly prefix-cache hashes, about half their
    size compressed. With the hashes packed (registry.wire.PACKED_SNAPSHOT_MEDIA_TYPE) for a client whose
    Accept names that type; any other client (`*/*`, `application/json`, none) gets the JSON as before."""
    deflate = accepts_deflate(request.headers.get("accept-encoding"))
    packed = accepts_packed(request.headers.get("accept"))
    rendered = await run_in_threadpool(svc.snapshots.get, request.headers.get("if-none-match"), deflate, packed)
    headers = {"ETag": rendered.etag, "Cache-Control": "no-cache", "Vary": "Accept, Accept-Encoding"}
    svc.metrics.snapshot_requests.labels("304" if rendered.body is None else "200").inc()
    if rendered.body is None:
        return Response(status_code=304, headers=headers)
    if rendered.encoding is not None:
        headers["Content-Encoding"] = rendered.encoding
    media_type = PACKED_SNAPSHOT_MEDIA_TYPE if rendered.packed else "application/json"
    return Response(rendered.body, media_type=media_type, headers=headers)


def accepts_deflate(accept_encoding: str | None) -> bool:
    """Whether an Accept-Encoding header accepts `deflate` (by name or `*`, with a q-value above 0)."""
    accepted = _weights(accept_encoding)
    return accepted.get("deflate", accepted.get("*", 0.0)) > 0.0


def accepts_packed(accept: str | None) -> bool:
    """Whether an Accept header prefers the packed snapshot to the JSON one: it must name the packed type
    (a wildcard does not, so a generic client keeps the JSON), with a q-value above 0 and at least the JSON's."""
    accepted = _weights(accept)
    packed = accepted.get(PACKED_SNAPSHOT_MEDIA_TYPE, 0.0)
    json_q = max(accepted.get("application/json", 0.0), accepted.get("application/*", 0.0), accepted.get("*/*", 0.0))
    return packed > 0.0 and packed >= json_q


def _weights(header: str | None) -> dict[str, float]:
    """The q-value of each item of an Accept or Accept-Encoding header, by its lower-cased name (a media
    type's other parameters are dropped)."""
    accepted = {}
    for item in (header or "").split(","):
        name, _, params = item.partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0  # a malformed weight: not an acceptance
        if name.strip():
            accepted[name.strip().lower()] = q
    return accepted


@router.post("/api-keys/lookup")
def lookup_api_key(body: ApiKeyLookupBody, svc: RegistryService = Depends(registry)) -> dict:
    """The key's limits and allowed regions; 404 for an unknown or revoked key."""
    key = svc.store.access.lookup_api_key(body.key)
    if key is None:
        raise ApiError(404, "unknown or revoked API key", "api_key_not_found")
    return key.to_json()


@router.post("/placements")
def report_placements(body: PlacementsBody, svc: RegistryService = Depends(registry)) -> dict:
    """Requests placed per (prefill site, decode site) since the router's last report; they add up
    across routers. Pairs naming unknown sites are dropped (a site deleted meanwhile)."""
    svc.metrics.placement_reports.inc()
    return {"stored": svc.store.placements.record(body.records())}


@router.post("/reports")
def fleet_report(body: FleetReportBody, svc: RegistryService = Depends(registry)) -> dict:
    """Applies the report once (a resent `seq` adds nothing) and answers with the router's grant per key in
    `demand` (registry/allowance.py)."""
    result = svc.store.fleet.apply_report(body.report())
    svc.metrics.fleet_reports.labels("applied" if result.applied else "resent").inc()
    return result.to_json()
