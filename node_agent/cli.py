"""`edgefire agent --config site.toml [flags]`: run one site's agent until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from node_agent.config import FIELDS, ConfigError, base_type, load_config, parse_models, parse_text

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("agent", help="run a site's agent: engines, gRPC API, heartbeats, metrics",
                                   description="Every setting can come from --config, EDGEFIRE_AGENT_<NAME> or a flag "
                                               "(flags win).")
    parser.add_argument("--config", help="TOML file with the agent's settings")
    for name in FIELDS:
        if name == "models":
            parser.add_argument("--model", dest="models", action="append", metavar="NAME=DIR",
                                help="a model to serve (repeatable)")
            continue
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, metavar=base_type(name).__name__.upper(),
                            help=f"overrides {name}")
    parser.set_defaults(func=run)


def overrides_from_args(args: argparse.Namespace) -> dict:
    """Flag values typed like the config fields; unset flags are left out."""
    out = {}
    for name in FIELDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        out[name] = parse_models(value, "--model") if name == "models" else parse_text(name, value, flag)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, overrides_from_args(args))
    except ConfigError as exc:
        log.error("bad agent configuration: %s", exc)
        return 2
    return asyncio.run(_serve(config))


async def _serve(config) -> int:
    from node_agent.daemon import Agent
    from node_agent.errors import ListenError, ModelLoadError

    agent = Agent(config)
    try:
        await agent.start()
    except (ListenError, ModelLoadError) as exc:
        log.error("agent %s cannot start: %s", config.site, exc)
        await agent.stop()
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_drain)
    await agent.wait_stopped()
    log.info("agent %s stopped (exit status %d)", config.site, agent.exit_code)
    return agent.exit_code
