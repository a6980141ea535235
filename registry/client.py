"""The registry's Python client, used by agents (site token), routers (router token) and
operators (admin token).

    async with RegistryClient("http://registry:8500", token) as registry:
        await registry.heartbeat({"kv_blocks_total": 4096, "kv_blocks_free": 1024, "block_size": 16})
        snapshot, etag = await registry.snapshot(etag)   # (None, etag) when unchanged

`SyncRegistryClient` has the same methods, blocking, for the command line. Every operation is
written once below (`RegistryOperations`); each client supplies only how a request is sent.
A 4xx/5xx answer raises RegistryError; connection failures surface as httpx exceptions so the
caller can retry with backoff. Over HTTPS, `verify` checks the registry's certificate: an
`ssl.SSLContext` loaded with the deployment's CA bundle, or True for the system roots.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

DEFAULT_TIMEOUT_S = 5.0


class RegistryError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(f"registry answered {status}: {message}")
        self.status = status
        self.message = message
        self.code = code


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message, code = response.text or response.reason_phrase, None
    try:
        error = response.json()["error"]
        message, code = error["message"], error.get("code")
    except (ValueError, KeyError, TypeError):
        pass  # not our JSON error body (e.g. a proxy's page): keep the raw text
    raise RegistryError(response.status_code, message, code)


def _json(response: httpx.Response) -> Any:
    _raise_for_error(response)
    return None if response.status_code == 204 else response.json()


def _snapshot(etag: str | None):
    def decode(response: httpx.Response) -> tuple[dict | None, str | None]:
        if response.status_code == 304:
            return None, response.headers.get("etag", etag)
        _raise_for_error(response)
        return response.json(), response.headers.get("etag")
    return decode


def _found_or_none(response: httpx.Response) -> dict | None:
    if response.status_code == 404:
        return None
    return _json(response)


def _headers(token: str, actor: str | None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if actor:
        headers["X-Edgefire-Actor"] = actor
    return headers


def _drop_none(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


class RegistryOperations:
    """The registry API, one method per operation. `_call` returns an awaitable in the async client."""

    def _call(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              headers: dict | None = None, decode=_json):
        raise NotImplementedError

    # Agent (site token).
    def register_site(self, name: str, grpc_address: str, models: list[dict], heartbeat_interval_s: float = 2.0,
                      region: str | None = None, country: str | None = None, lat: float | None = None,
                      lon: float | None = None):
        body = _drop_none({"name": name, "grpc_address": grpc_address, "models": models,
                           "heartbeat_interval_s": heartbeat_interval_s, "region": region, "country": country,
                           "lat": lat, "lon": lon})
        return self._call("PUT", "/v1/agent/registration", json=body)

    def heartbeat(self, capacity: dict):
        """Returns {"state", "drain_deadline"}: what the operator wants of this site."""
        return self._call("POST", "/v1/agent/heartbeat", json=capacity)

    def post_links(self, links: list[dict]):
        """links: [{"peer", "rtt_ms", "bandwidth_mbps"}], this site's measurements of its paths."""
        return self._call("POST", "/v1/agent/links", json={"links": links})

    def peers(self):
        """{"peers": [{"name", "grpc_address"}]}: live sites serving one of this site's models."""
        return self._call("GET", "/v1/agent/peers")

    def deregister(self):
        return self._call("DELETE", "/v1/agent/registration")

    # Router (router token).
    def snapshot(self, etag: str | None = None):
        """(snapshot, etag), or (None, etag) when `etag` is still current."""
        headers = {"If-None-Match": etag} if etag else None
        return self._call("GET", "/v1/router/snapshot", headers=headers, decode=_snapshot(etag))

    def lookup_api_key(self, key: str):
        """{"id", "name", "allowed_regions", "requests_per_minute", "tokens_per_minute", ...} or None."""
        return self._call("POST", "/v1/router/api-keys/lookup", json={"key": key}, decode=_found_or_none)

    # Operator (admin token).
    def create_site(self, name: str, **fields):
        return self._call("POST", "/v1/admin/sites", json={"name": name, **fields})

    def put_site(self, name: str, **fields):
        return self._call("PUT", f"/v1/admin/sites/{name}", json=fields)

    def list_sites(self, limit: int = 100, cursor: str | None = None):
        return self._call("GET", "/v1/admin/sites", params=_drop_none({"limit": limit, "cursor": cursor}))

    def admin_snapshot(self):
        """Every site with its latest capacity and liveness (the routers' snapshot) for status views."""
        return self._call("GET", "/v1/admin/snapshot")

    def get_site(self, name: str):
        return self._call("GET", f"/v1/admin/sites/{name}")

    def update_site(self, name: str, **changes):
        return self._call("PATCH", f"/v1/admin/sites/{name}", json=changes)

    def delete_site(self, name: str):
        return self._call("DELETE", f"/v1/admin/sites/{name}")

    def cordon(self, name: str):
        return self._call("POST", f"/v1/admin/sites/{name}/cordon")

    def uncordon(self, name: str):
        return self._call("POST", f"/v1/admin/sites/{name}/uncordon")

    def drain(self, name: str, deadline_s: float):
        return self._call("POST", f"/v1/admin/sites/{name}/drain", json={"deadline_s": deadline_s})

    def set_roles(self, name: str, roles: list[str]):
        return self._call("PUT", f"/v1/admin/sites/{name}/roles", json={"roles": roles})

    def set_models(self, name: str, models: list[dict]):
        return self._call("PUT", f"/v1/admin/sites/{name}/models", json={"models": models})

    def issue_site_token(self, name: str, revoke_previous: bool = False):
        """{"site", "token", "revoked_previous"}; the token is shown only here."""
        return self._call("POST", f"/v1/admin/sites/{name}/tokens", json={"revoke_previous": revoke_previous})

    def rotate_site_token(self, name: str):
        return self.issue_site_token(name, revoke_previous=True)

    def create_api_key(self, name: str, allowed_regions: list[str] | None = None,
                       requests_per_minute: int | None = None, tokens_per_minute: int | None = None):
        """The key record plus its secret in "key", shown only here."""
        body = {"name": name, "allowed_regions": list(allowed_regions or []),
                "requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute}
        return self._call("POST", "/v1/admin/api-keys", json=body)

    def list_api_keys(self, limit: int = 100, cursor: str | None = None):
        return self._call("GET", "/v1/admin/api-keys", params=_drop_none({"limit": limit, "cursor": cursor}))

    def get_api_key(self, key_id: int):
        return self._call("GET", f"/v1/admin/api-keys/{key_id}")

    def revoke_api_key(self, key_id: int):
        return self._call("POST", f"/v1/admin/api-keys/{key_id}/revoke")

    def audit_log(self, limit: int = 100, cursor: str | None = None):
        return self._call("GET", "/v1/admin/audit-log", params=_drop_none({"limit": limit, "cursor": cursor}))


class RegistryClient(RegistryOperations):
    """Async client (httpx.AsyncClient); every operation is awaited."""

    def __init__(self, base_url: str, token: str, timeout: float = DEFAULT_TIMEOUT_S, *, actor: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, verify: ssl.SSLContext | bool = True) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(token, actor), timeout=timeout,
                                       transport=transport, verify=verify)

    async def _call(self, method, path, *, json=None, params=None, headers=None, decode=_json):
        response = await self._http.request(method, path, json=json, params=params, headers=headers)
        return decode(response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.aclose()


class SyncRegistryClient(RegistryOperations):
    """Blocking client (httpx.Client) with the same operations, for the command line."""

    def __init__(self, base_url: str, token: str, timeout: float = DEFAULT_TIMEOUT_S, *, actor: str | None = None,
                 transport: httpx.BaseTransport | None = None, verify: ssl.SSLContext | bool = True) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(token, actor), timeout=timeout,
                                  transport=transport, verify=verify)

    def _call(self, method, path, *, json=None, params=None, headers=None, decode=_json):
        return decode(self._http.request(method, path, json=json, params=params, headers=headers))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncRegistryClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
