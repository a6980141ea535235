"""The router's in-flight ledger: what this router placed on each site that the site has not reported yet.

A site's figures in the snapshot are up to a heartbeat interval (plus the refresh) old, so twenty
requests in the same millisecond would all see the same idle site. Each attempt is therefore added
here, per site, and placement reads the snapshot's figures plus these (`PendingLoad`). A site's
entry is tied to the heartbeat (`reported_at`) its figures were added to; once the snapshot holds a
newer heartbeat from that site, the agent's own counts include those requests and the entry is
dropped. Before that, an attempt takes back its prefill tokens when its first token arrives and the
rest when it ends, so requests that came and went between two heartbeats leave nothing behind. A
request placed in the moment between an agent taking its heartbeat and the registry publishing it
is forgotten one heartbeat early: the error is one request for one interval, never a count that grows.

Per model. A site hosting several models reports each model's own KV pool apart
(registry.wire.SnapshotCapacity.own) while its load (prefill queue, running sequences, decode tokens)
stays the site's sum: its models share its devices. So the ledger keeps each attempt's KV per (site,
model), and placement takes a model's own share where the site reports that model's pool apart and
the site's total where it does not (one model, or an older agent: one pool for all). A burst on one
model then fills that model's pool alone; its load still counts against the site, as the site's next
heartbeat will count it. One heartbeat covers every model of a site, so all of them are dropped together.

Per router, in memory, never shared: each router corrects only for its own placements, which is
the part of the burst no snapshot can show it yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.placement import Candidate, PendingLoad
from router.snapshot import Site, Snapshot


@dataclass(slots=True)
class _Entry:
    reported_at: float   # the heartbeat these placements came after
    load: PendingLoad


@dataclass(slots=True)
class _Share:
    site: str
    reported_at: float
    load: PendingLoad    # what this attempt added to the site's entry


@dataclass(slots=True)
class Attempt:
    """One attempt's shares of the ledger, to take back as it progresses."""

    shares: list[_Share] = field(default_factory=list)
    prefilled: bool = False


class InflightLedger:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def pending(self, snapshot: Snapshot) -> dict[str, PendingLoad]:
        """Placements not yet covered by the snapshot's heartbeats, by site; drops the covered ones."""
        if not self._entries:
            return {}
        reported = {site.name: _reported_at(site) for site in snapshot.sites}
        for name in [n for n, e in self._entries.items() if reported.get(n) is None or reported[n] > e.reported_at]:
            del self._entries[name]
        return {name: entry.load for name, entry in self._entries.items()}

    def record(self, candidate: Candidate, num_prompt_tokens: int, max_tokens: int) -> Attempt:
        """A fresh start on the candidate: its prefill site prefills, its decode site decodes."""
        attempt = Attempt()
        num_uncached = num_prompt_tokens - candidate.num_cached_tokens
        model = candidate.model
        if candidate.colocated:
            self._add(attempt, candidate.prefill_site, _load(model, num_uncached, 1, max_tokens, num_prompt_tokens))
            return attempt
        # The prefill site holds the prompt's KV under a lease until the decode site has pulled it.
        self._add(attempt, candidate.prefill_site, _load(model, num_uncached, 0, 0, num_prompt_tokens))
        self._add(attempt, candidate.decode_site, _load(model, 0, 1, max_tokens, num_prompt_tokens))
        return attempt

    def record_resume(self, site: Site, num_context_tokens: int, max_tokens: int, model: str = "") -> Attempt:
        """A resume on a new decode site: it re-prefills everything so far, then decodes the rest.
        Without `model` its KV counts against the site's total only (not against a model's own pool)."""
        attempt = Attempt()
        self._add(attempt, site, _load(model, num_context_tokens, 1, max_tokens, num_context_tokens))
        return attempt

    def prefilled(self, attempt: Attempt) -> None:
        """The attempt's first token arrived: its prefill work is done."""
        if attempt.prefilled:
            return
        attempt.prefilled = True
        for share in attempt.shares:
            self._take_back(share, PendingLoad(prefill_tokens=share.load.prefill_tokens))
            share.load.prefill_tokens = 0

    def finished(self, attempt: Attempt) -> None:
        """The attempt ended (done, failed or abandoned): it loads its sites no more."""
        for share in attempt.shares:
            self._take_back(share, share.load)
        attempt.shares.clear()

    def _add(self, attempt: Attempt, site: Site, load: PendingLoad) -> None:
        reported_at = _reported_at(site)
        if reported_at is None:
            return  # never reported: placement does not use it
        entry = self._entries.get(site.name)
        if entry is None or entry.reported_at < reported_at:
            entry = self._entries[site.name] = _Entry(reported_at, PendingLoad())
        _change(entry.load, load, 1)
        attempt.shares.append(_Share(site.name, reported_at, load))

    def _take_back(self, share: _Share, load: PendingLoad) -> None:
        entry = self._entries.get(share.site)
        if entry is not None and entry.reported_at == share.reported_at:  # else a heartbeat has covered it
            _change(entry.load, load, -1)


def _load(model: str, prefill_tokens: int, num_seqs: int, decode_tokens: int, kv_tokens: int) -> PendingLoad:
    """One attempt's load on one site; its KV is the model's own as well as part of the site's total."""
    return PendingLoad(prefill_tokens, num_seqs, decode_tokens, kv_tokens, {model: kv_tokens} if model else {})


def _change(total: PendingLoad, load: PendingLoad, sign: int) -> None:
    total.prefill_tokens += sign * load.prefill_tokens
    total.num_seqs += sign * load.num_seqs
    total.decode_tokens += sign * load.decode_tokens
    total.kv_tokens += sign * load.kv_tokens
    for model, kv_tokens in load.model_kv_tokens.items():
        left = total.model_kv_tokens.get(model, 0) + sign * kv_tokens
        if left:
            total.model_kv_tokens[model] = left
        else:
            total.model_kv_tokens.pop(model, None)


def _reported_at(site: Site) -> float | None:
    return site.capacity.reported_at if site.capacity is not None else None
