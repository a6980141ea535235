"""Split placement through the real stack: a prefill site and a different decode site serve one
request (KV moved between two processes), with the same tokens as a colocated run."""

from __future__ import annotations

from tests.e2e.conftest import BOTH, DECODE_ONLY, PREFILL_ONLY, complete, prompt_ids, settle, stream


def only(cluster, *active: str) -> None:
    """Cordons every site but `active`, so placement has exactly one pair to choose."""
    admin = cluster.admin()
    for site in cluster.config.sites:
        (admin.uncordon if site.name in active else admin.cordon)(site.name)
    settle(cluster)


def uncordon_all(cluster) -> None:
    only(cluster, *(s.name for s in cluster.config.sites))


def test_split_run_equals_colocated_run(cluster, http):
    prompt = prompt_ids(70, start=11)  # several KV blocks to move
    try:
        only(cluster, PREFILL_ONLY, DECODE_ONLY)
        split = complete(http, cluster, prompt, 24)
        split_streamed = stream(http, cluster, prompt_ids(70, start=12), 24)
        only(cluster, BOTH)
        colocated = complete(http, cluster, prompt, 24)
        colocated_streamed = stream(http, cluster, prompt_ids(70, start=12), 24)
    finally:
        uncordon_all(cluster)
    assert split.sites == (PREFILL_ONLY, DECODE_ONLY) == split_streamed.sites
    assert colocated.sites == (BOTH, BOTH) == colocated_streamed.sites
    assert split.text == colocated.text
    assert split.usage["completion_tokens"] == colocated.usage["completion_tokens"]
    assert split_streamed.text == colocated_streamed.text
    assert split_streamed.usage == colocated_streamed.usage


def test_cordoned_site_gets_no_new_requests(cluster, http):
    try:
        cluster.admin().cordon(BOTH)
        settle(cluster)
        served = [complete(http, cluster, prompt_ids(20, start=i), 4).sites for i in range(6)]
    finally:
        uncordon_all(cluster)
    assert all(BOTH not in pair for pair in served)
    assert set(served) == {(PREFILL_ONLY, DECODE_ONLY)}
    assert cluster.site_alive(BOTH)  # cordoned is not down: it kept heartbeating
