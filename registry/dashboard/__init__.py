"""`GET /dashboard`: the operator's live map of the fleet, served by the registry from files in this package.

The page (index.html, dashboard.js, dashboard.css; plain HTML, JS and SVG, no build step) is public;
what it shows is not: it asks for the admin token in a sign-in form, keeps it in the tab's
sessionStorage and calls the admin API with it (`/v1/admin/snapshot`, `/v1/admin/placements`), so
the token is never in a URL and never reaches the server's logs. A Content-Security-Policy lets
the page load only its own files, talk only to this registry, submit no form and be framed by no
one. The country outlines are Natural Earth's 110m countries (public domain) as TopoJSON, from the
world-atlas package (see NOTICE); nothing is fetched from elsewhere, at build or run time.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from registry.http_errors import ApiError

HERE = Path(__file__).parent
ASSETS = {  # name -> (media type, Cache-Control)
    "dashboard.js": ("text/javascript; charset=utf-8", "no-cache"),
    "dashboard.css": ("text/css; charset=utf-8", "no-cache"),
    "countries-110m.json": ("application/json", "public, max-age=86400"),
}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}

router = APIRouter(include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return (HERE / name).read_bytes()


@router.get("/dashboard")
async def page() -> Response:
    return Response(_read("index.html"), media_type="text/html; charset=utf-8",
                    headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


@router.get("/dashboard/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise ApiError(404, f"the dashboard has no file {name!r}", "no_such_file")
    media_type, cache_control = ASSETS[name]
    return Response(_read(name), media_type=media_type, headers={**SECURITY_HEADERS, "Cache-Control": cache_control})
