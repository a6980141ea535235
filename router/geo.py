"""Where a client is: GeoIP2 City database → trusted front-proxy header → the router's own location.

The client address is the TCP peer, or, when the peer is a trusted proxy, the nearest untrusted
address in its forwarded-for header. Private, reserved and unknown addresses get the router's own
location: with anycast, a client we cannot place is near the router that got its packets.
One shared database reader serves every request; `reload()` (SIGHUP) swaps in a fresh one.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import geoip2.database
import geoip2.errors
import maxminddb

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Location:
    lat: float
    lon: float
    source: str  # geoip | header | router


class ClientLocator:
    def __init__(self, own_lat: float, own_lon: float, geoip_db: str | None = None,
                 location_header: str | None = None, forwarded_for_header: str = "x-forwarded-for",
                 trusted_proxies: list[str] | tuple[str, ...] = ()) -> None:
        self.own = Location(own_lat, own_lon, "router")
        self._geoip_db = geoip_db
        self._location_header = location_header.lower() if location_header else None
        self._forwarded_for_header = forwarded_for_header.lower()
        self._trusted = [ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies]
        self._reader: geoip2.database.Reader | None = None
        if geoip_db:
            self._reader = geoip2.database.Reader(geoip_db)

    def reload(self) -> None:
        """Re-open the database (after it was replaced on disk); a bad file keeps the old reader."""
        if not self._geoip_db:
            return
        try:
            fresh = geoip2.database.Reader(self._geoip_db)
        except (OSError, maxminddb.InvalidDatabaseError, ValueError) as exc:
            log.error("GeoIP database reload failed, keeping the previous one: %s", exc)
            return
        old, self._reader = self._reader, fresh
        if old is not None:
            old.close()
        log.info("GeoIP database reloaded from %s", self._geoip_db)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def locate(self, peer: str | None, headers: Mapping[str, str]) -> Location:
        if self._reader is None and not self._trusted:
            return self.own  # nothing to look up and no proxy to believe: skip parsing the address
        peer_ip = _parse_ip(peer)
        from_proxy = peer_ip is not None and self._is_trusted(peer_ip)
        client_ip = self._client_ip(peer_ip, headers) if from_proxy else peer_ip
        if self._reader is not None and client_ip is not None and client_ip.is_global:
            found = self._lookup(client_ip)
            if found is not None:
                return found
        if from_proxy and self._location_header:
            found = _parse_location(headers.get(self._location_header))
            if found is not None:
                return found
        return self.own

    def _lookup(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> Location | None:
        try:
            location = self._reader.city(str(ip)).location
        except (geoip2.errors.AddressNotFoundError, ValueError):
            return None
        if location.latitude is None or location.longitude is None:
            return None
        return Location(location.latitude, location.longitude, "geoip")

    def _client_ip(self, peer_ip, headers: Mapping[str, str]):
        forwarded = headers.get(self._forwarded_for_header)
        if not forwarded:
            return peer_ip
        # Walk from the right: each trusted hop vouches for the address to its left.
        for part in reversed(forwarded.split(",")):
            ip = _parse_ip(part.strip())
            if ip is None:
                return peer_ip
            if not self._is_trusted(ip):
                return ip
        return peer_ip

    def _is_trusted(self, ip) -> bool:
        return any(ip in network for network in self._trusted)


def _parse_ip(text: str | None):
    if not text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _parse_location(value: str | None) -> Location | None:
    if not value:
        return None
    lat_text, _, lon_text = value.partition(",")
    try:
        lat, lon = float(lat_text), float(lon_text)
    except ValueError:
        return None
    if not (-90 <= lat <= 90 and -180 <= lon <= 180):
        return None
    return Location(lat, lon, "header")
