"""Where a client is: GeoIP2 City database → trusted front-proxy header → the router's own location.

The client address is the TCP peer, or, when the peer is a trusted proxy, the nearest untrusted
address in its forwarded-for header (`X-Forwarded-For` style, or RFC 7239 `Forwarded` when the header
configured is `forwarded`); every line of the header counts, in order, as HTTP joins repeated fields.
IPv4-mapped IPv6 addresses (a dual-stack listener's IPv4 peers) are their IPv4 address. Private,
reserved and unknown addresses get the router's own location: with anycast, a client we cannot place
is near the router that got its packets.

One shared database reader serves every request. It reads a private in-memory copy of the file, so
a database copied over in place (`cp`, which truncates the file the old reader has mapped) cannot
fault the router; `reload()` (SIGHUP) swaps in a fresh copy, or keeps the old one and logs why. A
file that is not a City database, or not a database at all, is a `GeoDatabaseError` at start.
"""

from __future__ import annotations

import io
import ipaddress
import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import maxminddb

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Database types whose records carry `location` (the GeoLite2/GeoIP2 City family, DB-IP's City Lite,
# and GeoIP2 Enterprise); a Country, ASN or ISP database places no one.
LOCATED_DATABASE_TYPES = ("City", "Enterprise")
# Looked up once when a database is opened: a search tree corrupt near its root fails here, at start
# or reload, rather than on every client's request.
_PROBE_ADDRESSES = ("1.1.1.1", "8.8.8.8", "81.2.69.160", "203.0.113.1", "2001:4860:4860::8888")


class GeoDatabaseError(ValueError):
    """A GeoIP database file that cannot place clients: missing, unreadable, corrupt or of the wrong type."""


@dataclass(slots=True, frozen=True)
class Location:
    lat: float
    lon: float
    source: str  # geoip | header | router


class _Database:
    """One opened database; `broken` notes that a lookup found it corrupt (logged once, not per request)."""

    __slots__ = ("path", "reader", "broken")

    def __init__(self, path: str, reader) -> None:
        self.path, self.reader, self.broken = path, reader, False


def open_geoip_database(path: str) -> _Database:
    """The database at `path`, read into memory and checked: a GeoDatabaseError says what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GeoDatabaseError(f"GeoIP database {path}: cannot read it ({exc.strerror or exc})") from None
    if not data:
        raise GeoDatabaseError(f"GeoIP database {path}: the file is empty")
    try:
        reader = _reader_over(data)
    except (maxminddb.InvalidDatabaseError, ValueError):
        raise GeoDatabaseError(f"GeoIP database {path}: not a valid MaxMind DB (.mmdb) file; is it truncated, "
                               f"or another format (such as a .csv or .tar.gz)?") from None
    database_type = reader.metadata().database_type
    if not any(kind in database_type for kind in LOCATED_DATABASE_TYPES):
        reader.close()
        raise GeoDatabaseError(f"GeoIP database {path}: a {database_type!r} database has no client locations; "
                               f"use a City database such as GeoLite2-City")
    for address in _PROBE_ADDRESSES:
        try:
            reader.get(address)
        except maxminddb.InvalidDatabaseError as exc:
            reader.close()
            raise GeoDatabaseError(f"GeoIP database {path}: corrupt ({exc})") from None
        except ValueError:
            pass  # an IPv6 address in an IPv4-only database
    return _Database(path, reader)


def _reader_over(data: bytes):
    """A reader over `data`: libmaxminddb's (fast) over an anonymous in-memory file where the system has
    them (Linux memfd), else the pure-Python reader over the bytes. Never a mapping of the file on disk."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("edgefire-geoip", os.MFD_CLOEXEC)
        try:
            with open(fd, "wb", closefd=False) as copy:
                copy.write(data)
            return maxminddb.open_database(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # no /proc to reopen it by: read the bytes in Python below
        finally:
            os.close(fd)
    return maxminddb.open_database(io.BytesIO(data), maxminddb.MODE_FD)


class ClientLocator:
    def __init__(self, own_lat: float, own_lon: float, geoip_db: str | None = None,
                 location_header: str | None = None, forwarded_for_header: str = "x-forwarded-for",
                 trusted_proxies: list[str] | tuple[str, ...] = ()) -> None:
        self.own = Location(own_lat, own_lon, "router")
        self._geoip_db = geoip_db
        self._location_header = location_header.lower() if location_header else None
        self._forwarded_for_header = forwarded_for_header.lower()
        self._rfc7239 = self._forwarded_for_header == "forwarded"
        self._trusted = [ipaddress.ip_network(cidr, strict=False) for cidr in trusted_proxies]
        self._reload_lock = threading.Lock()
        self._database: _Database | None = open_geoip_database(geoip_db) if geoip_db else None

    def reload(self) -> bool:
        """Re-open the database (after it was replaced on disk); a bad file keeps the old one, logging why.

        Safe to call from another thread: the old reader is dropped, not closed, so a lookup holding it
        finishes, and it is freed with its last reference."""
        if not self._geoip_db:
            return False
        with self._reload_lock:
            try:
                fresh = open_geoip_database(self._geoip_db)
            except GeoDatabaseError as exc:
                log.error("GeoIP database reload failed, keeping the previous one: %s", exc)
                return False
            self._database = fresh
        log.info("GeoIP database reloaded from %s (%s, built %s)", self._geoip_db,
                 fresh.reader.metadata().database_type, fresh.reader.metadata().build_epoch)
        return True

    def close(self) -> None:
        database, self._database = self._database, None
        if database is not None:
            database.reader.close()

    def locate(self, peer: str | None, headers: Mapping[str, str]) -> Location:
        database = self._database
        if database is None and not self._trusted:
            return self.own  # nothing to look up and no proxy to believe: skip parsing the address
        peer_ip = _parse_ip(peer)
        from_proxy = peer_ip is not None and self._is_trusted(peer_ip)
        client_ip = self._client_ip(peer_ip, headers) if from_proxy else peer_ip
        if database is not None and client_ip is not None and client_ip.is_global:
            found = _lookup(database, client_ip)
            if found is not None:
                return found
        if from_proxy and self._location_header:
            # The last line is the one the nearest proxy added; earlier ones may be the client's own.
            lines = _header_lines(headers, self._location_header)
            found = _parse_location(lines[-1]) if lines else None
            if found is not None:
                return found
        return self.own

    def _client_ip(self, peer_ip: IPAddress, headers: Mapping[str, str]) -> IPAddress:
        lines = _header_lines(headers, self._forwarded_for_header)
        if not lines:
            return peer_ip
        parse = _parse_forwarded_element if self._rfc7239 else _parse_hop
        # Walk from the right: each trusted hop vouches for the address to its left. A hop we cannot
        # read ends the walk at the last address vouched for.
        vouched = peer_ip
        for part in reversed(",".join(lines).split(",")):
            ip = parse(part)
            if ip is None:
                return vouched
            if not self._is_trusted(ip):
                return ip
            vouched = ip
        return vouched

    def _is_trusted(self, ip: IPAddress) -> bool:
        return any(ip in network for network in self._trusted)


def _lookup(database: _Database, ip: IPAddress) -> Location | None:
    try:
        record = database.reader.get(ip)
    except maxminddb.InvalidDatabaseError as exc:
        if not database.broken:
            database.broken = True
            log.error("GeoIP database %s is corrupt (looking up %s: %s); clients it cannot look up are placed "
                      "at the router's location until a good file is in place and reloaded (SIGHUP)",
                      database.path, ip, exc)
        return None
    except ValueError:  # an IPv6 client in an IPv4-only database
        return None
    location = record.get("location") if isinstance(record, dict) else None
    if not isinstance(location, dict):
        return None
    lat, lon = location.get("latitude"), location.get("longitude")
    if not (_is_coordinate(lat, 90) and _is_coordinate(lon, 180)):
        return None
    return Location(float(lat), float(lon), "geoip")


def _is_coordinate(value, limit: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and -limit <= value <= limit)


def _header_lines(headers: Mapping[str, str], name: str) -> list[str]:
    """Every line of a header in order (Starlette's Headers keeps repeats; a plain mapping has one)."""
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return getlist(name)
    value = headers.get(name)
    return [value] if value else []


def _parse_ip(text: str | None) -> IPAddress | None:
    if not text:
        return None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _parse_hop(text: str) -> IPAddress | None:
    """One X-Forwarded-For entry: an address, an `IPv4:port`, or a `[IPv6]:port` (some proxies add ports)."""
    text = text.strip().strip('"')
    if text.startswith("["):
        address, bracket, _port = text[1:].partition("]")
        return _parse_ip(address) if bracket else None
    if text.count(":") == 1:
        text = text.partition(":")[0]
    return _parse_ip(text)


def _parse_forwarded_element(element: str) -> IPAddress | None:
    """The `for=` of one RFC 7239 `Forwarded` element (`for=192.0.2.60;proto=https`,
    `for="[2001:db8::17]:4711"`); None for `unknown`, obfuscated names or none given."""
    for pair in element.split(";"):
        key, equals, value = pair.partition("=")
        if equals and key.strip().lower() == "for":
            return _parse_hop(value)
    return None


def _parse_location(value: str) -> Location | None:
    lat_text, _, lon_text = value.partition(",")
    try:
        lat, lon = float(lat_text), float(lon_text)
    except ValueError:
        return None
    if not (-90 <= lat <= 90 and -180 <= lon <= 180):
        return None
    return Location(lat, lon, "header")
