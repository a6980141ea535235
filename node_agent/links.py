"""Measured links to peer sites: round-trip time and throughput of the path to every site that
serves one of this agent's models, as the router's KV transfer estimate needs them.

Passive: every KV pull is a sample, (bytes, seconds) of the whole pull, its effective throughput,
which is exactly what a transfer estimate wants; the data port's TCP connect time is an RTT sample.
Active: a peer (from the registry's peer list) with no sample for `link_probe_interval_s` gets one
probe: `link_probe_bytes` of filler over its KV data port, authenticated like a pull (the header's
arrival is one RTT, the bytes after it a throughput sample). A peer without a data port is timed
on a gRPC Health call (RTT only; its pulls give the throughput). So probing costs at most one
small transfer per peer per interval (default: a minute, 256 KiB), and none while real pulls flow;
an interval of 0 turns probing off (passive samples only).

Samples are smoothed per peer (exponentially weighted: recent ones count most, one outlier does not
swing the estimate). Every `link_report_interval_s` the links measured since the last report go to
the registry's links API in one call; the registry keeps the latest per pair with its time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from node_agent.config import MIN_THROUGHPUT_BYTES
from node_agent.heartbeat import registry_failure
from registry.client import RegistryClient, RegistryError

log = logging.getLogger(__name__)

SMOOTHING = 0.5                  # weight of a new sample against the estimate so far
MIN_RTT_MS = 0.01                # loopback connects in microseconds; the registry wants a positive figure


@dataclass(slots=True)
class PeerLink:
    rtt_ms: float | None = None
    bandwidth_mbps: float | None = None
    sampled_at: float = -math.inf   # monotonic time of the latest sample, passive or probe
    probed_at: float = -math.inf
    changed: bool = False           # sampled since the last report

    def report(self, peer: str) -> dict:
        return {"peer": peer, "rtt_ms": self.rtt_ms, "bandwidth_mbps": self.bandwidth_mbps}


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class LinkTable:
    """Per peer site: the smoothed estimates and when they were last sampled, reported and probed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.peers: dict[str, PeerLink] = {}

    def _peer(self, peer: str) -> PeerLink:
        link = self.peers.get(peer)
        if link is None:
            link = self.peers[peer] = PeerLink()
        return link

    def observe_rtt(self, peer: str, seconds: float) -> None:
        link = self._peer(peer)
        link.rtt_ms = _smooth(link.rtt_ms, max(MIN_RTT_MS, 1000.0 * seconds))
        link.sampled_at, link.changed = self._clock(), True

    def observe_transfer(self, peer: str, num_bytes: int, seconds: float) -> None:
        if num_bytes < MIN_THROUGHPUT_BYTES or seconds <= 0:
            return
        link = self._peer(peer)
        link.bandwidth_mbps = _smooth(link.bandwidth_mbps, num_bytes * 8 / seconds / 1e6)
        link.sampled_at, link.changed = self._clock(), True

    def needs_probe(self, peer: str, interval_s: float) -> bool:
        """Nothing sampled and nothing probed for a whole interval: the path has been quiet."""
        link = self.peers.get(peer)
        return link is None or self._clock() - max(link.sampled_at, link.probed_at) >= interval_s

    def mark_probed(self, peer: str) -> None:
        self._peer(peer).probed_at = self._clock()

    def take_reports(self) -> list[dict]:
        """Links with new samples since the last call and both figures known, in the links API's shape."""
        reports = []
        for peer, link in sorted(self.peers.items()):
            if link.changed and link.rtt_ms is not None and link.bandwidth_mbps is not None:
                reports.append(link.report(peer))
                link.changed = False
        return reports

    def keep_only(self, peers: set[str]) -> None:
        """Forget the peers the registry no longer lists (deregistered, or no longer serving the model):
        their figures would stay in the metrics forever."""
        for peer in set(self.peers) - peers:
            del self.peers[peer]

    def restore(self, reports: list[dict]) -> None:
        """A report that did not reach the registry goes out again with the next one."""
        for report in reports:
            if report["peer"] in self.peers:
                self.peers[report["peer"]].changed = True


@dataclass(slots=True)
class LinkSettings:
    probe_interval_s: float = 60.0
    probe_bytes: int = 256 << 10
    report_interval_s: float = 10.0


Prober = Callable[[str, str], Awaitable[None]]  # (peer site, its gRPC address): probe it, record the samples


class LinkLoop:
    """Every report interval: probe the quiet peers the registry lists, then report what changed."""

    def __init__(self, client: RegistryClient, table: LinkTable, probe: Prober, settings: LinkSettings):
        self._client = client
        self._table = table
        self._probe = probe
        self._settings = settings
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_reports = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="links")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                await self.tick()
            except (RegistryError, httpx.HTTPError) as exc:
                log.info("link report to the registry failed (%s); retrying next interval", registry_failure(exc))
            try:
                await asyncio.wait_for(self._stop.wait(), self._settings.report_interval_s)
            except TimeoutError:
                pass

    async def tick(self) -> None:
        peers = (await self._client.peers())["peers"] if self._settings.probe_interval_s > 0 else []
        if self._settings.probe_interval_s > 0:  # the registry's list is the whole truth
            self._table.keep_only({peer["name"] for peer in peers})
        for peer in peers:
            if self._table.needs_probe(peer["name"], self._settings.probe_interval_s):
                self._table.mark_probed(peer["name"])
                await self._probe(peer["name"], peer["grpc_address"])
        reports = self._table.take_reports()
        if reports:
            try:
                await self._client.post_links(reports)
            except RegistryError as exc:
                if exc.status >= 500:
                    self._table.restore(reports)
                raise  # a 4xx (a peer the registry no longer knows) would fail again: dropped
            except httpx.HTTPError:
                self._table.restore(reports)
                raise
            self.num_reports += 1
