"""The provisional allowance against the real registry store (registry/allowance.py, the third way
over the limit): routers whose clients come back to a key after a long idle admit their first
requests before the registry answers, even while a busy router keeps the key's window full, and a
window still holds at most L + Σ_r ⌊L / (8 n)⌋."""

from __future__ import annotations

from registry.allowance import provisional_allowance
from tests.registry import test_allowance_bound as bound

store, keys = bound.store, bound.keys   # the bound simulation's fixtures


def test_keys_back_after_a_long_idle_go_over_by_at_most_the_routers_allowances(store, clock, keys):
    limit = 64
    limits = {"rpm": (limit, None)}
    sim = bound.Simulation(store, clock, keys(**limits), limits, seed=6)
    sim.add_router("busy", 5.0)                  # keeps the window full
    for i in range(3):
        sim.add_router(f"idle{i}", 1 / 100)      # most of their requests come after a minute or more without one
    sim.run(600.0)
    num_routers = len(sim.routers)
    assert all(r.limiter.live_routers == num_routers for r in sim.routers.values())
    assert sum(r.limiter.num_provisional_admissions for name, r in sim.routers.items() if name != "busy") >= 3
    assert sim.worst_window("rpm")[0] <= limit + num_routers * provisional_allowance(limit, num_routers)
    assert sim.admitted_between("rpm", 60, 120) >= limit * 0.9   # the busy router still gets the window
