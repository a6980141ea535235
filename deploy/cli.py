"""The `edgefire` command line: one entry point, one subcommand per job.

Each package that has commands owns a `cli.py` with `add_parser(subparsers)`; this module only
collects them, so adding a command never means editing someone else's file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Packages whose `cli.add_parser` contributes subcommands, in help order.
COMMAND_MODULES = ["engine.cli", "registry.cli", "node_agent.cli", "router.cli", "deploy.cluster"]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The status of a command whose reader went away (`edgefire status | head`): what a shell reports for a
# process ended by SIGPIPE, so `set -o pipefail` scripts see edgefire as they see any other tool.
EXIT_BROKEN_PIPE = 141


def _log_level(text: str) -> str:
    if text.upper() not in logging.getLevelNamesMapping():  # LOG_LEVELS and aliases such as WARN
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgefire", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", type=_log_level,
                        help=f"logging level: {', '.join(LOG_LEVELS)} (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that package has no commands yet
            raise
        module.add_parser(subparsers)
    return parser


def configure_logging(level: str) -> None:
    """One format for every edgefire process; a line written for a request ends with its request id and
    trace id (node_agent.trace), so one grep follows a request across router and sites. httpx logs
    every request at INFO: in agents (a heartbeat per interval) and routers (a snapshot poll per
    second) that would be a line each."""
    from node_agent.trace import LOG_FORMAT, RequestLogFilter

    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestLogFilter())
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()   # so a closed pipe shows here, not as a traceback at interpreter exit
    except BrokenPipeError:
        discard_stdout()
        return EXIT_BROKEN_PIPE


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


def discard_stdout() -> None:
    """Points stdout at /dev/null once its reader has gone, so nothing written later (the interpreter's
    exit flush included) fails again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
