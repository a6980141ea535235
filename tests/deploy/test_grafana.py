"""deploy/grafana: every metric the Grafana dashboard queries is one the router, registry or agent
exports (names as Prometheus scrapes them), every metric they export is on it, and the panels are
well formed."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import yaml

from node_agent.metrics import AgentMetrics
from registry.metrics import RegistryMetrics
from router.metrics import RouterMetrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
METRIC = re.compile(r"\bedgefire_[a-z0-9_]+\b")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


class NoSites:
    """A snapshot cache with no sites: the registry's site gauges without a database."""

    def site_counts(self) -> Counter:
        return Counter()


def exported() -> dict[str, str]:
    """Sample name -> family name, for every metric of the three processes."""
    registry_metrics = RegistryMetrics()
    registry_metrics.follow(NoSites())
    names = {}
    for registry in (RouterMetrics().registry, registry_metrics.registry, AgentMetrics().registry):
        for family in registry.collect():
            for suffix in SUFFIXES[family.type]:
                names[family.name + suffix] = family.name
    return names


def dashboard() -> dict:
    return json.loads((GRAFANA / "edgefire-fleet.json").read_text())


def queries(panels: list[dict]):
    for panel in panels:
        yield from queries(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_every_metric_the_dashboard_queries_is_exported():
    names = exported()
    unknown = [(title, name) for title, expr in queries(dashboard()["panels"]) for name in METRIC.findall(expr)
               if name not in names]
    assert unknown == []


def test_every_exported_metric_is_on_the_dashboard():
    shown = {name for _title, expr in queries(dashboard()["panels"]) for name in METRIC.findall(expr)}
    families_shown = {family for sample, family in exported().items() if sample in shown}
    assert set(exported().values()) - families_shown == set()


def test_panels_are_well_formed():
    board = dashboard()
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource"}
    for panel in panels:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]"), (panel["title"], expr)
            assert not re.search(r"rate\(edgefire_\w+(?<!_total)(?<!_bucket)(?<!_sum)(?<!_count)\[", expr), \
                f"{panel['title']}: rate() of a gauge"


def test_link_legends_point_the_way_the_bytes_went():
    # an agent's peer-labelled figures are measured pulling from that peer: bytes go peer -> instance
    legends = {target["legendFormat"] for panel in dashboard()["panels"] for target in panel.get("targets", [])
               if "peer" in target["legendFormat"]}
    assert legends and all(legend.startswith("{{peer}} → {{instance}}") for legend in legends), legends


def test_the_prometheus_example_scrapes_every_process_where_it_serves_metrics():
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"edgefire-registry", "edgefire-routers", "edgefire-agents"}
    assert jobs["edgefire-registry"]["authorization"]["credentials_file"]  # the registry's /metrics needs a token
    assert all(target.endswith(":8500") for target in jobs["edgefire-registry"]["static_configs"][0]["targets"])
