"""The agents' API (per-site token): registration, heartbeats, link measurements, deregistration."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from registry.access import SiteIdentity
from registry.api_models import HeartbeatBody, LinksBody, RegistrationBody
from registry.app_state import RegistryService, registry, site_caller
from registry.http_errors import ApiError
from registry.telemetry import HeartbeatWrite, capacity_row

router = APIRouter(prefix="/v1/agent", tags=["agent"])


@router.put("/registration")
def register(body: RegistrationBody, site: SiteIdentity = Depends(site_caller),
             svc: RegistryService = Depends(registry)) -> dict:
    if body.name is not None and body.name != site.name:
        raise ApiError(403, f"this token belongs to site {site.name!r}, not {body.name!r}", "wrong_site")
    updated = svc.store.sites.update(site.name, body.changes(), actor=f"site:{site.name}", action="site.register")
    return updated.to_json()


@router.delete("/registration")
def deregister(site: SiteIdentity = Depends(site_caller), svc: RegistryService = Depends(registry)) -> Response:
    svc.store.telemetry.clear_capacity(site.site_id)
    return Response(status_code=204)


@router.post("/heartbeat")
async def heartbeat(body: HeartbeatBody, site: SiteIdentity = Depends(site_caller),
                    svc: RegistryService = Depends(registry)) -> dict:
    """Stores the site's capacity; answers with the operator's intent (state, drain deadline)."""
    row = capacity_row(HeartbeatWrite(site.site_id, body.record(), svc.store.telemetry.now()))
    status = await svc.batcher.submit(row)
    if status is None:
        raise ApiError(404, f"site {site.name!r} no longer exists", "site_not_found")
    return status.to_json()


@router.post("/links")
def post_links(body: LinksBody, site: SiteIdentity = Depends(site_caller),
               svc: RegistryService = Depends(registry)) -> dict:
    return {"stored": svc.store.telemetry.record_links(site.site_id, body.records())}
