"""The operator's admin API (admin token): sites, their state, roles and models, site tokens,
API keys, the audit log, per-key usage and the routers reporting it. Every change is audited by the
store in the same transaction.
"""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from registry.api_models import (UNFIT_TEXT, ApiKeyBody, DrainBody, ModelsBody, RolesBody, SiteBody, SiteCreateBody,
                                 SitePatchBody, SiteTokenBody)
from registry.app_state import CredentialFirstRoute, RegistryService, admin_actor, registry
from registry.errors import InvalidInput
from registry.fleet import USAGE_COUNTS, UsageQuery
from registry.http_errors import ApiError, status_of
from registry.placements import MAX_WINDOW_S
from registry.records import Page, Site
from registry.validate import MAX_ID
from registry.wire import role_offer

MAX_EPOCH_S = 2**40   # far past any usage row; keeps the query's bounds within a 64-bit column


class AdminRoute(CredentialFirstRoute):
    """Counts every admin call by action (the handler's name) and status (registry.metrics).

    A body sent as another media type (curl's `-d` alone says application/x-www-form-urlencoded) is
    never parsed as JSON; its refusal says to send `Content-Type: application/json`, not that a
    JSON object is missing."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        action = self.name

        async def counted(request: Request):
            counter = request.app.state.registry.metrics.admin_actions
            try:
                try:
                    response = await handler(request)
                except RequestValidationError as exc:
                    raise _not_json(request) or exc from None
            except Exception as exc:
                counter.labels(action, str(status_of(exc))).inc()
                raise
            counter.labels(action, str(response.status_code)).inc()
            return response

        return counted


def _not_json(request: Request) -> ApiError | None:
    """A 415 for a body whose Content-Type is neither absent nor JSON; None otherwise."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if not media_type or media_type == "application/json" or media_type.endswith("+json"):
        return None
    return ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                         f"Content-Type {media_type!r} (curl: add -H 'Content-Type: application/json')",
                    "unsupported_media_type")


router = APIRouter(prefix="/v1/admin", tags=["admin"], route_class=AdminRoute)

Limit = Query(100, ge=1, le=1000, description="page size")
Cursor = Query(None, description="next_cursor from the previous page")
KeyId = Path(ge=1, le=MAX_ID, description="the API key's id")


def _page(page: Page, to_json=lambda item: item.to_json()) -> dict:
    return {"items": [to_json(item) for item in page.items], "next_cursor": page.next_cursor}


def _site_json(site: Site) -> dict:
    """A site as the admin API shows it: with its `role_offer`, as the routers' snapshot has it."""
    offer = role_offer(site.roles, ((m.model, m.role) for m in site.models), site.active_role)
    return {**site.to_json(), "role_offer": offer.to_json()}


@router.post("/sites", status_code=201)
def create_site(body: SiteCreateBody, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    return _site_json(svc.store.sites.create(body.name, body.spec(), actor))


@router.get("/sites")
def list_sites(limit: int = Limit, cursor: str | None = Cursor, _: str = Depends(admin_actor),
               svc: RegistryService = Depends(registry)) -> dict:
    return _page(svc.store.sites.list(limit, cursor), _site_json)


@router.get("/snapshot")
async def snapshot(_: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> Response:
    """The routers' snapshot (sites with capacity and liveness), for operators' status views."""
    rendered = await run_in_threadpool(svc.snapshots.get, None)
    return Response(rendered.body, media_type="application/json")


@router.get("/placements")
def placements(window_s: float = Query(300.0, gt=0, le=MAX_WINDOW_S, description="how far back, in seconds"),
               _: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """Requests the routers placed per (prefill site, decode site) pair in the last window_s seconds."""
    pairs = svc.store.placements.recent(window_s)
    return {"window_s": window_s, "pairs": [pair.to_json() for pair in pairs]}


@router.get("/sites/{name}")
def get_site(name: str, _: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    return _site_json(svc.store.sites.get(name))


@router.put("/sites/{name}")
def put_site(name: str, body: SiteBody, response: Response, actor: str = Depends(admin_actor),
             svc: RegistryService = Depends(registry)) -> dict:
    """Creates the site or replaces its descriptive fields (not its state); repeating it changes nothing."""
    site, created = svc.store.sites.put(name, body.spec(), actor)
    response.status_code = 201 if created else 200
    return _site_json(site)


@router.patch("/sites/{name}")
def update_site(name: str, body: SitePatchBody, actor: str = Depends(admin_actor),
                svc: RegistryService = Depends(registry)) -> dict:
    return _site_json(svc.store.sites.update(name, body.changes(), actor))


@router.delete("/sites/{name}", status_code=204)
def delete_site(name: str, force: bool = Query(False, description="delete even an active site whose agent is "
                                                                  "heartbeating (its token goes with it)"),
                actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> Response:
    """Deletes the site and its tokens. A 409 for an active site with a fresh heartbeat: cordon or drain
    it first, wait until its heartbeat is stale, or pass force=true."""
    svc.store.sites.delete(name, actor, force)
    svc.auth.forget_site_tokens()
    return Response(status_code=204)


@router.post("/sites/{name}/cordon")
def cordon(name: str, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """No new requests go to the site; requests in flight finish."""
    return _site_json(svc.store.sites.cordon(name, actor))


@router.post("/sites/{name}/uncordon")
def uncordon(name: str, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """Back to active. A 409 for a draining site whose agent still heartbeats (it exits once drained):
    uncordon it after the agent has stopped, before starting it again. Repeating it changes nothing."""
    return _site_json(svc.store.sites.uncordon(name, actor))


@router.post("/sites/{name}/drain")
def drain(name: str, body: DrainBody, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """Like cordon, and the agent is told to finish its requests within deadline_s seconds."""
    return _site_json(svc.store.sites.drain(name, body.deadline_s, actor))


@router.put("/sites/{name}/roles")
def set_roles(name: str, body: RolesBody, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """The roles the site may take. They bound the pool planner: roles that no longer offer both drop
    its pick (`active_role`) in the same change, audited."""
    return _site_json(svc.store.sites.set_roles(name, body.roles, actor))


@router.put("/sites/{name}/models")
def set_models(name: str, body: ModelsBody, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    return _site_json(svc.store.sites.set_models(name, [m.record() for m in body.models], actor))


@router.post("/sites/{name}/tokens", status_code=201)
def issue_site_token(name: str, body: SiteTokenBody | None = None, actor: str = Depends(admin_actor),
                     svc: RegistryService = Depends(registry)) -> dict:
    """A new agent token for the site, shown only in this response. revoke_previous=true rotates."""
    revoke_previous = body.revoke_previous if body is not None else False
    token = svc.store.access.issue_site_token(name, actor, revoke_previous)
    if revoke_previous:
        svc.auth.forget_site_tokens()
    return {"site": name, "token": token, "revoked_previous": revoke_previous}


@router.post("/api-keys", status_code=201)
def create_api_key(body: ApiKeyBody, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """The new key's secret is in `key`, shown only in this response."""
    key, secret = svc.store.access.create_api_key(body.spec(), actor)
    return {**key.to_json(), "key": secret}


@router.get("/api-keys")
def list_api_keys(limit: int = Limit, cursor: str | None = Cursor, _: str = Depends(admin_actor),
                  svc: RegistryService = Depends(registry)) -> dict:
    return _page(svc.store.access.list_api_keys(limit, cursor))


@router.get("/api-keys/{key_id}")
def get_api_key(key_id: int = KeyId, _: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    return svc.store.access.get_api_key(key_id).to_json()


@router.post("/api-keys/{key_id}/revoke")
def revoke_api_key(key_id: int = KeyId, actor: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    return svc.store.access.revoke_api_key(key_id, actor).to_json()


@router.get("/audit-log")
def audit_log(limit: int = Limit, cursor: str | None = Cursor, _: str = Depends(admin_actor),
              svc: RegistryService = Depends(registry)) -> dict:
    """Newest first."""
    return _page(svc.store.audit.list(limit, cursor))


@router.get("/usage")
def usage(key: int | None = Query(None, ge=1, le=MAX_ID, description="an API key's id (default: every key)"),
          model: str | None = Query(None, max_length=200, description="a model id (default: every model)"),
          start: str | None = Query(None, alias="from", description="epoch seconds or ISO 8601 (UTC unless it "
                                                                    "says otherwise); hours starting at or after it"),
          end: str | None = Query(None, alias="to", description="epoch seconds or ISO 8601; hours starting before it"),
          granularity: str = Query("hour", description="hour | day (UTC) | total"),
          _: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """Requests and tokens served per key and model, as clients saw them in `usage`, by hour, day or in total."""
    if model is not None and UNFIT_TEXT.search(model):
        raise InvalidInput("model: must be text without control characters", "invalid_field")
    query = UsageQuery(key, model, _instant(start, "from"), _instant(end, "to"), granularity)
    rows = [row.to_json() for row in svc.store.fleet.usage(query)]
    totals = {c: sum(row[c] for row in rows) for c in (*USAGE_COUNTS, "total_tokens")}
    return {"granularity": granularity, "from": query.start, "to": query.end, "items": rows, "totals": totals}


@router.get("/routers")
def routers(_: str = Depends(admin_actor), svc: RegistryService = Depends(registry)) -> dict:
    """Router processes that report usage, with their last report; `live` ones share keys' limits."""
    return {"items": [r.to_json() for r in svc.store.fleet.routers()]}


def _instant(text: str | None, name: str) -> float | None:
    """Epoch seconds from epoch seconds or an ISO 8601 time (UTC unless it says otherwise)."""
    if text is None or not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text.strip())
        except ValueError:
            raise InvalidInput(f"{name}: {text!r} is neither epoch seconds nor an ISO 8601 time "
                               f"(e.g. 2026-11-23T10:00:00Z)", "invalid_time") from None
        value = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    if not 0 <= value <= MAX_EPOCH_S:   # NaN fails this too
        raise InvalidInput(f"{name}: {text!r} is out of range (epoch seconds from 0 to {MAX_EPOCH_S})", "invalid_time")
    return value
