"""What a reader copies out of the documentation is taken by this code: every configuration block
(TOML, YAML, JSON) in README.md, deploy/README.md and engine/compression/FORMAT.md goes through the
real loader named by the `<!-- docs-check: ... -->` marker above it (`fragment` for an illustration),
every `setting = value` written inline loads into the config it belongs to (or is refused, where the
text says so), every admin API body an operator is shown is accepted by a live registry, and every
metric the READMEs name is exported with the labels they give it."""

from __future__ import annotations

import json
import re
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import typed_config
from deploy.cluster_config import ClusterConfig
from deploy.tls import LocalCA
from engine.compression.checkpoint import read_manifest
from engine.compression.encoder import compress_tensor
from node_agent.config import AgentConfig
from node_agent.config import load_config as load_agent_config
from node_agent.metrics import AgentMetrics
from registry.metrics import RegistryMetrics
from registry.migrate import upgrade_to_head
from registry.service import create_app
from router.config import RouterConfig
from router.config import load_config as load_router_config
from router.metrics import RouterMetrics
from router.snapshot_feed import FAILURE_REASONS, REGISTRY_OK, REGISTRY_WARMING_UP

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "deploy" / "README.md"]
DOCS = [*READMES, ROOT / "engine" / "compression" / "FORMAT.md"]
CONFIG_LANGUAGES = ("toml", "yaml", "yml", "json")
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 1}
MIXTRAL = {**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2}
# Inline settings whose values are names standing for tokens (the rotation steps' A, P, T): only their
# keys are checked.
SYMBOLIC_VALUE = re.compile(r"^(?:\[?\s*(?:sha256\(\w+\)|[A-Z]\d?)\s*(?:,\s*(?:sha256\(\w+\)|[A-Z]\d?)\s*)*\]?)$")
# Inline settings the text shows being refused.
REFUSED = {'max_attempts = "3"'}


# -- fenced configuration blocks --------------------------------------------------------------------

def fenced_blocks(text: str) -> list[tuple[str | None, str, str]]:
    """(marker, language, body) of every fenced block in a configuration language."""
    blocks = []
    for marker, language, body in re.findall(r"(?:<!--\s*docs-check:\s*([^>]*?)\s*-->\s*\n)?[ \t]*```(\w*)\n(.*?)```",
                                             text, re.S):
        if language in CONFIG_LANGUAGES:
            blocks.append((marker or None, language, body))
    return blocks


def check_compression_manifest(body: str, tmp_path: Path) -> None:
    (tmp_path / "compression.json").write_text(body)
    manifest = read_manifest(tmp_path)
    assert manifest.source_weights is None or all(w.count(":") == 2 for w in manifest.source_weights), \
        "source_weights entries are name:size:content digest"


def check_tensor_record(body: str, tmp_path: Path) -> None:
    record = json.loads(body)   # its checksums are elided ("9f2c..."): its keys and their types are checked
    tensor = compress_tensor("w", torch.randn(64, 64).to(torch.bfloat16))
    written = json.loads(json.dumps(tensor.record()))
    assert {k: type(v) for k, v in record.items()} == {k: type(v) for k, v in written.items()}


def check_router_toml(body: str, tmp_path: Path) -> None:
    (tmp_path / "router.toml").write_text(body)
    load_router_config(tmp_path / "router.toml")


def check_agent_toml(body: str, tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(body)
    load_agent_config(tmp_path / "agent.toml", environ={})


CHECKERS = {"compression.json": check_compression_manifest, "compressed tensor record": check_tensor_record,
            "router": check_router_toml, "agent": check_agent_toml}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_block_loads_with_the_loader_its_marker_names(doc, tmp_path):
    for marker, language, body in fenced_blocks(doc.read_text()):
        assert marker is not None, (f"{doc.name}: a ```{language} block has no <!-- docs-check: NAME --> marker "
                                    f"(one of {', '.join(CHECKERS)}, or fragment):\n{body[:200]}")
        if marker == "fragment":
            continue
        assert marker in CHECKERS, f"{doc.name}: unknown docs-check marker {marker!r}"
        CHECKERS[marker](body, tmp_path)


def test_the_format_document_checks_its_blocks():
    markers = [m for m, _l, _b in fenced_blocks((ROOT / "engine" / "compression" / "FORMAT.md").read_text())]
    assert markers == ["compression.json", "compressed tensor record"]


# -- inline settings --------------------------------------------------------------------------------

def inline_settings(text: str) -> list[tuple[str, str | None]]:
    """(`key = value` snippet, the `[table]` named just before it, if any)."""
    found = []
    for match in re.finditer(r"`([\"\w]+ = [^`\n]+)`", text):
        table = re.findall(r"`\[(\w+)\]`", text[max(0, match.start() - 120):match.start()])
        found.append((match.group(1), table[-1] if table else None))
    return found


def tls_files(tmp_path: Path) -> dict[str, str]:
    ca = LocalCA("edgefire docs test CA")
    cert, key = ca.issue("docs", ["127.0.0.1"])
    paths = {"tls_ca": tmp_path / "ca.pem", "tls_cert": tmp_path / "cert.pem", "tls_key": tmp_path / "key.pem"}
    for name, data in (("tls_ca", ca.cert_pem), ("tls_cert", cert), ("tls_key", key)):
        paths[name].write_bytes(data)
    return {name: str(path) for name, path in paths.items()}


def load_as_router(values: dict, tls: dict[str, str]) -> RouterConfig:
    extra = tls if "metrics_tls" in values or "agent_tls" in values else {}
    return typed_config.build(RouterConfig, typed_config.check_values(RouterConfig, {**extra, **values}, "docs"),
                              "docs")


def load_as_agent(values: dict, tls: dict[str, str], tmp_path: Path) -> AgentConfig:
    models = {}
    for name in ("llama", *values.get("model_parallel", {})):
        models[name] = str(tmp_path / name)
        Path(models[name]).mkdir(exist_ok=True)
        (Path(models[name]) / "config.json").write_text(json.dumps(MIXTRAL if name == "mixtral" else LLAMA))
    base = {"site": "fra-1", "peer_token": "peer", "models": models, **(tls if "metrics_tls" in values else {})}
    return typed_config.build(AgentConfig, typed_config.check_values(AgentConfig, {**base, **values}, "docs"),
                              "docs")


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_inline_setting_names_a_setting_and_loads(readme, tmp_path):
    tls = tls_files(tmp_path)
    owners = {"router": set(typed_config.fields_of(RouterConfig)), "agent": set(typed_config.fields_of(AgentConfig)),
              "cluster": set(ClusterConfig.__dataclass_fields__)}
    checked = 0
    for snippet, table in inline_settings(readme.read_text()):
        key, value = (part.strip() for part in snippet.split("=", 1))
        if key.startswith('"'):   # an entry of the [table] named before it
            assert table in owners["agent"] | owners["router"], f"{snippet!r}: no [table] setting names it"
            snippet, key = f"{table} = {{ {snippet} }}", table
        kinds = [kind for kind, fields in owners.items() if key in fields]
        assert kinds, f"{readme.name}: `{snippet}`: {key} is no router, agent or cluster setting"
        if SYMBOLIC_VALUE.match(value):
            continue
        values = tomllib.loads(snippet)
        for kind in kinds:
            if snippet in REFUSED:
                with pytest.raises(typed_config.ConfigError, match=key):
                    load_as_router(values, tls) if kind == "router" else load_as_agent(values, tls, tmp_path)
            elif kind == "router":
                assert getattr(load_as_router(values, tls), key) == values[key]
            elif kind == "agent":
                assert getattr(load_as_agent(values, tls, tmp_path), key) == values[key]
            else:
                assert isinstance(values[key], type(ClusterConfig.__dataclass_fields__[key].default))
        checked += 1
    assert checked >= 3


# -- admin API bodies -------------------------------------------------------------------------------

ADMIN = "docs-admin-token"


def admin_calls_with_bodies(text: str) -> list[tuple[str, str, dict]]:
    """(method, path, body) of every admin call a README shows with a JSON body, in reading order."""
    calls = []
    for match in re.finditer(r"curl -X (\w+) \$REGISTRY(/v1/admin/[\w/-]+)((?:[^\n]|\\\n)*?)-d '([^']*)'|"
                             r"`(POST|PUT|PATCH) \.\.\.(/[\w-]+) (\{[^`]*\})`", text):
        if match.group(1):
            calls.append((match.group(1), match.group(2), json.loads(match.group(4))))
        else:
            calls.append((match.group(5), "/v1/admin/sites/NAME" + match.group(6), json.loads(match.group(7))))
    return calls


def test_every_admin_body_in_the_deploy_readme_is_accepted(tmp_path):
    calls = admin_calls_with_bodies((ROOT / "deploy" / "README.md").read_text())
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _b in calls] == [
        ("POST", "sites"), ("POST", "tokens"), ("POST", "api-keys"), ("POST", "drain")]
    db_url = f"sqlite:///{tmp_path / 'registry.db'}"
    upgrade_to_head(db_url)
    site = None
    with TestClient(create_app(db_url, ADMIN, "docs-router-token")) as client:
        for method, path, body in calls:
            site = body.get("name", site) if path.endswith("/sites") else site
            answer = client.request(method, path.replace("NAME", site), json=body,
                                    headers={"Authorization": f"Bearer {ADMIN}"})
            assert answer.status_code < 300, (method, path, body, answer.text)
            if path.endswith("/tokens"):   # the README shows what comes back: the site and its token
                assert answer.json()["site"] == site and answer.json()["token"].startswith("efs-")
            if path.endswith("/api-keys"):
                assert answer.json()["key"].startswith("ef-")


# -- metric names -----------------------------------------------------------------------------------

class NoSites:
    def site_counts(self) -> Counter:
        return Counter()


def exported() -> dict[str, set[str]]:
    """Sample name (counters with `_total`) -> its label names, for the router's, registry's and agent's metrics."""
    registry_metrics = RegistryMetrics()
    registry_metrics.follow(NoSites())
    names = {}
    for registry in (RouterMetrics().registry, registry_metrics.registry, AgentMetrics().registry):
        for collector in registry._collector_to_names:
            for family in [collector] if hasattr(collector, "_labelnames") else list(collector.collect()):
                kind = getattr(family, "_type", None) or family.type
                name = (getattr(family, "_name", None) or family.name) + ("_total" if kind == "counter" else "")
                names[name] = set(getattr(family, "_labelnames", ()))
    return names


def named_metrics(text: str) -> list[tuple[str, set[str] | None]]:
    """(metric name, labels shown or None) for every metric a README names. Within a paragraph, `_x` after
    `edgefire_<process>_...` stands for `edgefire_<process>_x`, and `a_{b,c}_d` for `a_b_d` and `a_c_d`."""
    found = []
    for paragraph in re.split(r"\n\s*\n|\n- ", text):
        prefix = None
        for name, alternatives, tail, labels in re.findall(r"`(edgefire_\w*|_\w+)(?:\{([\w,]+)\}(\w+))?(\{[^`]*\})?`",
                                                           paragraph):
            if name.startswith("edgefire_"):
                prefix = "_".join(name.split("_")[:2])
            elif prefix is None:
                continue
            else:
                name = prefix + name
            shown = None
            if labels:
                shown = {part.split("=")[0].strip() for part in labels.strip("{}").split(",") if part.strip()}
            for choice in alternatives.split(",") if alternatives else [""]:
                found.append((name + choice + tail, shown))
    return found


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_metric_the_readme_names_is_exported_with_its_labels(readme):
    metrics = exported()
    shown = [(n, labels) for n, labels in named_metrics(readme.read_text()) if n.count("_") > 1]
    assert len(shown) > 3
    for name, labels in shown:
        assert name in metrics, f"{readme.name}: {name} is not exported"
        if labels is not None:
            assert labels <= metrics[name], f"{readme.name}: {name} has no label(s) {sorted(labels - metrics[name])}"


def test_the_readme_lists_every_registry_state_and_refresh_failure_the_router_reports():
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    states = re.search(r"says so: `registry` \(([^)]*)\)", text).group(1)
    assert set(re.findall(r"`(\w+)`", states)) == {REGISTRY_OK, REGISTRY_WARMING_UP, *FAILURE_REASONS}
    reasons = re.search(r"`_snapshot_failures_total\{reason\}` \(([^)]*)\)", text).group(1)
    assert {reason.strip() for reason in reasons.split(",")} == set(FAILURE_REASONS)
