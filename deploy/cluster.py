"""`edgefire up` (the whole system on this machine, until Ctrl-C), `edgefire status` (a table of
sites, or with --links the matrix of measured links; with --watch redrawn in place until Ctrl-C) and
`edgefire usage` (what each API key was served, per model, by hour or day)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from deploy.cli import EXIT_BROKEN_PIPE, discard_stdout
from deploy.cluster_config import (DEFAULT_DEMO_MODEL_DIR, DEFAULT_REGISTRY_PORT, DEFAULT_ROUTER_PORT,
                                   DEFAULT_STATE_DIR, ClusterConfig, ClusterConfigError, demo_model_dir, demo_sites,
                                   load_cluster_toml)
from engine.demo import ARCHITECTURES, demo_record, make_demo_model
from engine.demo import SIZES as DEMO_SIZES  # torch-free: only writing the weights imports torch

log = logging.getLogger(__name__)

SITE_DELETED_EXIT_STATUS = 3  # node_agent.daemon's exit status once its site was deleted (kept torch-free here)
MAX_RESTARTS = 5  # per process, while `up` supervises; a process that keeps dying is left down


def add_parser(subparsers) -> None:
    up = subparsers.add_parser("up", help="run registry, sites and router on this machine (Ctrl-C stops them)",
                               description="Starts, on loopback: the registry (SQLite), one agent per site and a "
                                           "router, and prints how to call it. Ctrl-C stops everything.")
    up.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory (default: a random-weight demo "
                                               f"model in {DEFAULT_DEMO_MODEL_DIR}, or with --state-dir DIR in "
                                               f"DIR/{DEFAULT_DEMO_MODEL_DIR.name})")
    up.add_argument("--model-name", help="the model id clients send (default: the checkpoint directory's name)")
    up.add_argument("--sites", type=int, help="number of demo sites (default 3: prefill-only, decode-only, both)")
    up.add_argument("--config", type=Path, help="cluster TOML file describing the sites (see deploy/README.md)")
    up.add_argument("--port", type=int, help=f"router port (default {DEFAULT_ROUTER_PORT})")
    up.add_argument("--registry-port", type=int, help=f"registry port (default {DEFAULT_REGISTRY_PORT})")
    up.add_argument("--host", help="address every process listens on (default 127.0.0.1)")
    up.add_argument("--api-key", default=os.environ.get("EDGEFIRE_API_KEY"),
                    help="the API key clients send (default $EDGEFIRE_API_KEY, else generated)")
    up.add_argument("--admin-token", default=os.environ.get("EDGEFIRE_ADMIN_TOKEN"),
                    help="the registry admin token (default $EDGEFIRE_ADMIN_TOKEN, else generated)")
    up.add_argument("--state-dir", type=Path, help=f"database, configs, logs, pid files (default {DEFAULT_STATE_DIR})")
    up.add_argument("--planner", action="store_true", default=None,
                    help="run the prefill/decode pool planner: it moves sites allowed both roles between the pools")
    up.add_argument("--demo-size", default="small", choices=list(DEMO_SIZES),
                    help="size of the demo model (default small); the state dir's demo model is rewritten when it "
                         "was made at another size. Not used with --model")
    up.add_argument("--tls", action="store_true", default=None,
                    help="run every hop over TLS (HTTPS, gRPC, KV data port) with a local CA made in the state dir")
    up.add_argument("--routers", type=int, help="routers to run (default 1); they share every key's limits and "
                                                "listen on --port, --port + 1, ...")
    up.add_argument("--registry-replicas", type=int,
                    help="registry processes over one database (default 1), on --registry-port, + 1, ...; routers "
                         "and agents move to another when one fails")
    up.add_argument("--db", help="the registry's database, e.g. postgresql+psycopg://user@host:5432/edgefire "
                                 "(migrated and seeded, never emptied; default: SQLite in the state dir, made afresh)")
    up.set_defaults(func=run_up)

    status = subparsers.add_parser("status", help="a table of sites: state, role, GPUs and layout, load, KV free, "
                                                   "heartbeat age")
    _registry_arguments(status)
    status.add_argument("--json", action="store_true", help="print the raw site list (or links) as JSON")
    status.add_argument("--links", action="store_true",
                        help="the measured links instead: RTT, throughput and age for each pair of sites")
    status.add_argument("--watch", action="store_true", help="redraw the table in place every --interval seconds "
                                                             "until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between redraws with --watch (default 2)")
    status.set_defaults(func=run_status)

    usage = subparsers.add_parser("usage", help="what each API key was served: requests and tokens per model and "
                                                "hour (or day, or in total)")
    _registry_arguments(usage)
    usage.add_argument("--key", type=int, help="one API key's id (default: every key)")
    usage.add_argument("--model", help="one model (default: every model)")
    usage.add_argument("--from", dest="start", help="epoch seconds or ISO 8601, e.g. 2026-11-23T10:00Z "
                                                    "(hours starting at or after it)")
    usage.add_argument("--to", dest="end", help="epoch seconds or ISO 8601 (hours starting before it)")
    usage.add_argument("--granularity", default="hour", choices=["hour", "day", "total"],
                       help="one row per key, model and hour (UTC), day, or the whole range (default hour)")
    usage.add_argument("--json", action="store_true", help="print the registry's answer as JSON")
    usage.set_defaults(func=run_usage)


def _registry_arguments(parser) -> None:
    parser.add_argument("--registry-url", help="registry base URL, or several replicas comma-separated (default: "
                                               "the running `edgefire up` cluster's)")
    parser.add_argument("--admin-token", default=os.environ.get("EDGEFIRE_ADMIN_TOKEN"),
                        help="admin token (default $EDGEFIRE_ADMIN_TOKEN, else the `edgefire up` cluster's)")
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help=f"where `edgefire up` keeps cluster.json (default {DEFAULT_STATE_DIR})")
    parser.add_argument("--ca", help="CA bundle verifying an https registry (default: the `edgefire up` cluster's)")


# -- up ----------------------------------------------------------------------------------------

def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    overrides = {"model_dir": args.model, "model_name": args.model_name, "router_port": args.port,
                 "registry_port": args.registry_port, "host": args.host, "api_key": args.api_key,
                 "admin_token": args.admin_token, "state_dir": args.state_dir, "planner": args.planner,
                 "tls": args.tls, "routers": args.routers, "registry_replicas": args.registry_replicas, "db": args.db}
    if args.sites is not None:
        overrides["sites"] = demo_sites(args.sites)
    if args.config is not None:
        return load_cluster_toml(args.config, **overrides)
    overrides.setdefault("sites", demo_sites(3))
    if overrides["model_dir"] is None:
        overrides.update(model_dir=demo_model_dir(args.state_dir or DEFAULT_STATE_DIR), demo_model=True)
    return ClusterConfig(**{k: v for k, v in overrides.items() if v is not None})


def ensure_model(config: ClusterConfig, demo_size: str) -> None:
    """A given model must be a checkpoint; the demo model is written, or rewritten when it was made at
    another size than `demo_size` (keeping the architecture it was made with)."""
    if not config.demo_model:
        if not (config.model_dir / "config.json").is_file():
            raise ClusterConfigError(f"--model: {config.model_dir} is not a checkpoint directory (no config.json)")
        return
    record = demo_record(config.model_dir)
    written = (config.model_dir / "config.json").is_file()
    if written and record is not None and record.get("size") == demo_size:
        return
    if written or record is not None:
        made = f"it was made {record.get('size')}" if record is not None else "its size was not recorded"
        print(f"rewriting the demo model in {config.model_dir} as {demo_size}: {made} ...", flush=True)
    else:
        print(f"writing a random-weight {demo_size} demo model to {config.model_dir} (its output is meaningless "
              f"text) ...", flush=True)
    arch = record.get("arch") if record is not None and record.get("arch") in ARCHITECTURES else "llama"
    make_demo_model(config.model_dir, demo_size, arch=arch)


def run_up(args: argparse.Namespace) -> int:
    from deploy.launcher import Cluster, ClusterError

    logging.getLogger("alembic").setLevel(logging.WARNING)  # the launcher's migration is not news
    cluster = None
    try:
        config = config_from_args(args)
        cluster = Cluster(config)
        # Before the demo model is (re)written: a cluster already running in this state dir may serve it.
        cluster.claim_state_dir()
        ensure_model(config, args.demo_size)
    except (ClusterConfigError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if cluster is not None:
            cluster.stop()   # nothing started yet: this gives the state dir back
        return 2 if isinstance(exc, ClusterConfigError) else 1
    # SIGTERM (systemd, kill) stops the cluster the same way Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"starting {len(config.sites)} site(s), {_count(config.registry_replicas, 'registry', 'registries')} and "
          f"{_count(config.routers, 'router', 'routers')} (logs in {cluster.state_dir / 'logs'}) ...", flush=True)
    try:
        started = time.monotonic()
        cluster.start()
        print(banner(cluster, time.monotonic() - started), flush=True)
        supervise(cluster)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # Whoever read the output went away (`edgefire up | head`): stop everything, with nothing more to say.
        discard_stdout()
        cluster.stop()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        _say("\nstopping: router, sites (draining), registry ... (interrupt again to kill them at once)")
        try:
            cluster.stop()
        except KeyboardInterrupt:
            # A second Ctrl-C, or the SIGTERM that systemd, docker or `timeout` repeat: stop waiting for the
            # drain, but leave nothing running (the processes have sessions of their own, no signal reaches them).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            _say("interrupted again: killing what is still running ...")
            cluster.kill_all()
        _say("stopped.")
    return 0


def _say(text: str) -> None:
    """A line of the stopping cluster's progress. Ctrl-C on `edgefire up | tee up.log` ends tee too: the
    stop must go on without a reader."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        discard_stdout()


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _count(n: int, one: str, many: str) -> str:
    return f"a {one}" if n == 1 else f"{n} {many}"


def supervise(cluster) -> None:
    """Restarts a process that dies (up to MAX_RESTARTS times each) until interrupted; one that keeps
    dying is left down, and the operator told so once (else its last restart is the last word they see)."""
    left_down: set[str] = set()
    while True:
        time.sleep(1.0)
        for process in cluster.dead_processes():
            code = process.exit_code()
            if process.name in left_down:
                continue
            if process.kind == "agent" and code == SITE_DELETED_EXIT_STATUS:   # its site was deleted: no restart helps
                left_down.add(process.name)
                print(f"{process.name} stopped: its site was deleted from the registry (log: {process.log_path}); "
                      f"leaving it down", flush=True)
                continue
            if process.num_starts > MAX_RESTARTS:
                left_down.add(process.name)
                print(f"{process.name} exited with code {code} again after {MAX_RESTARTS} restarts; leaving it down "
                      f"(log: {process.log_path}). The rest of the cluster keeps running; Ctrl-C stops it",
                      flush=True)
                continue
            print(f"{process.name} exited with code {code}; restarting it (log: {process.log_path})", flush=True)
            process.start()


def banner(cluster, startup_s: float) -> str:
    c = cluster.config
    rows = [("process", "listens on", "role", "where", "log")]
    database = _redacted(c.db) if c.db else "sqlite: registry.db"
    for name, url in zip(cluster.registry_names, cluster.registry_urls):
        rows.append((name, url, "sites, capacity, usage, admin API", database, f"logs/{name}.log"))
    for site in c.sites:
        rows.append((f"agent {site.name}", f"grpc{'s' if c.tls else ''}://{cluster.site_address(site.name)}", site.role,
                     f"{site.name} ({site.lat:.2f}, {site.lon:.2f})", f"logs/{site.name}.log"))
    for name, url in zip(cluster.router_names, cluster.router_urls):
        rows.append((name, url, "OpenAI-compatible endpoint", f"({c.router['lat']:.2f}, {c.router['lon']:.2f})",
                     f"logs/{name}.log"))
    url, ca = cluster.router_url, cluster.ca_path
    curl_ca = f" --cacert {ca}" if ca else ""
    python_client = (f'OpenAI(base_url="{url}/v1", api_key="{c.api_key}",\n'
                     f'                http_client=httpx.Client(verify=ssl.create_default_context(cafile="{ca}")))'
                     if ca else f'OpenAI(base_url="{url}/v1", api_key="{c.api_key}")')
    python_imports = "import ssl\n\nimport httpx\nfrom openai import OpenAI" if ca else "from openai import OpenAI"
    # status and usage find the cluster in cluster.json: outside the default state dir they must be told where.
    state_dir = ("" if cluster.state_dir == DEFAULT_STATE_DIR.resolve()
                 else f" --state-dir {shlex.quote(str(cluster.state_dir))}")
    tls_line = f"\n  CA bundle     {ca}   (every hop is TLS: HTTPS, gRPC and KV with client certificates)" if ca else ""
    return f"""
edgefire is up in {startup_s:.0f}s: model `{cluster.model}` from {c.model_dir}
{format_table(rows)}

  state dir     {cluster.state_dir}
  admin token   {c.admin_token}
  API key       {c.api_key}{tls_line}

Try it:
  curl -sN{curl_ca} {url}/v1/chat/completions \\
    -H "Authorization: Bearer {c.api_key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{cluster.model}", "messages": [{{"role": "user", "content": "Hello from the edge"}}], "max_tokens": 32, "stream": true}}'

  python - <<'EOF'
{python_imports}
client = {python_client}
reply = client.chat.completions.create(model="{cluster.model}", max_tokens=32,
                                       messages=[{{"role": "user", "content": "Hello from the edge"}}])
print(reply.choices[0].message.content)
EOF

  EDGEFIRE_ADMIN_TOKEN={c.admin_token} edgefire status{state_dir} --watch     # sites, load, KV, heartbeats, live
  EDGEFIRE_ADMIN_TOKEN={c.admin_token} edgefire usage{state_dir}             # requests and tokens per key, model, hour

Watch it:
  dashboard     {cluster.registry_url}/dashboard   (sign in with the admin token)
  metrics       router {cluster.router_metrics_url}, registry {cluster.registry_url}/metrics (admin token),
                sites {", ".join(cluster.metrics_url(s.name) for s in c.sites)}
Ctrl-C stops everything."""


def _redacted(db_url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(db_url).render_as_string(hide_password=True)


# -- status --------------------------------------------------------------------------------------

def run_status(args: argparse.Namespace) -> int:
    if args.watch and args.json:
        print("error: --watch redraws tables; --json prints once (leave one out)", file=sys.stderr)
        return 2
    if args.watch and not args.interval >= 0.1:
        print(f"error: --interval must be at least 0.1 seconds, got {args.interval}", file=sys.stderr)
        return 2
    found = _admin_client(args)
    if found is None:
        return 2
    registry, registry_url = found
    with registry:
        if args.watch:
            return watch_status(registry, registry_url, args)
        text, error = status_text(registry, registry_url, args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(text)
    return 0


def run_usage(args: argparse.Namespace) -> int:
    import httpx

    from registry.client import RegistryError

    found = _admin_client(args)
    if found is None:
        return 2
    registry, registry_url = found
    try:
        with registry:
            answer = registry.usage(args.key, args.model, args.start, args.end, args.granularity)
    except RegistryError as exc:
        print(f"error: {refusal_text(exc, args)}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the registry at {registry_url} ({exc})", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else usage_table(answer))
    return 0


def _admin_client(args: argparse.Namespace):
    """(an admin client, the URL(s) it calls) from the flags or the running `edgefire up` cluster; None
    after saying what is missing."""
    from node_agent.tls import client_context
    from registry.client import SyncRegistryClient

    registry_url, admin_token, ca = args.registry_url, args.admin_token, args.ca
    path = args.state_dir / "cluster.json"
    if registry_url is None or admin_token is None:
        try:
            saved = saved_cluster(args.state_dir)
            registry_url = registry_url or ",".join(saved.get("registry_urls") or [_saved(saved, "registry_url", path)])
            admin_token = admin_token or _saved(saved, "admin_token", path)
        except ClusterConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return None
        ca = ca or saved.get("ca")
    try:
        return SyncRegistryClient(registry_url, admin_token, verify=client_context(ca) if ca else True), registry_url
    except ValueError as exc:   # a malformed URL
        print(f"error: {'--registry-url' if args.registry_url else f'{path}: registry_url'}: {exc}", file=sys.stderr)
        return None


def refusal_text(exc, args: argparse.Namespace) -> str:
    """The registry's refusal; for a token it does not know, also where that token came from: an
    EDGEFIRE_ADMIN_TOKEN exported for an earlier `edgefire up` wins over the new cluster's cluster.json."""
    if exc.status != 401:
        return str(exc)
    if args.admin_token is None:
        source = f"from {args.state_dir / 'cluster.json'}"
    elif args.admin_token == os.environ.get("EDGEFIRE_ADMIN_TOKEN"):
        source = "from $EDGEFIRE_ADMIN_TOKEN"
    else:
        source = "given with --admin-token"
    return f"{exc} (the admin token {source} is not this registry's; give its admin token with --admin-token)"


def saved_cluster(state_dir: Path) -> dict:
    """STATE_DIR/cluster.json as `edgefire up` wrote it; ClusterConfigError naming the file and what is wrong."""
    path = state_dir / "cluster.json"
    give = "give --registry-url and --admin-token"
    try:
        saved = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ClusterConfigError(f"no running `edgefire up` cluster in {state_dir} (no {path}); {give}") from None
    except OSError as exc:
        raise ClusterConfigError(f"cannot read {path}: {exc.strerror or exc}; {give}") from None
    except ValueError as exc:   # not JSON, or not UTF-8
        raise ClusterConfigError(f"{path} is not valid JSON ({exc}); {give}, or start `edgefire up` again") from None
    if not isinstance(saved, dict):
        raise ClusterConfigError(f"{path} must hold a JSON object, as `edgefire up` writes it, got "
                                 f"{json.dumps(saved)[:60]}; {give}, or start `edgefire up` again")
    wrong = [f"{key} must be a string, got {json.dumps(saved[key])[:60]}" for key in ("registry_url", "admin_token", "ca")
             if saved.get(key) is not None and not isinstance(saved[key], str)]
    urls = saved.get("registry_urls")
    if urls is not None and not (isinstance(urls, list) and all(isinstance(url, str) for url in urls)):
        wrong.append(f"registry_urls must be a list of URLs, got {json.dumps(urls)[:60]}")
    if wrong:
        raise ClusterConfigError(f"{path}: {'; '.join(wrong)}; {give}, or start `edgefire up` again")
    return saved


def _saved(saved: dict, key: str, path: Path) -> str:
    if not saved.get(key):
        flag = "--registry-url" if key == "registry_url" else "--admin-token"
        raise ClusterConfigError(f"{path} has no {key!r} (it was not written by `edgefire up`, or was edited); "
                                 f"give {flag}, or start `edgefire up` again")
    return saved[key]


def status_text(registry, registry_url: str, args: argparse.Namespace) -> tuple[str, str | None]:
    """(what `edgefire status` prints, None) or ("", the error that kept it from the registry)."""
    import httpx

    from registry.client import RegistryError

    try:
        snapshot = registry.admin_snapshot()
    except RegistryError as exc:
        return "", refusal_text(exc, args)
    except httpx.HTTPError as exc:
        return "", f"cannot reach the registry at {registry_url} ({exc})"
    if args.links:
        links = snapshot.get("links", [])
        return (json.dumps(links, indent=2) if args.json else
                links_matrix([site["name"] for site in snapshot["sites"]], links, snapshot["generated_at"])), None
    if args.json:
        return json.dumps(snapshot["sites"], indent=2), None
    return status_table(snapshot["sites"]), None


# ANSI: the alternate screen (the terminal comes back as it was), cursor hidden, home, erase.
ENTER, LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME, ERASE_LINE, ERASE_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"


def watch_status(registry, registry_url: str, args: argparse.Namespace) -> int:
    """Redraws the table in place every interval until Ctrl-C (exit 0). While the registry cannot be
    reached the last table stays on screen under a line saying so, and the next redraw tries again."""
    out = sys.stdout
    last_text = ""
    out.write(ENTER)
    try:
        while True:
            text, error = status_text(registry, registry_url, args)
            last_text = text or last_text
            header = (f"edgefire status  {registry_url}  every {args.interval:g}s  "
                      f"{time.strftime('%H:%M:%S')}  (Ctrl-C to stop)")
            lines = [header, f"! {error}; retrying" if error else "", *last_text.splitlines()]
            out.write(HOME + "".join(line + ERASE_LINE + "\n" for line in lines) + ERASE_BELOW)
            out.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(LEAVE)
        out.flush()


def usage_table(answer: dict) -> str:
    rows = [("period (UTC)", "key", "model", "requests", "prompt tokens", "cached", "completion tokens", "total")]
    size = {"hour": 3600, "day": 86400}.get(answer["granularity"])
    for item in answer["items"]:
        period = "all" if item["period_start"] is None else _utc(item["period_start"], size)
        rows.append((period, f"{item['key_id']} {item['key_name']}", item["model"], item["requests"],
                     item["prompt_tokens"], item["cached_prompt_tokens"], item["completion_tokens"],
                     item["total_tokens"]))
    t = answer["totals"]
    rows.append(("total", "", "", t["requests"], t["prompt_tokens"], t["cached_prompt_tokens"],
                 t["completion_tokens"], t["total_tokens"]))
    return format_table(rows)


def _utc(epoch_s: int, size: int | None) -> str:
    return time.strftime("%Y-%m-%d" if size == 86400 else "%Y-%m-%d %H:00", time.gmtime(epoch_s))


def status_table(sites: list[dict]) -> str:
    rows = [("site", "state", "alive", "role", "region", "GPUs (tp x pp)", "load (run/wait)", "KV free", "heartbeat",
             "address")]
    for site in sites:
        cap = site.get("capacity") or {}
        kv = (f"{cap['kv_blocks_free']}/{cap['kv_blocks_total']} "
              f"({100 * cap['kv_blocks_free'] / max(1, cap['kv_blocks_total']):.0f}%)") if cap else "-"
        load = f"{cap.get('num_running', 0)}/{cap.get('num_waiting', 0)}" if cap else "-"
        age = site.get("heartbeat_age_s")
        state = site["state"] + (" (draining)" if cap.get("draining") and site["state"] != "draining" else "")
        experts = f",ep{cap['expert_parallel_size']}" if cap.get("expert_parallel_size", 1) > 1 else ""
        devices = (f"{cap.get('num_gpus') or 'cpu'} ({cap.get('tensor_parallel_size', 1)}x"
                   f"{cap.get('pipeline_parallel_size', 1)}{experts})") if cap else "-"
        rows.append((site["name"], state, "yes" if site.get("alive") else "no", site_role(site),
                     site.get("region") or "-", devices, load, kv, "never" if age is None else f"{age:.1f}s ago",
                     site.get("grpc_address") or "-"))
    return format_table(rows)


def site_role(site: dict) -> str:
    """The roles routers place on a site, as the registry publishes them (`role_offer`, the one rule the
    dashboard and routers read too): "both (now prefill)" for a site the pool planner narrowed."""
    from registry.wire import read_role_offer

    offer = read_role_offer(site)
    now = _roles_name(offer.roles)
    configured = "both" if offer.flexible else now
    return configured if now == configured else f"{configured} (now {now})"


def _roles_name(roles: tuple[str, ...]) -> str:
    return "both" if len(roles) == 2 else roles[0] if roles else "none"


def links_matrix(names: list[str], links: list[dict], now: float) -> str:
    """One row per measuring site, one column per peer: "RTT / throughput, age" of the latest measurement.
    A site measures by pulling from its peer (KV pulls and probes), so the bytes went from the column's
    site to the row's, whatever the snapshot's `src`/`dst` field names suggest: the header says so."""
    measured = {(link["src"], link["dst"]): link for link in links}
    rows = [("to \\ from", *names)]
    for src in names:
        cells = []
        for dst in names:
            link = measured.get((src, dst))
            if src == dst:
                cells.append("·")
            elif link is None:
                cells.append("-")
            else:
                cells.append(f"{link['rtt_ms']:.1f}ms {_rate(link['bandwidth_mbps'])} {_age(now - link['measured_at'])}")
        rows.append((src, *cells))
    note = ("cells: round-trip time, throughput (column's site to row's site, as the row's site measured it), "
            "age of the measurement; - not measured (placement uses distance)")
    return f"{format_table(rows)}\n{note}"


def _rate(mbps: float) -> str:
    return f"{mbps / 1000:.1f}Gbps" if mbps >= 1000 else f"{mbps:.0f}Mbps"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}min ago"


def format_table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
