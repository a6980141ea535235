"""What an operator copies from the deployment files and the READMEs works with this code: every example
config (and each manifest's ConfigMap with the environment its container gets) loads through the real
loader with its validation, every EDGEFIRE_* variable is one the code (or the command beside it) reads,
every `edgefire` command and flag in the READMEs exists, every admin API call names a real route and
method, the probes and mounts point at what the processes serve and read, the systemd units stop
restarting on the status a refused configuration exits with, the image holds every package, and the
Grafana dashboard asks only for labels its metrics carry."""

from __future__ import annotations

import configparser
import functools
import json
import re
import shlex
import tomllib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from deploy.cli import build_parser, main
from deploy.cluster_config import ClusterConfig
from node_agent import metrics_server
from node_agent.config import FIELDS as AGENT_FIELDS
from node_agent.config import load_config as load_agent_config
from node_agent.metrics import AgentMetrics
from registry import service as registry_service
from registry.dashboard import router as dashboard_routes
from registry.metrics import RegistryMetrics
from registry.routes_admin import router as admin_routes
from registry.routes_agent import router as agent_routes
from registry.routes_router import router as router_routes
from router.app import create_app as create_router_app
from router.config import load_config as load_router_config
from router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
READMES = [ROOT / "README.md", DEPLOY / "README.md"]
CODE_DIRS = ["engine", "registry", "router", "node_agent", "deploy", "typed_config"]
# A checkpoint's config.json as the engine reads it (no weights are loaded by a config check).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 1}
POD_NAME = "edgefire-agent-0"


# -- reading the files ------------------------------------------------------------------------------

def manifests() -> list[dict]:
    return [d for path in sorted((DEPLOY / "k8s").glob("*.yaml")) if path.name != "kustomization.yaml"
            for d in yaml.safe_load_all(path.read_text()) if d]


def find(kind: str, name: str) -> dict:
    return next(d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


def pod_spec(kind: str, name: str) -> dict:
    return find(kind, name)["spec"]["template"]["spec"]


def unit(name: str) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / f"{name}.service")
    return parser["Service"]


def checkpoint(directory: Path) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(directory)


def container_env(container: dict) -> dict[str, str]:
    """The environment Kubernetes gives the container: values, the pod's name, the example Secrets'
    values, with $(VAR) references expanded as the kubelet does."""
    secrets = {d["metadata"]["name"]: d["stringData"] for d in manifests() if d["kind"] == "Secret"}
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        source = variable.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name"
            value = POD_NAME
        elif "secretKeyRef" in source:
            value = secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], variable["value"])
        env[variable["name"]] = value
    return env


# -- example configs through the real loaders -------------------------------------------------------

def test_the_example_agent_config_loads_with_the_tokens_its_env_file_gives(tmp_path):
    document = tomllib.loads((DEPLOY / "config" / "agent.toml").read_text())
    models = {name: checkpoint(tmp_path / name) for name in document["models"]}
    environ = {"EDGEFIRE_AGENT_SITE_TOKEN": "efs-example", "EDGEFIRE_AGENT_PEER_TOKEN": "peer-example"}
    config = load_agent_config(DEPLOY / "config" / "agent.toml", overrides={"models": models}, environ=environ)
    assert config.kv_data_port and config.grpc_address.endswith(":50051")
    # the unit's stop timeout outlasts the drain it starts
    assert int(unit("edgefire-agent")["TimeoutStopSec"]) > config.drain_timeout_s


def test_the_example_router_config_loads(tmp_path):
    geoip = tmp_path / "GeoLite2-City.mmdb"  # the router only checks the file is there at load
    geoip.write_bytes(b"")
    config = load_router_config(DEPLOY / "config" / "router.toml", {"geoip_db": str(geoip)})
    assert config.registry_token and config.agent_token and config.metrics_listen


def test_the_agent_statefulset_starts_with_its_configmap_and_environment(tmp_path):
    (container,) = pod_spec("StatefulSet", "edgefire-agent")["containers"]
    text = find("ConfigMap", "edgefire-agent")["data"]["agent.toml"]
    (tmp_path / "agent.toml").write_text(text)
    environ = {name: value for name, value in container_env(container).items() if name.startswith("EDGEFIRE_")}
    # the shell exports the pod's own site token from the mounted Secret before exec'ing the agent
    script = " ".join(container["args"])
    token_file = re.search(r'export EDGEFIRE_AGENT_SITE_TOKEN="\$\(cat ([^)]+)\)"', script).group(1)
    site_tokens = find("Secret", "edgefire-site-tokens")["stringData"]
    environ["EDGEFIRE_AGENT_SITE_TOKEN"] = site_tokens[Path(token_file.replace("$POD_NAME", POD_NAME)).name]
    models = {name: checkpoint(tmp_path / "models" / name) for name in tomllib.loads(text)["models"]}
    config = load_agent_config(tmp_path / "agent.toml", overrides={"models": models}, environ=environ)
    assert config.site == POD_NAME
    assert config.advertise_address == f"{POD_NAME}.edgefire-agent.edgefire.svc.cluster.local:50051"


def test_the_router_deployment_config_loads_as_its_shell_assembles_it(tmp_path):
    (container,) = pod_spec("Deployment", "edgefire-router")["containers"]
    script = " ".join(container["args"])
    parts = re.search(r"cat (\S+) (\S+) > (\S+)", script)
    assert f"--config {parts.group(3)}" in script
    tokens = find("Secret", "edgefire-router")["stringData"]["tokens.toml"]
    (tmp_path / "router.toml").write_text(find("ConfigMap", "edgefire-router")["data"]["router.toml"] + tokens)
    config = load_router_config(tmp_path / "router.toml")
    assert config.registry_token and config.agent_token


# -- environment variables --------------------------------------------------------------------------

def code_text() -> str:
    return "\n".join(p.read_text() for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def expanded_in_commands() -> set[str]:
    """Variables the deployment files' own commands expand (systemd ${X}, Kubernetes $(X))."""
    text = "\n".join(p.read_text() for p in [*(DEPLOY / "systemd").iterdir(), *(DEPLOY / "k8s").iterdir()])
    return set(re.findall(r"\$[{(](EDGEFIRE_\w+)[})]", text))


@pytest.mark.parametrize("path", [*READMES, *sorted((DEPLOY / "systemd").iterdir()),
                                  *sorted((DEPLOY / "k8s").iterdir()), DEPLOY / "container" / "Containerfile",
                                  *sorted((DEPLOY / "config").iterdir())], ids=lambda p: p.name)
def test_every_edgefire_variable_is_read_by_the_code(path):
    code, expanded = code_text(), expanded_in_commands()
    agent_variables = {"EDGEFIRE_AGENT_" + name.upper() for name in AGENT_FIELDS}
    fuzz = (ROOT / "tests" / "fuzz").glob("*.py")  # the README's knob for the fuzz tests
    test_knobs = set(re.findall(r"EDGEFIRE_\w+", "\n".join(p.read_text() for p in fuzz)))
    unknown = {name for name in re.findall(r"\bEDGEFIRE_[A-Z0-9_]*[A-Z0-9]", path.read_text())
               if name not in agent_variables | expanded | test_knobs and f'"{name}"' not in code}
    assert unknown == set()


# -- commands and flags in the READMEs --------------------------------------------------------------

def command_snippets(text: str) -> list[str]:
    """`edgefire ...` inline, and the lines of shell blocks that run edgefire (after VAR=value words)."""
    snippets = re.findall(r"`(?:\.venv/bin/)?(edgefire [^`]+)`", text)
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            words = line.split("#")[0].split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words.pop(0)
            if words and words[0].endswith("edgefire"):
                snippets.append(" ".join(["edgefire", *words[1:]]))
    return snippets


@functools.cache
def edgefire_parser():
    return build_parser()


def subcommand(words: list[str]):
    """The parser of the longest run of subcommand words, and the words it consumed."""
    parser, used = edgefire_parser(), 0
    while used < len(words):
        choices = next((a.choices for a in parser._actions if a.choices and isinstance(a.choices, dict)), None)
        if not choices or words[used] not in choices:
            break
        parser, used = choices[words[used]], used + 1
    return parser, used


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_command_and_flag_in_the_readme_exists(readme):
    snippets = command_snippets(readme.read_text())
    assert len(snippets) > 5
    for snippet in snippets:
        words = snippet.split()[1:]
        parser, used = subcommand(words)
        assert used or words[0].startswith("--"), f"{snippet!r}: no such subcommand"
        options = {o for action in parser._actions for o in action.option_strings}
        flags = {w.strip("[]|,").split("=")[0] for w in words if w.strip("[").startswith("--")}
        assert flags <= options, f"{snippet!r}: unknown {sorted(flags - options)}"


# -- HTTP paths: admin API calls, probes ------------------------------------------------------------

def registry_routes() -> list[tuple[set[str], str]]:
    app = registry_service.create_app("sqlite:////nonexistent/registry.db", "admin", "router")  # opens nothing yet
    routes = [r for group in (admin_routes, agent_routes, router_routes, dashboard_routes) for r in group.routes]
    routes += [r for r in app.routes if hasattr(r, "path")]
    return [(set(r.methods), r.path) for r in routes]


def matches(template: str, path: str) -> bool:
    pattern = re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template))
    return re.fullmatch(pattern, path) is not None


def admin_calls(text: str) -> list[tuple[str | None, str]]:
    """(method or None, path) of every /v1/admin call a README shows; `.../x` keeps its tail."""
    calls = []
    for method, path in re.findall(r"(?:\b(GET|POST|PUT|PATCH|DELETE)\s+(?:\$REGISTRY)?)?"
                                   r"((?:\$REGISTRY|\.\.\.)?/v1/admin/[\w./{}-]*|\.\.\./[a-z-]+)", text):
        path = path.removeprefix("$REGISTRY").rstrip(".")
        if path.endswith("/v1/admin/"):  # "the admin API (/v1/admin/...)"
            continue
        calls.append((method or None, path))
    for method, path in re.findall(r"curl -X (\w+) \$REGISTRY(/v1/admin/[\w/-]+)", text):
        calls.append((method, path))
    return calls


@pytest.mark.parametrize("readme", [*READMES, *sorted((DEPLOY / "k8s").iterdir()), *sorted((DEPLOY / "systemd").iterdir())],
                         ids=lambda p: p.parent.name + "/" + p.name)
def test_every_admin_call_in_the_readme_is_a_route(readme):
    routes = registry_routes()
    calls = admin_calls(readme.read_text())
    for method, path in calls:
        if path.startswith("..."):
            candidates = [(m, t) for m, t in routes if t.endswith(path.removeprefix("..."))]
        else:
            candidates = [(m, t) for m, t in routes if matches(t, path.replace("NAME", "fra-1"))]
        if method:
            candidates = [(m, t) for m, t in candidates if method in m]
        assert candidates, f"{readme.name}: {method or ''} {path} is not a registry route"


def test_every_probe_asks_a_path_the_process_serves_on_a_port_it_declares():
    router_paths = [r.path for r in create_router_app(SimpleNamespace()).routes if hasattr(r, "path")]
    served = {"registry": [t for _m, t in registry_routes()], "router": router_paths,
              "agent": [metrics_server.PATH.decode()]}
    probes = 0
    for kind, name in (("Deployment", "edgefire-registry"), ("Deployment", "edgefire-router"),
                       ("StatefulSet", "edgefire-agent")):
        for container in pod_spec(kind, name)["containers"]:
            ports = {p["name"] for p in container["ports"]}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in container:
                    get = container[probe]["httpGet"]
                    assert get["port"] in ports, (name, probe)
                    assert any(matches(t, get["path"]) for t in served[container["name"]]), (name, probe, get["path"])
                    probes += 1
    assert probes >= 5


def test_every_file_a_container_reads_is_mounted(tmp_path):
    for kind, name in (("StatefulSet", "edgefire-agent"), ("Deployment", "edgefire-router")):
        spec = pod_spec(kind, name)
        (container,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] | {"subPath": m.get("subPath")} for m in container["volumeMounts"]}
        script = " ".join(container["args"]).replace("$POD_NAME", POD_NAME)
        for path in re.findall(r"(/etc/edgefire/\S+?)(?=\)|\"|\s|$)", script):
            mount = next((m for m in mounts if path == m or path.startswith(m + "/")), None)
            assert mount, f"{name}: {path} is on no volume"
            volume = mounts[mount]
            key = volume["subPath"] or Path(path).name
            if "secret" in volume:
                assert key in find("Secret", volume["secret"]["secretName"])["stringData"], (name, path)
            if "configMap" in volume:
                assert key in find("ConfigMap", volume["configMap"]["name"])["data"], (name, path)
    (agent,) = pod_spec("StatefulSet", "edgefire-agent")["containers"]
    model_mounts = [m["mountPath"] for m in agent["volumeMounts"]]
    checkpoints = tomllib.loads(find("ConfigMap", "edgefire-agent")["data"]["agent.toml"])["models"].values()
    assert all(any(c.startswith(m + "/") for m in model_mounts) for c in checkpoints)


def test_the_agent_scrape_annotation_names_its_metrics_port():
    statefulset = find("StatefulSet", "edgefire-agent")
    (agent,) = statefulset["spec"]["template"]["spec"]["containers"]
    metrics = next(p["containerPort"] for p in agent["ports"] if p["name"] == "metrics")
    assert int(statefulset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == metrics


# -- systemd restart policy, the image -------------------------------------------------------------

def refused_config_status(name: str, tmp_path: Path, monkeypatch) -> int:
    """The status each process exits with when its configuration is refused (bad TOML, no tokens)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \"eighty\"\n")
    for variable in ("EDGEFIRE_ADMIN_TOKEN", "EDGEFIRE_ROUTER_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    argv = {"edgefire-agent": ["agent", "--config", str(bad)],
            "edgefire-router": ["router", "--config", str(bad)],
            "edgefire-registry": ["registry", "serve", "--db", f"sqlite:///{tmp_path}/registry.db"]}[name]
    return main(argv)


@pytest.mark.parametrize("name", ["edgefire-agent", "edgefire-router", "edgefire-registry"])
def test_a_refused_configuration_is_not_restarted_forever(name, tmp_path, monkeypatch):
    prevented = {int(s) for s in unit(name)["RestartPreventExitStatus"].split()}
    status = refused_config_status(name, tmp_path, monkeypatch)
    assert status in prevented
    assert 1 not in prevented  # an agent whose engine died exits 1 to be restarted
    assert unit(name)["Restart"] == "on-failure"


def containerfile_stages() -> list[tuple[str, str, list[tuple[str, list[str]]]]]:
    """(base image, stage name, its instructions as (keyword, words)) per stage, continued lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "container" / "Containerfile").read_text())
    stages = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, *words = shlex.split(line, posix=False)
        if keyword.upper() == "FROM":
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append((words[0], name, []))
        else:
            stages[-1][2].append((keyword.upper(), words))
    return stages


def copies(instructions: list[tuple[str, list[str]]]) -> list[tuple[str | None, list[str], str]]:
    """(stage copied from or None for the build context, sources, destination) of each COPY."""
    found = []
    for keyword, words in instructions:
        if keyword == "COPY":
            stage = next((w.removeprefix("--from=") for w in words if w.startswith("--from=")), None)
            paths = [w for w in words if not w.startswith("--")]
            found.append((stage, paths[:-1], paths[-1]))
    return found


def runs(instructions: list[tuple[str, list[str]]]) -> str:
    return "\n".join(" ".join(words) for keyword, words in instructions if keyword == "RUN")


def test_the_image_holds_every_package_the_install_needs():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    (_base, _name, builder), *_ = containerfile_stages()
    from_context = [source for stage, sources, _dest in copies(builder) if stage is None for source in sources]
    assert packages | {"pyproject.toml", "README.md"} <= set(from_context)
    assert all((ROOT / source).exists() for source in from_context), "a COPY names a path the repository lacks"
    extension_files = [f for ext in pyproject["tool"]["setuptools"]["ext-modules"]
                       for f in ext["sources"] + ext.get("depends", [])]
    assert all(f.split("/")[0] in from_context for f in extension_files)


def test_the_image_compiles_the_engine_extensions_and_ships_no_compiler():
    """Built without a compiler, the optional extensions are skipped and CPU sites decode on the torch path."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extensions = [ext["name"] for ext in pyproject["tool"]["setuptools"]["ext-modules"]]
    stages = containerfile_stages()
    assert len(stages) == 2, "a builder stage compiles the extensions, a runtime stage installs them"
    (_, builder_name, builder), (runtime_base, _, runtime) = stages
    assert re.search(r"apt-get install .*\bbuild-essential\b", runs(builder))
    wheel_dir = re.search(r"pip wheel .*--wheel-dir (\S+) \.", runs(builder)).group(1)
    ((stage, sources, destination),) = [c for c in copies(runtime) if c[0] is not None]
    assert stage == builder_name and sources == [wheel_dir]
    assert re.search(rf"pip install \S*{re.escape(destination)}/edgefire-\*\.whl", runs(runtime))
    assert runtime_base.endswith("-slim") and not re.search(r"build-essential|\bgcc\b|\bclang\b", runs(runtime))
    assert not [c for c in copies(runtime) if c[0] is None], "the runtime stage takes only the built wheel"
    # the image refuses to build when an extension is missing or cannot load after torch
    check = next(line for line in runs(runtime).splitlines() if line.startswith("python -c"))
    imported = re.search(r"import ([\w., ]+)", check).group(1).replace(" ", "").split(",")
    assert imported[0] == "torch" and set(extensions) <= set(imported[1:])


def test_the_image_build_context_leaves_out_what_this_machine_built():
    ignored = (DEPLOY / "container" / "Containerfile.dockerignore").read_text().split()
    assert {"**/*.so", ".venv"} <= set(ignored)


def test_the_readme_lists_every_cluster_file_setting():
    text = (DEPLOY / "README.md").read_text()
    settings = set(ClusterConfig.__dataclass_fields__) - {"model_dir", "sites", "demo_model", "router", "agent",
                                                           "planner_settings"}
    assert {s for s in settings if f"`{s}`" not in text and f"`{s} = " not in text} == set()


# -- the Grafana dashboard's labels ----------------------------------------------------------------

class NoSites:
    """A snapshot cache with no sites: the registry's site gauges without a database."""

    def site_counts(self) -> Counter:
        return Counter()


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
TARGET_LABELS = {"job", "instance"}  # Prometheus adds these to every series it scrapes


def exported_labels() -> dict[str, set[str]]:
    """Sample name -> its label names, for every metric of the three processes (labelled ones with no
    sample yet included)."""
    registry_metrics = RegistryMetrics()
    registry_metrics.follow(NoSites())
    labels = {}
    for registry in (RouterMetrics().registry, registry_metrics.registry, AgentMetrics().registry):
        for collector, names in registry._collector_to_names.items():
            families = [collector] if hasattr(collector, "_labelnames") else list(collector.collect())
            for family in families:
                kind = getattr(family, "_type", None) or family.type
                name = getattr(family, "_name", None) or family.name
                for suffix in SUFFIXES[kind]:
                    labels[name + suffix] = set(family._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return labels


def dashboard_targets(panels: list[dict]):
    for panel in panels:
        yield from dashboard_targets(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel["title"], target


def test_every_label_the_dashboard_uses_is_on_the_metrics_it_queries():
    labels = exported_labels()
    board = json.loads((DEPLOY / "grafana" / "edgefire-fleet.json").read_text())
    checked = 0
    for title, target in dashboard_targets(board["panels"]):
        expr = target["expr"]
        metrics = re.findall(r"\bedgefire_\w+", expr)
        available = set().union(*(labels[m] for m in metrics)) | TARGET_LABELS
        for metric, selector in re.findall(r"\b(edgefire_\w+)\{([^}]*)\}", expr):
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
            assert used <= labels[metric] | TARGET_LABELS, (title, metric, used - labels[metric])
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= available, (title, used - available)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        assert legend <= available, (title, legend - available)
        checked += 1
    assert checked > 20
