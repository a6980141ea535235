"""Per-API-key rate limits, held across every router: this router's half of registry/allowance.py.

A key's limits (requests and tokens per minute) are global: the registry grants each router part of
the key's window at every report (router/fleet_reporter.py, about once a second) and the router
admits locally, never calling the registry per request. Per limited key and limit, the router keeps
a *budget*: the grant of the registry's last answer less what it charged since it sent that report.

    charge = limiter.admit(key_id, requests_per_minute, tokens_per_minute, num_tokens)
    # Charge: admitted, and the tokens are taken (prompt + max_tokens, the most the request can use)
    # Refusal: 429 after `retry_after_s`; `ask` says an early report may bring room (the caller
    #          asks the reporter and tries again, for as long as that stays so, up to a deadline);
    #          `never`: the request is over the whole limit, a client error (400) rather than a wait
    limiter.give_back(charge, unused_tokens)     # when the request ends

Provisional allowance. A key this router holds no grant for (its first request here, or the first
after IDLE_RELEASE_S idle) is admitted at once, with no round trip to the registry, while this
router's own charges of the key in the window stay within `provisional_allowance` (limit ÷ (8 n),
n the live routers at the last answer): a slow registry no longer holds up a key's first request
when its limit clearly has room. The charges and the demand go out in the next report, whose answer
brings the grant that replaces the allowance: a key the answer finds over its limit is refused from
then on. That report need not wait for the reporter's interval: a key's first provisional admission
calls `on_provisional` (the reporter sends its next report soon, router/fleet_reporter.py), so the
grant, and the key's true room, arrive a round trip later rather than up to an interval later. A key
whose window an answer found more than half used gets no allowance for a window after it (`_short`),
even once given back idle, and none is given before this router's first answer (it does not know n
yet) or while it admits from the local share. What the allowance costs the
bound is in registry/allowance.py (the third way over).

A request that does not fit a budget (or the provisional allowance) is refused unless the key has no
grant here yet, or the registry said part of its window was unallocated at its last answer: then the
caller has the reporter send a report at once, with this demand in it, and tries again with the
answer (and asks again while the answer leaves it short yet still says so, until the caller's
deadline). Every charge is also kept per slot (second of this router's clock): `pending` until it
goes out in a report, and for the last 61 s in `history`, this router's own window, which is what
it admits from when the registry cannot be reached (and what bounds the provisional allowance).

Local share. When no report has been answered for GRANT_TTL_S and the last attempt failed, budgets
lapse and each limited key is admitted from this router's own window up to limit ÷ n, n the live
routers the registry counted at its last answer (1 if it never answered): `local_share` says so and
/healthz shows it. What that does to the bound is in registry/allowance.py. Charges made meanwhile
are reported when the registry answers again, to their own seconds, so the window there is right.

Give-backs. A request's unused tokens go back to the slot it was charged in, in the next report;
they return to the budget at once only when the charge was made after the report that brought the
budget was sent (the grant could not have counted it), which keeps the registry's bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from registry.allowance import GRANT_TTL_S, MAX_FUTURE_SLOTS, WINDOW_S, WINDOW_SLOTS, provisional_allowance
from registry.fleet import KeyDemand, RateCharge

IDLE_RELEASE_S = 10.0     # a key not asked for this long gives its grants back at the next report
# A key whose window an answer found fuller than this gets no provisional allowance for a window after.
PROVISIONAL_MAX_USED = 0.5
# A report carries at most this many (key, second) charges, the newest first; the rest wait for the next
# one. The registry refuses a report with more than 10,000 in a list or over 1 MiB, and a refused report
# loses its charges (router/fleet_reporter.py): after minutes without the registry, charges of many keys pile up.
MAX_REPORT_CHARGES = 4000
LIMITS = ("requests", "tokens")


@dataclass(slots=True)
class Budget:
    left: int = 0              # grant − what was charged since the report that brought it was sent
    unallocated: int = 0       # room in the key's window nobody held, at the registry's last answer
    full: bool = False         # the window itself was full (room returns as old charges leave it)
    reset_at: float = 0.0      # (clock) when the window's oldest charge leaves it
    unlimited: bool = False    # the registry says the key has no such limit


@dataclass(slots=True)
class KeyState:
    key_id: int
    limits: dict[str, int | None]
    budgets: dict[str, Budget] = field(default_factory=lambda: {name: Budget() for name in LIMITS})
    granted: bool = False      # an answer brought budgets for this key
    grant_seq: int = 0         # the report whose answer set the budgets
    asked: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LIMITS, 0.0))  # since the last report
    last_asked_at: float = -math.inf
    reported: bool = False     # its demand went out in a report (whose answer brings its grant)


@dataclass(slots=True)
class Charge:
    """What one admitted request took: given back in part when it ends."""

    key_id: int
    slot: int
    seq: int            # the report its charge goes out in
    tokens: int


@dataclass(slots=True)
class Refusal:
    limit: str          # "requests" | "tokens"
    retry_after_s: float
    ask: bool = False   # an early report may bring room: ask, then try once more
    never: bool = False  # the request alone is over the key's whole limit: no wait can admit it


@dataclass(slots=True)
class ReportPart:
    """The rate-limit part of one fleet report."""

    seq: int
    charges: list[RateCharge]
    demand: list[KeyDemand]


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 report_interval_s: float = 1.0) -> None:
        self._clock = clock
        self._wall = wall
        self._report_interval_s = report_interval_s
        self._keys: dict[int, KeyState] = {}
        self._pending: dict[tuple[int, int], list[int]] = {}   # (key, slot) -> [requests, tokens] unreported
        self._history: dict[int, dict[int, list[int]]] = {}    # key -> slot -> [requests, tokens], own, 61 s
        self._spent: dict[int, list[int]] = {}   # key -> [requests, tokens] charged since the last report was taken
        self._next_seq = 1              # the report the charges made now go out in
        self._valid_until = -math.inf   # budgets may be spent until then (GRANT_TTL_S after the send)
        self._failing = False           # the last report attempt got no answer
        self.live_routers = 1           # as the registry last counted them, this one included
        self._answered = False          # some report was answered: live_routers is the registry's count
        # key -> (clock) until when it gets no provisional allowance: an answer found its window over half used
        self._short: dict[int, float] = {}
        self.num_local_admissions = 0   # admitted from the local share (the registry unreachable)
        self.num_provisional_admissions = 0   # admitted before the key's first grant here
        # Called when a key is admitted provisionally before any report carried its demand: the reporter
        # sends the next report soon instead of at its interval.
        self.on_provisional: Callable[[], None] | None = None

    # -- admission -----------------------------------------------------------------------------

    def admit(self, key_id: int, requests_per_minute: int | None, tokens_per_minute: int | None,
              num_tokens: int, retry: bool = False) -> Charge | Refusal | None:
        """A Charge when admitted, a Refusal when not; None for a key with no limit (nothing to charge).
        `retry`: the same request again after an early report (its demand is counted already, and
        is counted again only when it is refused again)."""
        if not requests_per_minute and not tokens_per_minute:
            return None   # the common case: keys without limits cost one comparison
        limits = {"requests": requests_per_minute or None, "tokens": tokens_per_minute or None}
        now = self._clock()
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = KeyState(key_id, limits)
        state.limits = limits
        amounts = {"requests": 1, "tokens": num_tokens}
        needed = [name for name in LIMITS if limits[name] is not None and not state.budgets[name].unlimited]
        if not needed:
            return None
        for name in needed:
            if amounts[name] > limits[name]:   # more than a whole minute's allowance: not demand to share
                return Refusal(name, WINDOW_S, never=True)
        state.last_asked_at = now
        local = self.local_share
        provisional = not local and self._provisional(state, amounts, needed, now)
        refusal = None if provisional else self._check_local(state, amounts, needed) if local else \
            self._check_budgets(state, amounts, needed, now)
        if not retry or refusal is not None:   # refused again, it asks again: demand of the next report too
            state.asked["requests"] += 1
            state.asked["tokens"] += num_tokens
        if refusal is not None:
            return refusal
        if local:
            self.num_local_admissions += 1
        elif provisional:
            self.num_provisional_admissions += 1
            if not state.reported and self.on_provisional is not None:
                self.on_provisional()
        else:
            for name in needed:
                state.budgets[name].left -= amounts[name]
        return self._charge(key_id, num_tokens)

    def _provisional(self, state: KeyState, amounts: dict, needed: list[str], now: float) -> bool:
        """Admitted on the provisional allowance: no grant for the key here yet, and this router's own
        charges of it in the window leave room for the request within the allowance."""
        if state.granted or not self._answered or self._short.get(state.key_id, -math.inf) > now:
            return False
        slots = self._window(state.key_id)
        return all(sum(counts[i] for counts in slots.values()) + amounts[name]
                   <= provisional_allowance(state.limits[name], self.live_routers)
                   for i, name in enumerate(LIMITS) if name in needed)

    def _check_budgets(self, state: KeyState, amounts: dict, needed: list[str], now: float) -> Refusal | None:
        if not state.granted or now >= self._valid_until:
            return Refusal(needed[0], self._report_interval_s, ask=True)
        for name in needed:
            budget = state.budgets[name]
            if amounts[name] > budget.left:
                wait = max(budget.reset_at - now, self._report_interval_s) if budget.full else self._report_interval_s
                return Refusal(name, wait, ask=budget.unallocated > 0)
        return None

    def _check_local(self, state: KeyState, amounts: dict, needed: list[str]) -> Refusal | None:
        slots = self._window(state.key_id)
        for i, name in enumerate(LIMITS):
            if name in needed and sum(counts[i] for counts in slots.values()) + amounts[name] > \
                    state.limits[name] / max(1, self.live_routers):
                oldest = min((s for s, counts in slots.items() if counts[i] > 0), default=None)
                wait = oldest + WINDOW_SLOTS - self._wall() if oldest is not None else self._report_interval_s
                return Refusal(name, max(wait, self._report_interval_s))
        return None

    def _charge(self, key_id: int, num_tokens: int) -> Charge:
        slot = math.floor(self._wall())
        pending = self._pending.setdefault((key_id, slot), [0, 0])
        pending[0] += 1
        pending[1] += num_tokens
        for counts in (self._history.setdefault(key_id, {}).setdefault(slot, [0, 0]),
                       self._spent.setdefault(key_id, [0, 0])):
            counts[0] += 1
            counts[1] += num_tokens
        return Charge(key_id, slot, self._next_seq, num_tokens)

    def give_back(self, charge: Charge, num_tokens: int) -> None:
        """`num_tokens` of the charge were not used (the request ended, or never started)."""
        num_tokens = min(num_tokens, charge.tokens)
        if num_tokens <= 0:
            return
        charge.tokens -= num_tokens
        self._pending.setdefault((charge.key_id, charge.slot), [0, 0])[1] -= num_tokens
        own = self._history.get(charge.key_id, {}).get(charge.slot)
        if own is not None:
            own[1] -= num_tokens
        if charge.seq == self._next_seq:   # charged since the last report was taken: not counted anywhere yet
            self._spent[charge.key_id][1] -= num_tokens
        state = self._keys.get(charge.key_id)
        if state is not None and state.granted and charge.seq > state.grant_seq:
            state.budgets["tokens"].left += num_tokens

    def _window(self, key_id: int) -> dict[int, list[int]]:
        """This router's own charges of the key still in a window, older ones dropped."""
        slots = self._history.get(key_id, {})
        oldest = math.floor(self._wall()) - WINDOW_S
        for slot in [s for s in slots if s < oldest]:
            del slots[slot]
        return slots

    # -- reports -------------------------------------------------------------------------------

    @property
    def local_share(self) -> bool:
        """Admitting from the local share: no answer for GRANT_TTL_S and the last attempt failed."""
        return self._failing and self._clock() >= self._valid_until

    def take_report(self) -> ReportPart:
        """The charges since the last report and the grants wanted, for the next report (sent at once)."""
        now = self._clock()
        seq = self._next_seq
        self._next_seq += 1
        # Charges older than every window are dropped (the registry would, and they only swell the report).
        oldest = self._oldest_reported_slot()
        newest_first = sorted(((slot, key_id), counts) for (key_id, slot), counts in self._pending.items()
                              if slot >= oldest and (counts[0] or counts[1]))[::-1]
        charges = [RateCharge(key_id, slot, requests, tokens) for (key_id, slot), (requests, tokens)
                   in sorted(((key_id, slot), counts) for (slot, key_id), counts in newest_first[:MAX_REPORT_CHARGES])]
        self._pending = {(key_id, slot): counts for (slot, key_id), counts in newest_first[MAX_REPORT_CHARGES:]}
        self._spent = {}
        demand, spendable = [], now < self._valid_until and not self.local_share
        for state in list(self._keys.values()):
            limited = any(state.limits[name] is not None for name in LIMITS)
            if not limited or now - state.last_asked_at > IDLE_RELEASE_S:
                del self._keys[state.key_id]   # given back: its next request asks again
                continue
            remaining = {name: max(0, state.budgets[name].left) if spendable and state.granted else 0
                         for name in LIMITS}
            demand.append(KeyDemand(state.key_id, state.asked["requests"], state.asked["tokens"],
                                    remaining["requests"], remaining["tokens"]))
            state.reported = True
            state.asked = dict.fromkeys(LIMITS, 0.0)
        self._short = {key_id: until for key_id, until in self._short.items() if until > now}
        self._prune_history()
        return ReportPart(seq, charges, demand)

    def _prune_history(self) -> None:
        """Drops every key's charges older than a window, busy keys' too: a key charged every second
        would otherwise keep a slot per second for as long as the router runs. Slots are added in clock
        order, so only each key's oldest few are looked at (one look per key per report)."""
        oldest = math.floor(self._wall()) - WINDOW_S
        for key_id, slots in list(self._history.items()):
            while slots and (first := next(iter(slots))) < oldest:
                del slots[first]
            if not slots:
                del self._history[key_id]

    def answered(self, seq: int, sent_at: float, answer: dict) -> None:
        """The registry's answer to report `seq`, whose (last) attempt was sent at `sent_at` (clock)."""
        now = self._clock()
        self._failing = False
        self._valid_until = sent_at + min(float(answer.get("grant_ttl_s", GRANT_TTL_S)), GRANT_TTL_S)
        self.live_routers = max(1, int(answer.get("live_routers", 1)))
        self._answered = True
        for grant in answer.get("grants", []):
            state = self._keys.get(grant["key_id"])
            if state is None:
                continue
            state.granted, state.grant_seq = True, seq
            spent = self._spent.get(state.key_id, [0, 0])   # since this report was taken
            for i, name in enumerate(LIMITS):
                self._set_budget(state.budgets[name], grant.get(name), grant.get("known", True), spent[i], now)
            self._note_room(state, grant, now)

    def _note_room(self, state: KeyState, grant: dict, now: float) -> None:
        """Remembers for a window a key whose window the answer found more than half used (or that
        is revoked): its room is not clear, so given back idle it waits for a grant again rather than
        be admitted on an allowance the window may not have. A key in demand near its limit stays
        so for as long as its window does."""
        short = not grant.get("known", True) or any(
            grant.get(name) is not None and state.limits[name] is not None
            and int(grant[name].get("free", 0)) < state.limits[name] * (1 - PROVISIONAL_MAX_USED)
            for name in LIMITS)
        if short:
            self._short[state.key_id] = now + WINDOW_S
        else:
            self._short.pop(state.key_id, None)

    @staticmethod
    def _set_budget(budget: Budget, limit: dict | None, known: bool, spent: int, now: float) -> None:
        if not known:   # revoked or unknown at the registry: nothing to spend (the key cache will say 401)
            budget.left, budget.unallocated, budget.unlimited, budget.full = 0, 0, False, False
            return
        if limit is None:
            budget.unlimited = True
            return
        budget.unlimited = False
        budget.left = int(limit["grant"]) - spent
        budget.unallocated = int(limit["unallocated"])
        budget.full = int(limit.get("free", 1)) <= 0
        budget.reset_at = now + float(limit.get("reset_s", 0.0))

    def failed(self) -> None:
        """A report attempt got no answer (the registry unreachable, or answering 5xx)."""
        self._failing = True
        # No new report is taken while the one in flight goes unanswered, so nothing else drops the
        # charges meanwhile: an outage of hours would keep one entry per key and second.
        oldest = self._oldest_reported_slot()
        self._pending = {slot_key: counts for slot_key, counts in self._pending.items() if slot_key[1] >= oldest}
        self._prune_history()

    def _oldest_reported_slot(self) -> int:
        """Charges of older slots are outside every window: the registry would drop them."""
        return math.floor(self._wall()) - WINDOW_SLOTS - MAX_FUTURE_SLOTS

    def status(self) -> dict:
        return {"mode": "local_share" if self.local_share else "global", "live_routers": self.live_routers,
                "limited_keys": len(self._keys), "num_local_admissions": self.num_local_admissions,
                "num_provisional_admissions": self.num_provisional_admissions}
