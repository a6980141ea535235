"""Placement reports: what routers placed adds up per pair across routers, is read back for a
window of recent minutes (the dashboard's arcs), forgets deleted sites and old windows."""

from __future__ import annotations

import pytest

from registry.client import RegistryError
from registry.placements import RETAIN_S

from .conftest import ROUTER_TOKEN


def pairs(reply: dict) -> dict:
    return {(p["prefill_site"], p["decode_site"]): p["num_requests"] for p in reply["pairs"]}


async def test_reports_from_routers_add_up_per_pair(admin, connect, clock):
    for name in ("lis", "fra", "waw"):
        await admin.create_site(name)
    router_a, router_b = connect(ROUTER_TOKEN), connect(ROUTER_TOKEN)
    assert (await router_a.report_placements([{"prefill_site": "lis", "decode_site": "fra", "num_requests": 3},
                                              {"prefill_site": "waw", "decode_site": "waw", "num_requests": 1}]))\
        == {"stored": 2}
    clock.advance(30)
    await router_b.report_placements([{"prefill_site": "lis", "decode_site": "fra", "num_requests": 2},
                                      {"prefill_site": "lis", "decode_site": "gone", "num_requests": 5}])
    assert pairs(await admin.placements(300)) == {("lis", "fra"): 5, ("waw", "waw"): 1}
    assert pairs(await admin.placements(15)) == {("lis", "fra"): 2}  # only the newest window
    newest = (await admin.placements(300))["pairs"][0]
    assert newest["last_at"] >= clock.now - 10

    await admin.delete_site("waw")
    assert pairs(await admin.placements(300)) == {("lis", "fra"): 5}
    clock.advance(RETAIN_S + 60)
    await router_a.report_placements([])  # a report prunes what is past keeping
    assert pairs(await admin.placements(RETAIN_S)) == {}


async def test_bad_reports_and_callers_are_refused(admin, connect):
    await admin.create_site("lis")
    router = connect(ROUTER_TOKEN)
    for bad in ([{"prefill_site": "lis", "decode_site": "lis", "num_requests": 0}],
                [{"prefill_site": "lis", "decode_site": "lis"}],
                [{"prefill_site": "lis", "decode_site": "lis", "num_requests": 1, "extra": 1}]):
        with pytest.raises(RegistryError) as err:
            await router.report_placements(bad)
        assert err.value.status == 422
    with pytest.raises(RegistryError) as err:
        await admin.report_placements([])
    assert err.value.status == 403
    with pytest.raises(RegistryError) as err:
        await admin.placements(0)
    assert err.value.status == 422
