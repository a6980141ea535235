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

A snapshot that comes deflated (`Content-Encoding: deflate`, as the registry sends it to a client that
accepts it) is read raw by the async client and inflated together with its JSON parse on a worker
thread: inflating a large fleet's snapshot costs about 12 ms of CPU per poll, which on the event loop
would hold up every stream a router relays. A body that does not inflate raises RegistryError.
`snapshot()` asks for the packed format (registry.wire.PACKED_SNAPSHOT_MEDIA_TYPE), which a registry older
than it answers with the JSON one; the router reads either (registry.wire.SnapshotCacheSummary).

Replicas. The base URL may be several (a list, or one string of comma-separated URLs): registry
replicas over one database, interchangeable for every call. A call goes to the replica that answered
last; when it cannot be reached, or answers 502/503/504 (its database or its proxy is away), the
same call moves on to the next replica at once, and the failed one rests (`Backoff`, doubling from
0.5 s to 30 s) before it is tried first again. Only requests that cannot have been carried out are
sent again where they might have been: a connection that never opened always moves on, a request
cut off after it was sent moves on only for idempotent operations (reads, PUT/DELETE, heartbeats,
fleet reports, which carry their own report id). When every replica fails, the last failure is
raised, as with one URL; the caller backs off.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from registry.retry import Backoff
from registry.wire import PACKED_SNAPSHOT_MEDIA_TYPE

DEFAULT_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 2.0   # a replica that does not accept within this is passed over for the next
FAILOVER_STATUSES = frozenset({502, 503, 504})
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE"})
# Bodies this large (a fleet of hundreds of sites' snapshot runs to about 1 MB) are decoded on a worker
# thread by the asyncio client, not on the event loop the router relays its streams on; a deflated
# snapshot always is (inflating it is the larger part of the work).
THREAD_DECODE_BYTES = 256 << 10
# Errors raised before a request left this process: resending it anywhere is always safe.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class RegistryError(Exception):
    """A 4xx/5xx answer. `fields`: what the error object carries beyond message, type and code (for
    410 `site_deleted`: the deleted site's `site`, `deleted_at` (epoch seconds) and `deleted_by`)."""

    def __init__(self, status: int, message: str, code: str | None = None, fields: dict | None = None) -> None:
        super().__init__(f"registry answered {status}: {message}")
        self.status = status
        self.message = message
        self.code = code
        self.fields = fields or {}


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message, code, fields = response.text or response.reason_phrase, None, None
    try:
        error = response.json()["error"]
        message, code = error["message"], error.get("code")
        fields = {key: value for key, value in error.items() if key not in ("message", "type", "code")}
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not our JSON error body (e.g. a proxy's page): keep the raw text
    raise RegistryError(response.status_code, message, code, fields)


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


def _deflated_snapshot(response: httpx.Response, body: bytes) -> tuple[dict, str | None]:
    """A 200 snapshot answer whose body is still deflated (read raw by RegistryClient), inflated and parsed."""
    return json.loads(_inflate(response, body)), response.headers.get("etag")


def _inflate(response: httpx.Response, body: bytes) -> bytes:
    """A `Content-Encoding: deflate` body: a zlib stream (RFC 1950, what the registry sends), or bare deflate
    data (RFC 1951), which some servers and proxies send under the same name. Unlike httpx's own decoder,
    a stream cut short is refused too: a truncated snapshot must not pass for a whole one."""
    try:
        return zlib.decompress(body)
    except zlib.error as exc:
        try:
            return zlib.decompress(body, -zlib.MAX_WBITS)
        except zlib.error:
            raise RegistryError(response.status_code, f"the body of {response.request.url.path} is not valid "
                                f"deflate data ({exc}; {len(body)} bytes)", "bad_encoding") from exc


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


def registry_urls(urls: str | list[str] | tuple[str, ...]) -> list[str]:
    """The replica URLs of a `registry_url` setting (a URL, a comma-separated string, or a list), checked."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    found = [item.strip().rstrip("/") for item in items if item and item.strip()]
    if not found:
        raise ValueError("no registry URL given; set registry_url to http(s)://host:port (or a list of them)")
    for url in found:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"registry URL {url!r} must start with http:// or https://")
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:  # not a ValueError: it would escape the callers' checks
            raise ValueError(f"registry URL {url!r} is malformed ({exc})") from None
        if not parsed.host or not 1 <= (parsed.port or 80) <= 65535:
            raise ValueError(f"registry URL {url!r} must name a host and a port in 1-65535: http(s)://host:port")
    return list(dict.fromkeys(found))


@dataclass(slots=True)
class _Replica:
    url: str
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=0.5, max_s=30.0))
    rest_until: float = 0.0


class Replicas:
    """Which registry replica to call first, and which rest after failing (see the module docstring)."""

    def __init__(self, urls: str | list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._replicas = [_Replica(url) for url in registry_urls(urls)]
        self._current = 0
        self._clock = clock

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self._replicas]

    @property
    def current(self) -> str:
        return self._replicas[self._current].url

    def attempts(self) -> list[tuple[_Replica, bool]]:
        """(replica, is_last) for one call: every replica once, the current one first, then the rest in
        configured order; resting ones last (soonest back first), so a call still reaches a replica
        when all of them are resting."""
        n = len(self._replicas)
        ring = [self._replicas[(self._current + i) % n] for i in range(n)]
        now = self._clock()
        order = [r for r in ring if r.rest_until <= now] + sorted((r for r in ring if r.rest_until > now),
                                                                   key=lambda r: r.rest_until)
        return [(replica, i == n - 1) for i, replica in enumerate(order)]

    def unreachable(self, replica: _Replica, exc: httpx.TransportError, last: bool, idempotent: bool) -> None:
        """The call could not reach `replica`: rest it; raise `exc` unless the call may go on to the next."""
        self._rest(replica)
        if last or not (isinstance(exc, _NOT_SENT) or idempotent):
            raise exc

    def accept(self, replica: _Replica, response: httpx.Response, last: bool) -> bool:
        """Whether the call ends with `response`; False: the replica is away (502/503/504), try the next."""
        if response.status_code in FAILOVER_STATUSES and not last:
            self._rest(replica)
            return False
        if response.status_code not in FAILOVER_STATUSES:
            replica.backoff.reset()
            replica.rest_until = 0.0
            self._current = self._replicas.index(replica)
        return True

    def _rest(self, replica: _Replica) -> None:
        replica.rest_until = self._clock() + replica.backoff.next_delay()
        if len(self._replicas) > 1 and replica is self._replicas[self._current]:
            self._current = (self._current + 1) % len(self._replicas)


class RegistryOperations:
    """The registry API, one method per operation. `_call` returns an awaitable in the async client.
    `decode(response)` turns an answer into the result; `decode_deflated(response, body)`, where given, does
    so for a 200 answer whose body the client kept deflated (the async client, see the module docstring)."""

    def _call(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
              headers: dict | None = None, decode=_json, idempotent: bool = False, decode_deflated=None):
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
        return self._call("POST", "/v1/agent/heartbeat", json=capacity, idempotent=True)

    def post_links(self, links: list[dict]):
        """links: [{"peer", "rtt_ms", "bandwidth_mbps"}], this site's measurements of its paths."""
        return self._call("POST", "/v1/agent/links", json={"links": links}, idempotent=True)

    def peers(self):
        """{"peers": [{"name", "grpc_address"}]}: live sites serving one of this site's models."""
        return self._call("GET", "/v1/agent/peers")

    def deregister(self):
        return self._call("DELETE", "/v1/agent/registration")

    # Router (router token).
    def snapshot(self, etag: str | None = None, packed: bool = True):
        """(snapshot, etag), or (None, etag) when `etag` is still current. `packed`: prefix-cache hashes in
        the packed format where the registry offers it; False: the JSON format only (hex strings)."""
        headers = {"Accept": f"{PACKED_SNAPSHOT_MEDIA_TYPE}, application/json;q=0.5" if packed else "application/json"}
        if etag:
            headers["If-None-Match"] = etag
        return self._call("GET", "/v1/router/snapshot", headers=headers, decode=_snapshot(etag),
                          decode_deflated=_deflated_snapshot)

    def lookup_api_key(self, key: str):
        """{"id", "name", "allowed_regions", "requests_per_minute", "tokens_per_minute", ...} or None."""
        return self._call("POST", "/v1/router/api-keys/lookup", json={"key": key}, decode=_found_or_none,
                          idempotent=True)

    def report_placements(self, placements: list[dict]):
        """placements: [{"prefill_site", "decode_site", "num_requests"}] placed since the last report."""
        return self._call("POST", "/v1/router/placements", json={"placements": placements})

    def fleet_report(self, report: dict):
        """{"applied", "live_routers", "grant_ttl_s", "grants": [...]}; resending the same `seq` is safe."""
        return self._call("POST", "/v1/router/reports", json=report, idempotent=True)

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

    def delete_site(self, name: str, force: bool = False):
        """Refused (409, site_is_live) for an active site with a fresh heartbeat unless `force`."""
        return self._call("DELETE", f"/v1/admin/sites/{name}", params={"force": "true"} if force else None)

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

    def placements(self, window_s: float = 300.0):
        """{"window_s", "pairs": [{"prefill_site", "decode_site", "num_requests", "last_at"}]}."""
        return self._call("GET", "/v1/admin/placements", params={"window_s": window_s})

    def usage(self, key_id: int | None = None, model: str | None = None, start: float | str | None = None,
              end: float | str | None = None, granularity: str = "hour"):
        """{"items": [{"key_id", "model", "period_start", "requests", "prompt_tokens", ...}], "totals": {...}};
        `start`/`end`: epoch seconds or ISO 8601."""
        params = _drop_none({"key": key_id, "model": model, "from": start, "to": end, "granularity": granularity})
        return self._call("GET", "/v1/admin/usage", params=params)

    def routers(self):
        """{"items": [{"router_id", "name", "last_seq", "last_report_at", "live"}]}"""
        return self._call("GET", "/v1/admin/routers")

    def audit_log(self, limit: int = 100, cursor: str | None = None):
        return self._call("GET", "/v1/admin/audit-log", params=_drop_none({"limit": limit, "cursor": cursor}))


class RegistryClient(RegistryOperations):
    """Async client (httpx.AsyncClient); every operation is awaited."""

    def __init__(self, base_url: str | list[str], token: str, timeout: float = DEFAULT_TIMEOUT_S, *,
                 actor: str | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        self.replicas = Replicas(base_url)
        self._http = httpx.AsyncClient(headers=_headers(token, actor), transport=transport, verify=verify,
                                       timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)))

    async def _call(self, method, path, *, json=None, params=None, headers=None, decode=_json, idempotent=False,
                    decode_deflated=None):
        for replica, last in self.replicas.attempts():
            try:
                request = self._http.build_request(method, replica.url + path, json=json, params=params,
                                                   headers=headers)
                response, deflated = await self._send(request, keep_deflated=decode_deflated is not None)
            except httpx.TransportError as exc:
                self.replicas.unreachable(replica, exc, last, method in IDEMPOTENT_METHODS or idempotent)
                continue
            if self.replicas.accept(replica, response, last):
                if deflated is not None:
                    return await asyncio.to_thread(decode_deflated, response, deflated)
                if len(response.content) >= THREAD_DECODE_BYTES:  # e.g. a large fleet's snapshot
                    return await asyncio.to_thread(decode, response)
                return decode(response)

    async def _send(self, request: httpx.Request, keep_deflated: bool) -> tuple[httpx.Response, bytes | None]:
        """The answer to `request`, read in full. With `keep_deflated`, a 200 answer in `Content-Encoding:
        deflate` is not inflated by httpx (which would do it here, on the event loop): its raw body comes
        back as the second item. Any other answer is read (and decoded) as usual."""
        if not keep_deflated:
            return await self._http.send(request), None
        response = await self._http.send(request, stream=True)
        try:
            encoding = response.headers.get("content-encoding", "").strip().lower()
            if response.status_code == 200 and encoding == "deflate":
                return response, b"".join([chunk async for chunk in response.aiter_raw()])
            await response.aread()
            return response, None
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.aclose()


class SyncRegistryClient(RegistryOperations):
    """Blocking client (httpx.Client) with the same operations, for the command line."""

    def __init__(self, base_url: str | list[str], token: str, timeout: float = DEFAULT_TIMEOUT_S, *,
                 actor: str | None = None, transport: httpx.BaseTransport | None = None,
                 verify: ssl.SSLContext | bool = True) -> None:
        self.replicas = Replicas(base_url)
        self._http = httpx.Client(headers=_headers(token, actor), transport=transport, verify=verify,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S)))

    def _call(self, method, path, *, json=None, params=None, headers=None, decode=_json, idempotent=False,
              decode_deflated=None):
        # httpx inflates a deflated body here, as it reads it: a command-line client has no loop to keep free.
        for replica, last in self.replicas.attempts():
            try:
                response = self._http.request(method, replica.url + path, json=json, params=params, headers=headers)
            except httpx.TransportError as exc:
                self.replicas.unreachable(replica, exc, last, method in IDEMPOTENT_METHODS or idempotent)
                continue
            if self.replicas.accept(replica, response, last):
                return decode(response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SyncRegistryClient:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
