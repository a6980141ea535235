"""Global per-key rate limits across routers: how much each router may admit until its next report.

The limit. A key's `requests_per_minute` and `tokens_per_minute` (each a limit L) bound what the key
is admitted in any 60 seconds, summed over every router: a sliding window, not a bucket that refills.
A request is charged when it is admitted: one request, and prompt + max_tokens tokens (the most it
can use); the tokens it did not use are given back when it ends, against the second it was charged in.

Who knows what. Routers admit locally, with no database round trip per request, and report about
every second what they charged per key and per second of their own clock (a `slot`), give-backs
included (router/rate_limit.py, router/fleet_reporter.py). The registry adds those up per key and
slot in SQL (`rate_usage`), so every replica sees the same window, and answers each report with the
router's *grant* per key: what it may admit from the moment it sent the report until its next one.

The grant (`allowance`). At a report at time t, for one key, one limit and the reporting router r:

    used   = Σ rate_usage over the slots ≥ floor(t) − 60   (the 61 slots a charge of the last 60 s can be in)
    held   = Σ the other routers' holds (below)
    free   = L − used
    share  = ⌈free · demand_r / Σ demand⌉    (demand: what each router was asked for lately; live routers only)
    floor  = ⌊(free − held) / (2 · n)⌋       (n: the routers that reported in the last LIVE_ROUTER_S)
    grant  = max(0, min(max(min(share, ⌈2 · demand_r⌉), floor), free − held))

and r's hold becomes max(grant, remaining_r), remaining_r being what r still had of its previous
grant when it sent the report (it may spend that until the answer comes). Reports that touch a key
are serialised on the key's row.

The router's side. When an answer arrives, the router's budget is the grant minus what it charged
since it sent that report; each admission takes from the budget and nothing is admitted beyond it;
a give-back returns to the budget only for a charge made since that report was sent (the grant was
computed before it existed); any other give-back is reported and lowers `used` at the next report.
So what a router charged and has not reported yet is always within its hold.

The bound, while the registry answers: in any 60 s window a key is admitted at most L, plus the
routers' provisional admissions (the third way over, below). The registry keeps, for every key and
limit, at every moment,

    used + Σ holds ≤ L,  and each router's unreported charges ≤ its hold.                     (I)

A report replaces the reporter's hold h with max(g, ρ) and adds what it carries (c) to `used`. As
c + ρ ≤ h (the budget that c was charged against was h less earlier charges) and g ≤ free − held by
construction, (I) holds after it; time only takes slots out of `used`. At any time t, a charge made
in (t − 60, t] is either reported, and then in `used` (its slot is ≥ floor(t) − 60), or not, and then
within its router's hold: the window's total is at most used + Σ holds ≤ L.

Holds outlive their routers on purpose. A hold stops counting toward `demand` GRANT_TTL_S after the
report that set it (a router that has not reported since is not asking), but keeps counting in `held`
for another WINDOW_SLOTS seconds: a router that died (kill -9, a lost machine) may have charged its
whole last grant without reporting it, and those charges stay inside some window for that long. A
router stops using a grant GRANT_TTL_S after it *sent* the report that brought it, before the
registry stops counting the hold. The price is that a dead router's last hold is not handed out again
for about a minute.

Where it can go over, and by how much:
1. Clocks: slots come from the routers' clocks, the window from the registry's. A router whose clock
   runs δ s behind sees its charges leave the window δ s early: at most its admissions of δ s more.
   (NTP keeps δ at milliseconds; slots stamped in the future are taken as now.)
2. No registry: a router that has had no answer for GRANT_TTL_S admits from its own window alone, up to
   L / n, n the live routers the registry last counted (router/rate_limit.py). A window that lies
   wholly in such a stretch admits at most L · (routers really live) / n; a window that straddles the
   switch less than 2L (routers may have spent whole grants just before).
3. Provisional admissions: a router admits a key it holds no grant for (its first request there, or
   the first after the key was given back idle) without waiting for the registry, up to
   P = `provisional_allowance(L, n)` = ⌊L / (PROVISIONAL_SPLIT · n)⌋ of its own charges of the key in
   any window, n the live routers at that router's last answer (router/rate_limit.py; none before its
   first answer, and none for a window after an answer that found the key's window more than half
   used). Those charges are reported like any other, but nothing held them: the registry learns of
   them after they were admitted. So a window holds at most L + Σ_r P_r ≤ L + L / PROVISIONAL_SPLIT
   (9L / 8) when each router's n is at least the routers live. Only a provisional admission that
   meets a window already full goes over, which the half-used rule makes rare: it takes a key busy
   at other routers that this router has heard nothing about for a window. Meanwhile the grant
   request goes out in the router's next report, and its answer replaces the allowance.

What it costs. Above its floor, a grant is at most twice what its router was asked for over its last
interval: what it can use until its next report, not the whole window, so the routers that ask next
find room. A router whose budget runs out reports early (it does not wait out the interval) when the
registry said part of the key's window was still unallocated, and its demand then counts the
requests that found no room, so a burst ramps up in a few round trips. Busy on several routers, a
key's window is shared by demand within a report interval of the demand moving.

The floor. Demand alone would make a key that is barely used get a grant of twice a trickle (or
nothing, after an interval without requests), so a sudden burst on it found no room and waited for
round trips to the registry, and on a loaded machine got 429s with its window all but empty. So
every grant is at least the key's unheld room split over twice the live routers: a burst of that
size is admitted at once, with no report. The floor is a share of what nobody holds, so it never
breaks (I), and it shrinks as the window fills (nothing, at the limit). Floors alone hold at most
half of a key's free room (each router's is at most 1/(2n) of what the others leave: summed, at most
n/(3n − 1) ≤ 1/2 of it), so the rest stays unallocated for the routers whose demand is above theirs. The
price: an idle router keeps its floor held until it gives the key back (IDLE_RELEASE_S without a
request, router/rate_limit.py), and a dead router's hold, not handed out again for about a minute,
is up to its floor rather than twice its demand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WINDOW_S = 60            # a limit is per this many seconds
WINDOW_SLOTS = WINDOW_S + 1
GRANT_TTL_S = 3.0        # a router uses a grant at most this long after sending the report that brought it
HOLD_S = GRANT_TTL_S + WINDOW_SLOTS   # how long a hold counts when its router reports no more
MAX_FUTURE_SLOTS = 5     # slots a router stamps further ahead than this are taken as now
DEMAND_HEADROOM = 2.0    # a grant covers up to this many times the router's demand of its last interval
FLOOR_SPLIT = 2          # the floor: the unheld room split over this many times the live routers
PROVISIONAL_SPLIT = 8    # a router's provisional allowance: a key's limit split over this many times the live routers


@dataclass(slots=True)
class Held:
    """Another router's hold on the same key and limit, and the demand it last reported (0 when that
    report is older than GRANT_TTL_S: its router is not asking any more)."""

    hold: int
    demand: float


@dataclass(slots=True)
class Allowance:
    grant: int          # what the router may admit until its next report
    hold: int           # what the registry now counts against the others for this router
    free: int           # L − used: the key's room in its window (≤ 0 when the window is full)
    unallocated: int    # free − every hold, this one included: what an early report could still get


def grant_floor(unheld: int, live_routers: int) -> int:
    """The least a router is granted of a key's unheld room (the module docstring says why)."""
    if live_routers < 1 or unheld <= 0:
        return 0
    return unheld // (FLOOR_SPLIT * live_routers)


def provisional_allowance(limit: int, live_routers: int) -> int:
    """What a router may admit of a key it holds no grant for, in any window, before the registry
    answers (the module docstring's third way over the limit says what it costs)."""
    if live_routers < 1:
        return 0
    return limit // (PROVISIONAL_SPLIT * live_routers)


def window_start(now: float) -> int:
    """The oldest slot that counts at `now`."""
    return math.floor(now) - WINDOW_S


def allowance(limit: int, used: int, demand: float, remaining: int, others: list[Held],
              live_routers: int = 0) -> Allowance:
    """The grant for one router (see the module docstring): `demand` ≥ 0 its own, `remaining` ≥ 0 what
    it still had of its previous grant when it sent this report, `live_routers` the routers the
    registry counts as live, this one included (0: no floor, the grant follows demand alone)."""
    free = limit - used
    held = sum(other.hold for other in others)
    total_demand = demand + sum(other.demand for other in others)
    share = math.ceil(free * demand / total_demand) if total_demand > 0 else 0
    by_demand = min(share, math.ceil(DEMAND_HEADROOM * demand))
    grant = max(0, min(max(by_demand, grant_floor(free - held, live_routers)), free - held))
    hold = max(grant, remaining)
    return Allowance(grant, hold, free, max(0, free - held - hold))


def reset_s(now: float, oldest_slot: int | None) -> float:
    """Seconds until the oldest charge in the window leaves it (when some room comes back)."""
    if oldest_slot is None:
        return 0.0
    return max(0.0, oldest_slot + WINDOW_SLOTS - now)
