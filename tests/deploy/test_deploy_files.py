"""The deployment files agree with the code: every manifest parses, every image is this version's,
every config key is a real AgentConfig/RouterConfig field, every command line parses with the real
`edgefire` parser, and every container port is the port its process is configured to listen on."""

from __future__ import annotations

import configparser
import dataclasses
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from deploy.cluster_config import load_cluster_toml
import typed_config
from node_agent.config import FIELDS as AGENT_FIELDS
from node_agent.config import AgentConfig
from router.config import RouterConfig, config_from_dict

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/edgefire/edgefire:{VERSION}"


def manifests() -> list[dict]:
    documents = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return documents


def find(kind: str, name: str) -> dict:
    return next(d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name)


def containers(kind: str, name: str) -> list[dict]:
    spec = find(kind, name)["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def check_agent_toml(document: dict) -> None:
    typed_config.check_values(AgentConfig, document, "agent.toml")  # raises on unknown or ill-typed settings


def listen_port(address: str) -> int:
    return int(address.rpartition(":")[2])


def edgefire_args(container: dict) -> list[str]:
    """The `edgefire ...` arguments a container runs, through the image's entrypoint or a shell."""
    if container.get("command", [None])[0] == "/bin/sh":
        script = " ".join(container["args"])
        command = script.rpartition("exec edgefire ")[2]
        return shlex.split(command)
    return list(container["args"])


def test_every_manifest_parses_with_kind_and_name():
    documents = manifests()
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "StatefulSet", "ConfigMap", "Secret", "Job",
                                             "Namespace"}
    for document in documents:
        assert document["apiVersion"] and document["metadata"]["name"]


def test_every_container_runs_this_versions_image_with_a_valid_command():
    parser = build_parser()
    workloads = [(d["kind"], d["metadata"]["name"]) for d in manifests()
                 if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]
    assert len(workloads) == 4
    for kind, name in workloads:
        for container in containers(kind, name):
            assert container["image"] == IMAGE
            args = parser.parse_args(edgefire_args(container))  # exits (fails the test) on a bad flag
            assert args.func is not None
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert kustomization["images"][0]["newTag"] == VERSION


def test_containerfile_exposes_the_default_ports():
    text = (DEPLOY / "container" / "Containerfile").read_text()
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    # an agent's KV data port defaults to any free port: the image declares the one the example config fixes
    kv_data_port = tomllib.loads((DEPLOY / "config" / "agent.toml").read_text())["kv_data_port"]
    assert exposed == {8500, RouterConfig().port, listen_port(AGENT_FIELDS["grpc_listen"].default),
                       listen_port(AGENT_FIELDS["metrics_listen"].default), kv_data_port}
    assert 'ENTRYPOINT ["edgefire"]' in text


def test_agent_configmap_keys_and_ports_match_the_statefulset():
    config = tomllib.loads(find("ConfigMap", "edgefire-agent")["data"]["agent.toml"])
    check_agent_toml(config)
    statefulset = find("StatefulSet", "edgefire-agent")
    (agent,) = statefulset["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"grpc": listen_port(config["grpc_listen"]), "kv-data": config["kv_data_port"],
                     "metrics": listen_port(config["metrics_listen"])}
    for variable in agent["env"]:
        if variable["name"].startswith("EDGEFIRE_AGENT_"):
            assert variable["name"].removeprefix("EDGEFIRE_AGENT_").lower() in AGENT_FIELDS
    assert agent["resources"]["limits"]["nvidia.com/gpu"] >= 1
    service = find("Service", "edgefire-agent")
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == "edgefire-agent"
    # every port a peer or router dials is on the Service, under the number the pod listens on
    assert {p["targetPort"]: p["port"] for p in service["spec"]["ports"]} == ports
    grace = statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config["drain_timeout_s"]  # a drain is never cut short by the kubelet


def test_router_configmap_and_token_secret_make_a_valid_router_config():
    config = tomllib.loads(find("ConfigMap", "edgefire-router")["data"]["router.toml"])
    tokens = tomllib.loads(find("Secret", "edgefire-router")["stringData"]["tokens.toml"])
    router = config_from_dict({**config, **tokens})  # refuses unknown keys and ill-typed values
    (container,) = containers("Deployment", "edgefire-router")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": router.port, "metrics": listen_port(router.metrics_listen)}
    annotations = find("Deployment", "edgefire-router")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    assert router.registry_url == "http://edgefire-registry:8500"
    assert "/etc/edgefire/secrets/tokens.toml" in " ".join(container["args"])


def test_registry_reads_its_database_and_tokens_from_a_secret_and_serves_its_port():
    (container,) = containers("Deployment", "edgefire-registry")
    args = build_parser().parse_args(container["args"])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": args.port}
    assert args.db == "$(EDGEFIRE_DB_URL)" and args.no_migrate
    secret_keys = set(find("Secret", "edgefire-registry")["stringData"])
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"]}
    assert set(refs) == {"EDGEFIRE_DB_URL", "EDGEFIRE_ADMIN_TOKEN", "EDGEFIRE_ROUTER_TOKEN", "EDGEFIRE_METRICS_TOKEN"}
    assert all(ref["name"] == "edgefire-registry" and ref["key"] in secret_keys for ref in refs.values())
    service = find("Service", "edgefire-registry")
    assert service["spec"]["ports"][0]["port"] == args.port


def test_every_secret_reference_names_an_example_secret_key():
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for d in manifests() if d["kind"] == "Secret"}
    for document in manifests():
        spec = document.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("containers", []):
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets


@pytest.mark.parametrize("unit", ["edgefire-registry", "edgefire-agent", "edgefire-router"])
def test_systemd_units_run_valid_commands(unit):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(DEPLOY / "systemd" / f"{unit}.service")
    assert parser["Install"]["WantedBy"] == "multi-user.target"
    service = parser["Service"]
    for key in ("ExecStartPre", "ExecStart"):
        if key in service:
            argv = shlex.split(service[key])
            assert argv[0] == "/opt/edgefire/.venv/bin/edgefire"
            assert build_parser().parse_args(argv[1:]).func is not None


def test_example_configs_are_valid(tmp_path):
    agent = tomllib.loads((DEPLOY / "config" / "agent.toml").read_text())
    check_agent_toml(agent)
    router = tomllib.loads((DEPLOY / "config" / "router.toml").read_text())["router"]
    # The GeoIP database is a file on the router's host; here a stand-in, for the router checks it exists.
    assert Path(router["geoip_db"]).is_absolute() and router["geoip_db"].endswith(".mmdb")
    router["geoip_db"] = str(tmp_path / Path(router["geoip_db"]).name)
    Path(router["geoip_db"]).write_bytes(b"")
    config_from_dict(router)
    cluster = load_cluster_toml(DEPLOY / "config" / "cluster.toml", state_dir=Path("/nonexistent"))
    assert [s.role for s in cluster.sites][:3] == ["prefill", "decode", "both"]
    assert {f.name for f in dataclasses.fields(RouterConfig)} >= set(cluster.router)
