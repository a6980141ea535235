"""The agent's heartbeat is built with the wire contract the registry validates (registry.wire)."""

from __future__ import annotations

from engine.engine import EngineStats
from node_agent.heartbeat import capacity_report
from registry.wire import MAX_CACHE_HASHES, CapacityReport


def stats(blocks_free: int, running: int, rate: float, **layout) -> EngineStats:
    return EngineStats(num_blocks_total=100, num_blocks_free=blocks_free, block_size=16, num_running=running,
                       num_waiting=1, num_pinned_handles=0, inflight_prefill_tokens=40, inflight_decode_tokens=7,
                       prefill_tokens_per_s=rate, decode_tokens_per_s=rate / 10, decode_batch_size=running + 0.5,
                       decode_kv_tokens=100.0 * running, num_preemptions=0,
                       prefix_cache_hit_tokens=0, **layout)


def test_report_sums_engines_and_caps_the_hash_list():
    hashes = [f"{i:016x}" for i in range(MAX_CACHE_HASHES + 500)]
    report = capacity_report(16, False, [stats(60, 2, 1000.0), stats(30, 3, 500.0)], hashes)
    wire = report.to_json()
    assert (wire["kv_blocks_total"], wire["kv_blocks_free"], wire["num_running"], wire["num_waiting"]) == (200, 90, 5, 2)
    assert wire["prefill_tokens_per_s"] == 1500.0 and wire["inflight_decode_tokens"] == 14
    assert (wire["decode_batch_size"], wire["decode_kv_tokens"]) == (6.0, 500.0)  # the rate's load, summed too
    assert wire["prefix_cache_summary"]["hashes"] == hashes[:MAX_CACHE_HASHES]  # most recently used kept
    assert CapacityReport.model_validate_json(report.model_dump_json()) == report  # what the registry accepts


def test_a_site_without_engines_reports_empty_capacity():
    wire = capacity_report(16, True, [], []).to_json()
    assert (wire["kv_blocks_total"], wire["draining"], wire["prefix_cache_summary"]) == (
        0, True, {"block_size": 16, "hashes": []})


def test_report_names_the_devices_and_layout():
    engines = [stats(1, 1, 1.0, num_gpus=4, gpu_indices=(0, 1, 2, 3), tensor_parallel_size=2,
                     pipeline_parallel_size=2, expert_parallel_size=2)] * 2
    # two engines on the same four GPUs: the site has four, not eight
    wire = capacity_report(16, False, engines, []).to_json()
    assert (wire["num_gpus"], wire["tensor_parallel_size"], wire["pipeline_parallel_size"],
            wire["expert_parallel_size"]) == (4, 2, 2, 2)


def test_report_carries_the_share_of_proposals_kept_over_every_engine():
    engines = [stats(60, 2, 1000.0), stats(30, 3, 500.0), stats(30, 3, 500.0)]
    engines[0].num_draft_tokens, engines[0].num_accepted_draft_tokens = 300, 240
    engines[1].num_draft_tokens, engines[1].num_accepted_draft_tokens = 100, 20
    assert capacity_report(16, False, engines, []).to_json()["speculative_acceptance"] == 260 / 400
    assert capacity_report(16, False, engines[2:], []).to_json()["speculative_acceptance"] == 0.0
