"""The whole cluster over TLS (`edgefire up --tls`): the checks that matter, run again on a second
cluster whose every hop is encrypted — HTTPS to registry and router, gRPC and the KV data port with
client certificates. Its own cluster, started here, after the plaintext run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from deploy.cluster import banner
from deploy.launcher import Cluster
from node_agent.tls import client_context
from tests.e2e.conftest import DECODE_ONLY, LongPrompt, cluster_config, prompt_ids, router_client
from tests.e2e.test_01_openai_api import test_chat_streamed_equals_not_streamed as check_chat_streamed
from tests.e2e.test_02_placement import test_split_run_equals_colocated_run as check_split_run
from tests.e2e.test_03_faults import test_decode_site_killed_mid_stream_resumes_elsewhere as check_decode_resume
from tests.e2e.test_04_operations import test_every_agents_kv_blocks_are_free_after_the_run as check_no_kv_left


@pytest.fixture(scope="module")
def tls_cluster(endless_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    cluster = Cluster(cluster_config(endless_model_dir, tmp_path_factory.mktemp("tls-cluster"), tls=True))
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


@pytest.fixture
def tls_http(tls_cluster) -> Iterator[httpx.Client]:
    with router_client(tls_cluster) as client:
        yield client


def test_openai_client_over_https_with_the_cluster_ca(tls_cluster):
    assert tls_cluster.router_url.startswith("https://") and tls_cluster.registry_url.startswith("https://")
    with httpx.Client(verify=client_context(str(tls_cluster.ca_path))) as http, \
            openai.OpenAI(base_url=tls_cluster.router_url + "/v1", api_key=tls_cluster.api_key, max_retries=0,
                          timeout=60.0, http_client=http) as client:
        check_chat_streamed(client, tls_cluster)


def test_plaintext_and_unverified_clients_are_refused(tls_cluster):
    headers = {"Authorization": f"Bearer {tls_cluster.api_key}"}
    for url in (tls_cluster.router_url, tls_cluster.registry_url):
        with pytest.raises(httpx.HTTPError):  # HTTP spoken to the HTTPS port
            httpx.get(url.replace("https://", "http://") + "/healthz", headers=headers, timeout=5.0)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the cluster's CA
            httpx.get(url + "/healthz", timeout=5.0)


def test_split_run_over_tls_moves_kv_over_the_tls_data_port(tls_cluster, tls_http):
    check_split_run(tls_cluster, tls_http)
    with tls_cluster.http_client(timeout=5.0) as http:  # /metrics over HTTPS too
        decode_metrics = http.get(tls_cluster.metrics_url(DECODE_ONLY)).text
    received = re.search(r"^edgefire_agent_kv_bytes_received_total (\S+)", decode_metrics, re.M)
    fallbacks = re.search(r"^edgefire_agent_kv_transfer_fallbacks_total (\S+)", decode_metrics, re.M)
    assert float(received.group(1)) > 0 and float(fallbacks.group(1)) == 0  # KV moved, none recomputed
    log = tls_cluster.processes[DECODE_ONLY].log_path.read_text(errors="replace")
    assert "using FetchKV" not in log  # the TLS data port carried it, not the gRPC fallback


def test_decode_site_killed_mid_stream_resumes_over_tls(tls_cluster, tls_http):
    check_decode_resume(tls_cluster, tls_http, LongPrompt(prompt_ids(40, start=171), reference=None))


def test_no_kv_blocks_left_after_the_tls_run(tls_cluster):
    check_no_kv_left(tls_cluster)


def test_keys_in_the_state_dir_are_private(tls_cluster):
    keys = sorted((tls_cluster.state_dir / "tls").glob("*-key.pem"))
    assert len(keys) == len(tls_cluster.config.sites) + 2  # each site, the registry and the router
    assert {os.stat(key).st_mode & 0o777 for key in keys} == {0o600}


def test_the_banners_examples_work_with_its_ca(tls_cluster):
    """`edgefire up --tls` prints the CA bundle and a curl and a python example that use it: both work."""
    text = banner(tls_cluster, 0.0)
    assert f"CA bundle     {tls_cluster.ca_path}" in text
    python_example = text.split("python - <<'EOF'\n")[1].split("\nEOF")[0]
    answer = subprocess.run([sys.executable, "-c", python_example], capture_output=True, text=True, timeout=60)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
    curl_example = text.split("Try it:\n")[1].split("\n\n")[0].replace("\\\n", " ")
    assert f"--cacert {tls_cluster.ca_path}" in curl_example
    if shutil.which("curl"):
        streamed = subprocess.run(["sh", "-c", curl_example], capture_output=True, text=True, timeout=60)
        assert streamed.returncode == 0 and "data: [DONE]" in streamed.stdout, streamed.stderr


def test_status_verifies_the_registry_with_the_clusters_ca(tls_cluster):
    status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", "--state-dir", str(tls_cluster.state_dir)],
                            capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k != "EDGEFIRE_ADMIN_TOKEN"})  # cluster.json's
    assert status.returncode == 0, status.stderr
    assert all(site.name in status.stdout for site in tls_cluster.config.sites)
