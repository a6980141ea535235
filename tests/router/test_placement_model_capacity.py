"""Placement on sites hosting several models: each model's own KV pool and prefix cache count, not the
site's sums (registry.wire.SnapshotCapacity.own); sites that report only sums are read as before."""

from __future__ import annotations

from engine.prefix_hash import prefix_hashes
from router.placement import CostModel, PlacementRequest, rank
from router.snapshot import parse_snapshot

PARIS, FRANKFURT, AMSTERDAM = (48.86, 2.35), (50.11, 8.68), (52.37, 4.90)
PROMPT = list(range(1, 2001))


def summary(prompt: list[int] = ()) -> dict:
    return {"block_size": 16, "hashes": [f"{h:016x}" for h in prefix_hashes(list(prompt), 16)]}


def site(name, where, served=("a", "b"), total=1000, free=1000, **capacity):
    """A live site serving `served`; `models=` in `capacity`: each model's own figures."""
    return {"name": name, "region": "eu", "country": "XX", "lat": where[0], "lon": where[1],
            "grpc_address": f"{name}:50051", "state": "active", "roles": ["prefill", "decode"],
            "models": [{"model": model, "role": "both"} for model in served], "alive": True, "heartbeat_age_s": 1.0,
            "capacity": {"kv_blocks_total": total, "kv_blocks_free": free, "block_size": 16,
                         "prefix_cache_summary": None, "draining": False, **capacity}}


def own(total: int, free: int, prompt: list[int] = ()) -> dict:
    return {"kv_blocks_total": total, "kv_blocks_free": free, "prefix_cache_summary": summary(prompt)}


def place(model: str, *sites, where=PARIS, prompt=PROMPT):
    snapshot = parse_snapshot({"version": "1", "generated_at": 0.0, "sites": list(sites), "links": []})
    request = PlacementRequest(model, prompt, 128, where[0], where[1])
    return rank(snapshot, request, CostModel(allow_split=False))


def test_a_full_pool_of_one_model_sends_it_elsewhere_and_the_other_model_still_comes():
    # par's pool for a is full, its pool for b empty: the sums (1000 free of 2000) hid both facts
    par = site("par", PARIS, total=2000, free=1000, models={"a": own(1000, 0), "b": own(1000, 1000)})
    fra = site("fra", FRANKFURT)
    assert [c.site_names for c in place("a", par, fra)] == [("fra", "fra")]
    assert place("b", par, fra)[0].site_names == ("par", "par")


def test_a_prefix_cached_for_one_model_attracts_only_that_models_requests():
    # fra holds the prompt in a's cache; ams, nearer the client, holds nothing
    fra = site("fra", FRANKFURT, total=2000, free=2000, prefix_cache_summary=summary(),
               models={"a": own(1000, 1000, PROMPT), "b": own(1000, 1000)})
    ams = site("ams", AMSTERDAM)
    for_a, for_b = place("a", fra, ams)[0], place("b", fra, ams)[0]
    # 1984: the engine reuses the 124 whole blocks before the one holding the last of the 2,000 tokens
    assert (for_a.site_names, for_a.num_cached_tokens) == (("fra", "fra"), 1984)
    assert (for_b.site_names, for_b.num_cached_tokens) == (("ams", "ams"), 0)


def test_a_site_reporting_only_sums_is_read_as_before():
    # an agent older than per-model figures (or a single-model site): the sums and the one summary count
    cached = site("fra", FRANKFURT, served=("a",), free=1000, prefix_cache_summary=summary(PROMPT))
    chosen = place("a", cached, site("ams", AMSTERDAM, served=("a",)))[0]
    assert (chosen.site_names, chosen.num_cached_tokens) == (("fra", "fra"), 1984)
    full = site("par", PARIS, served=("a",), free=0)
    assert [c.site_names for c in place("a", full, site("ams", AMSTERDAM, served=("a",)))] == [("ams", "ams")]


def test_a_model_the_site_does_not_report_apart_takes_the_sites_figures():
    # e.g. an operator added a to the site's models: its agent reports only c apart
    par = site("par", PARIS, served=("a", "c"), total=2000, free=0, models={"c": own(1000, 1000)})
    assert [c.site_names for c in place("a", par, site("fra", FRANKFURT))] == [("fra", "fra")]


def test_fields_a_newer_registry_adds_to_a_models_figures_are_ignored():
    par = site("par", PARIS, total=2000, free=1000, models={"a": {**own(1000, 0), "kv_bytes_free": 1},
                                                            "b": own(1000, 1000)})
    assert [c.site_names for c in place("a", par, site("fra", FRANKFURT))] == [("fra", "fra")]
