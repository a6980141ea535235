"""`edgefire registry migrate|serve`: create or upgrade the registry schema, and run the service
(with `--planner`, also the prefill/decode pool planner)."""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

DEFAULT_DB_URL = "sqlite:///.edgefire/registry.db"
DEFAULT_PORT = 8500
SHUTDOWN_GRACE_S = 5.0
DB_URL_ENV = "EDGEFIRE_REGISTRY_DB"  # how `serve --workers N` hands the database URL to its workers
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client's multiprocess switch (registry.metrics)

log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("registry", help="the central site registry: migrate the database, serve the API")
    commands = parser.add_subparsers(dest="registry_command", metavar="COMMAND", required=True)

    migrate = commands.add_parser("migrate", help="create or upgrade the registry schema to the latest revision")
    migrate.add_argument("--db", default=DEFAULT_DB_URL, help=f"database URL (default {DEFAULT_DB_URL})")
    migrate.set_defaults(func=run_migrate)

    serve = commands.add_parser("serve", help="run the registry HTTP service (agents, routers, operators)")
    serve.add_argument("--db", default=DEFAULT_DB_URL, help=f"database URL (default {DEFAULT_DB_URL})")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"listen port (default {DEFAULT_PORT})")
    serve.add_argument("--admin-token", default=os.environ.get("EDGEFIRE_ADMIN_TOKEN"),
                       help="operator token (default $EDGEFIRE_ADMIN_TOKEN)")
    serve.add_argument("--router-token", default=os.environ.get("EDGEFIRE_ROUTER_TOKEN"),
                       help="routers' token (default $EDGEFIRE_ROUTER_TOKEN)")
    serve.add_argument("--metrics-token", default=os.environ.get("EDGEFIRE_METRICS_TOKEN"),
                       help="a token that may only scrape GET /metrics, for Prometheus (default "
                            "$EDGEFIRE_METRICS_TOKEN; the admin token may scrape too)")
    serve.add_argument("--workers", type=int, default=1,
                       help="worker processes sharing the port, each with its own heartbeat group commit (default 1)")
    serve.add_argument("--no-migrate", action="store_true", help="do not upgrade the schema before serving")
    serve.add_argument("--planner", action="store_true",
                       help="run the prefill/decode pool planner (one active across registry processes: a lease)")
    serve.add_argument("--planner-dry-run", action="store_true", help="the planner only logs the changes it would make")
    serve.add_argument("--planner-config", help="TOML file of planner settings (registry.planner.PlannerSettings: "
                                                "min_dwell_s, settle_s, targets, high/low thresholds), top level "
                                                "or a [planner] table")
    serve.add_argument("--tls-cert", default=os.environ.get("EDGEFIRE_REGISTRY_TLS_CERT"),
                       help="PEM certificate (chain): serve HTTPS (default $EDGEFIRE_REGISTRY_TLS_CERT)")
    serve.add_argument("--tls-key", default=os.environ.get("EDGEFIRE_REGISTRY_TLS_KEY"),
                       help="PEM private key of --tls-cert (default $EDGEFIRE_REGISTRY_TLS_KEY)")
    serve.set_defaults(func=run_serve)


def run_migrate(args: argparse.Namespace) -> int:
    from registry.migrate import database_revisions, head_revision, upgrade_to_head

    problem = _database_problem(upgrade_to_head, args.db)
    if problem:
        log.error("%s", problem)
        return 2
    revisions = database_revisions(args.db)
    if revisions == (head_revision(),):
        log.info("registry schema at head on %s", _redacted(args.db))
    else:  # a newer edgefire's schema that this version serves: left as it is (upgrade_to_head warned)
        log.info("registry schema left at the newer revision %s on %s", ", ".join(revisions), _redacted(args.db))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from registry.auth import check_distinct_tokens
    from registry.http_head import HeadLimitedHttp
    from registry.service import create_app

    missing = [flag for flag, value in (("--admin-token", args.admin_token), ("--router-token", args.router_token))
               if not value]
    if missing:
        log.error("missing %s (or EDGEFIRE_ADMIN_TOKEN / EDGEFIRE_ROUTER_TOKEN)", " and ".join(missing))
        return 2
    try:
        check_distinct_tokens(args.admin_token, args.router_token, args.metrics_token or None)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.workers < 1:
        log.error("--workers must be at least 1")
        return 2
    if (args.planner or args.planner_dry_run) and args.workers > 1:
        log.error("--planner runs in single-worker mode; run it on one registry process (the lease keeps it single)")
        return 2
    if bool(args.tls_cert) != bool(args.tls_key):
        log.error("--tls-cert and --tls-key: give both or neither")
        return 2
    if args.tls_cert:
        from node_agent.tls import check_identity

        try:
            check_identity("--tls-cert", args.tls_cert, "--tls-key", args.tls_key)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
    # The registry's requests are short: a stop waits at most SHUTDOWN_GRACE_S for those in flight.
    options = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key, "timeout_graceful_shutdown": SHUTDOWN_GRACE_S}
    problem = _schema_problem(args.db, migrate=not args.no_migrate)
    if problem:
        log.error("%s", problem)
        return 2
    planner = None
    if args.planner or args.planner_dry_run:
        import typed_config

        from registry.planner import PlannerSettings

        try:
            planner = typed_config.load(PlannerSettings, args.planner_config, table="planner",
                                        overrides={"dry_run": True} if args.planner_dry_run else None)
        except typed_config.ConfigError as exc:
            log.error("%s", exc)
            return 2
    if args.workers == 1:
        app = create_app(args.db, args.admin_token, args.router_token, planner=planner,
                         metrics_token=args.metrics_token)
        uvicorn.run(app, http=HeadLimitedHttp, host=args.host, port=args.port, log_level="warning", access_log=False,
                    **options)
        return 0
    # uvicorn starts each worker from an import string; the settings travel in the environment.
    os.environ.update({DB_URL_ENV: args.db, "EDGEFIRE_ADMIN_TOKEN": args.admin_token,
                       "EDGEFIRE_ROUTER_TOKEN": args.router_token, "EDGEFIRE_METRICS_TOKEN": args.metrics_token or ""})
    with tempfile.TemporaryDirectory(prefix="edgefire-registry-metrics-") as metrics_dir:
        # Each worker records its metrics in this directory and a scrape sums them (registry.metrics);
        # set before the workers start, since prometheus-client reads it when it is imported.
        os.environ[MULTIPROCESS_ENV] = metrics_dir
        uvicorn.run("registry.cli:app_from_environment", factory=True, http=HeadLimitedHttp, workers=args.workers,
                    host=args.host, port=args.port, log_level="warning", access_log=False, **options)
    return 0


def app_from_environment():
    """The app of one `serve --workers N` worker."""
    from registry.service import create_app

    return create_app(os.environ[DB_URL_ENV], os.environ["EDGEFIRE_ADMIN_TOKEN"], os.environ["EDGEFIRE_ROUTER_TOKEN"],
                      metrics_token=os.environ.get("EDGEFIRE_METRICS_TOKEN") or None)


def _schema_problem(db_url: str, migrate: bool) -> str | None:
    """Why serving cannot start on this database (None: it can): after migrating it (unless
    --no-migrate), its schema must be the latest and writable (migrate.check_serviceable). With
    --no-migrate a database that cannot be reached is not a reason (the service answers 503 until it
    is back); any other problem is."""
    from sqlalchemy.exc import OperationalError

    from registry.migrate import check_serviceable, upgrade_to_head

    if migrate:
        return _database_problem(upgrade_to_head, db_url) or _database_problem(check_serviceable, db_url)
    try:
        return _database_problem(check_serviceable, db_url, reachable_only=False)
    except OperationalError as exc:
        log.warning("could not check the registry schema on %s (%s); serving, with 503s until the database "
                    "answers", _redacted(db_url), _first_line(exc.orig))
        return None


def _database_problem(step, db_url: str, reachable_only: bool = True) -> str | None:
    """Runs step(db_url); a database it cannot open or use is one line naming the URL (password
    hidden) and what is wrong, instead of a traceback. `reachable_only=False` lets a database that
    cannot be reached raise (OperationalError) for the caller to decide."""
    from alembic.util import CommandError
    from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError

    from registry.migrate import SchemaMismatch

    try:
        step(db_url)
    except ArgumentError as exc:  # not a URL, or a dialect SQLAlchemy does not have
        # not echoed: a mistyped URL may still hold a password
        return (f"registry database URL is not usable: {_first_line(exc)} (expected e.g. "
                f"sqlite:///var/edgefire/registry.db or postgresql+psycopg://USER:PASSWORD@HOST:5432/DB)")
    except ModuleNotFoundError as exc:  # a dialect whose driver is not installed
        return f"registry database {_redacted(db_url)}: its driver is not installed ({exc})"
    except DBAPIError as exc:  # down, refused the login, or a user without the privileges the tables need
        if isinstance(exc, OperationalError) and not reachable_only:
            raise
        return f"registry database {_redacted(db_url)} cannot be used: {_first_line(exc.orig)}"
    except (SchemaMismatch, CommandError) as exc:
        return f"registry database {_redacted(db_url)}: {exc}"
    except (ValueError, OSError) as exc:  # an in-memory SQLite; a SQLite directory that cannot be made
        return f"registry database {_redacted(db_url)} cannot be used: {exc}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _redacted(db_url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(db_url).render_as_string(hide_password=True)
    except ArgumentError:
        return "(not a database URL)"
