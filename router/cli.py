"""`edgefire router --config router.toml`: run one router until SIGINT/SIGTERM; SIGHUP reloads GeoIP."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from router.config import ConfigError, load_config
from router.geo import GeoDatabaseError

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("router", help="run the OpenAI-compatible router",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="router TOML file (settings in a [router] table)")
    parser.add_argument("--host", help="listen address (overrides the file)")
    parser.add_argument("--port", type=int, help="listen port (overrides the file)")
    parser.add_argument("--registry-url", help="registry base URL (overrides the file)")
    parser.add_argument("--geoip-db", help="GeoIP2 City .mmdb file (overrides the file)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = {name: value for name, value in (("host", args.host), ("port", args.port),
                                                  ("registry_url", args.registry_url),
                                                  ("geoip_db", args.geoip_db)) if value is not None}
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    try:
        import uvloop
    except ImportError:
        run_loop = asyncio.run
    else:
        run_loop = uvloop.run
    try:
        run_loop(_serve(config))
    except GeoDatabaseError as exc:
        log.error("geoip_db: %s", exc)
        return 2
    return 0


async def _serve(config) -> None:
    from router.server import Router

    async with Router(config) as router:
        url = await router.start_server()
        loop = asyncio.get_running_loop()
        # Reading and checking a database of tens of MB is done off the event loop; requests keep the
        # old one meanwhile, and keep it for good when the new file is bad (logged).
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.run_in_executor(None, router.locator.reload))
        log.info("router listening on %s%s", url,
                 f"; metrics on port {router.metrics_port}" if router.metrics_port else "")
        await router.serve_forever()
