"""Client geolocation against bad databases and odd network input: wrong or broken .mmdb files at start
and on reload, a database overwritten in place, bad records, dual-stack peers, repeated and RFC 7239
forwarded headers."""

from __future__ import annotations

import ipaddress
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import maxminddb
import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet
from starlette.datastructures import Headers
from router_fake_agent import MODEL
from test_router_geo import CITIES, write_mmdb

from router.geo import ClientLocator, GeoDatabaseError, Location

REPO = Path(__file__).resolve().parents[2]
LONDON, STOCKHOLM, SEATTLE = "81.2.69.17", "89.160.20.17", "216.160.83.17"


def write_typed_mmdb(path, database_type: str, record: dict) -> str:
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type=database_type)
    writer.insert_network(IPSet(["81.2.69.0/24"]), record)
    writer.to_db_file(str(path))
    return str(path)


def break_tree_record(path: str, address: str) -> None:
    """Points the search tree's last record on `address`'s path past the end of the file, as a bit flip
    would: the database opens, other addresses resolve, this one is `search tree is corrupt`."""
    metadata = maxminddb.open_database(path, maxminddb.MODE_MEMORY).metadata()
    assert metadata.record_size == 24 and metadata.ip_version == 6
    data = bytearray(Path(path).read_bytes())
    bits = int(ipaddress.IPv6Address(b"\0" * 12 + ipaddress.IPv4Address(address).packed))
    node = 0
    for depth in range(128):
        bit = (bits >> (127 - depth)) & 1
        offset = node * 6 + bit * 3
        record = int.from_bytes(data[offset:offset + 3], "big")
        if record >= metadata.node_count:
            data[offset:offset + 3] = b"\xff\xff\xff"
            Path(path).write_bytes(bytes(data))
            return
        node = record
    raise AssertionError(f"{address} is not in {path}")


@pytest.fixture
def mmdb(tmp_path):
    return write_mmdb(tmp_path / "city.mmdb")


def bad_databases(tmp_path, good: str) -> dict[str, tuple[str, str]]:
    """name -> (path, words the error must say)."""
    (tmp_path / "empty.mmdb").write_bytes(b"")
    data = Path(good).read_bytes()
    (tmp_path / "truncated.mmdb").write_bytes(data[:len(data) // 2])
    (tmp_path / "archive.mmdb").write_bytes(b"\x1f\x8b\x08\x00" + bytes(200))  # a .tar.gz kept its name
    corrupt = shutil.copy(good, tmp_path / "corrupt.mmdb")
    break_tree_record(str(corrupt), "1.1.1.1")
    return {
        "missing": (str(tmp_path / "missing.mmdb"), "cannot read it"),
        "empty": (str(tmp_path / "empty.mmdb"), "the file is empty"),
        "truncated": (str(tmp_path / "truncated.mmdb"), "not a valid MaxMind DB"),
        "archive": (str(tmp_path / "archive.mmdb"), "not a valid MaxMind DB"),
        "country": (write_typed_mmdb(tmp_path / "country.mmdb", "GeoLite2-Country", {"country": {"iso_code": "GB"}}),
                    "'GeoLite2-Country' database has no client locations"),
        "asn": (write_typed_mmdb(tmp_path / "asn.mmdb", "GeoLite2-ASN", {"autonomous_system_number": 5}),
                "'GeoLite2-ASN' database has no client locations"),
        "corrupt": (str(corrupt), "corrupt"),
    }


BAD = ["missing", "empty", "truncated", "archive", "country", "asn", "corrupt"]


@pytest.mark.parametrize("name", BAD)
def test_a_database_that_cannot_place_clients_is_refused_at_start(tmp_path, mmdb, name):
    # A Country or ASN database used to start and then answer every request from outside with a 500
    # ("The city method cannot be used with the GeoLite2-Country database"); a missing file was a traceback.
    path, words = bad_databases(tmp_path, mmdb)[name]
    with pytest.raises(GeoDatabaseError, match=words) as error:
        ClientLocator(0.0, 0.0, path)
    assert path in str(error.value)


def test_the_router_command_exits_with_the_reason_for_a_bad_database(tmp_path):
    # Run as an operator runs it; before, it started and served (timing out here) with a Country database.
    config = tmp_path / "router.toml"
    country = write_typed_mmdb(tmp_path / "country.mmdb", "GeoLite2-Country", {"country": {"iso_code": "GB"}})
    config.write_text(f'[router]\nport = 0\nhost = "127.0.0.1"\ngeoip_db = "{country}"\n')
    done = subprocess.run([sys.executable, "-c", "import sys; from deploy.cli import main; sys.exit(main())", "router", "--config",
                           str(config)], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "geoip_db" in done.stderr and "'GeoLite2-Country' database has no client locations" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name", BAD)
def test_a_bad_database_on_reload_keeps_the_old_one_and_logs_why(tmp_path, mmdb, caplog, name):
    live = shutil.copy(mmdb, tmp_path / "live.mmdb")
    locator = ClientLocator(0.0, 0.0, str(live))
    bad_path, words = bad_databases(tmp_path, mmdb)[name]
    if name == "missing":
        Path(live).unlink()
    else:
        shutil.copy(bad_path, tmp_path / "next.mmdb")
        (tmp_path / "next.mmdb").replace(live)
    with caplog.at_level(logging.ERROR, "router.geo"):
        assert locator.reload() is False
    assert "keeping the previous one" in caplog.text and words in caplog.text
    for site, lat, lon in CITIES.values():  # still placed by the old database, no 500
        client = {"lon": LONDON, "sto": STOCKHOLM, "sea": SEATTLE}[site]
        assert locator.locate(client, {}) == Location(lat, lon, "geoip")
    write_mmdb(tmp_path / "good.mmdb", {"81.2.69.0/24": ("lon", 1.0, 2.0)})
    (tmp_path / "good.mmdb").replace(live)
    assert locator.reload() is True
    assert (locator.locate(LONDON, {}).lat, locator.locate(LONDON, {}).lon) == (1.0, 2.0)
    locator.close()


def test_a_database_overwritten_in_place_does_not_crash_the_router(tmp_path, mmdb):
    # `cp new.mmdb city.mmdb` truncates the file the reader had memory-mapped: the next lookup was a
    # SIGBUS that killed the router, before anyone sent SIGHUP. Run apart so a crash fails only this test.
    script = (f"from router.geo import ClientLocator\n"
              f"locator = ClientLocator(0.0, 0.0, {mmdb!r})\n"
              f"before = locator.locate({LONDON!r}, {{}})\n"
              f"open({mmdb!r}, 'wb').close()\n"
              f"after = locator.locate({LONDON!r}, {{}})\n"
              f"print(before == after, after.source)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "True geoip"), done.stderr


def test_a_record_corrupt_past_the_checks_places_the_client_at_the_router_and_logs_once(tmp_path, mmdb, caplog):
    break_tree_record(mmdb, STOCKHOLM)
    locator = ClientLocator(10.0, 20.0, mmdb)
    with caplog.at_level(logging.ERROR, "router.geo"):
        assert locator.locate(STOCKHOLM, {}) == locator.own  # was a 500 (InvalidDatabaseError) per request
        assert locator.locate(STOCKHOLM, {}) == locator.own
    assert locator.locate(LONDON, {}).source == "geoip"
    errors = [record.getMessage() for record in caplog.records if record.name == "router.geo"]
    assert len(errors) == 1 and "is corrupt" in errors[0] and "SIGHUP" in errors[0]


def test_records_without_a_usable_location_fall_back_to_the_router(tmp_path):
    records = {"1.0.0.0/24": {"location": {"latitude": 200.0, "longitude": 10.0}},
               "2.0.0.0/24": {"location": {"latitude": "north", "longitude": 10.0}},
               "3.0.0.0/24": {"location": "nowhere"},
               "4.0.0.0/24": {"location": {"latitude": float("nan"), "longitude": 10.0}},
               "5.0.0.0/24": {"country": {"iso_code": "SE"}},
               "6.0.0.0/24": {"location": {"latitude": -89.5, "longitude": -180}}}
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-City")
    for network, record in records.items():
        writer.insert_network(IPSet([network]), record)
    writer.to_db_file(str(tmp_path / "odd.mmdb"))
    locator = ClientLocator(10.0, 20.0, str(tmp_path / "odd.mmdb"))
    for network in list(records)[:5]:  # latitude 200 and "north" went into placement; "nowhere" was a 500
        assert locator.locate(network.replace("0/24", "9"), {}) == locator.own, network
    assert locator.locate("6.0.0.9", {}) == Location(-89.5, -180.0, "geoip")


def test_a_dual_stack_listener_sees_ipv4_proxies_and_clients_as_themselves(mmdb):
    # A router on "::" gets IPv4 peers as ::ffff:a.b.c.d: its IPv4 trusted_proxies never matched, and
    # every client behind them was placed at the router.
    locator = ClientLocator(10.0, 20.0, mmdb, trusted_proxies=["10.0.0.0/8"])
    behind_proxy = locator.locate("::ffff:10.1.2.3", {"x-forwarded-for": STOCKHOLM})
    assert (behind_proxy.lat, behind_proxy.lon, behind_proxy.source) == (59.33, 18.07, "geoip")
    assert locator.locate("::ffff:" + LONDON, {}).lat == 51.5
    assert locator.locate("10.1.2.3", {"x-forwarded-for": "::ffff:" + SEATTLE}).lat == 47.61
    assert locator.locate("::ffff:192.168.1.1", {}) == locator.own
    assert locator.locate("fe80::1%eth0", {}) == locator.own
    # Still only a trusted proxy's header counts.
    assert locator.locate("::ffff:8.8.4.4", {"x-forwarded-for": STOCKHOLM}) == locator.own


def test_forwarded_for_entries_with_ports_and_rfc7239_forwarded(mmdb):
    xff = ClientLocator(0.0, 0.0, mmdb, trusted_proxies=["10.0.0.0/8"])
    assert xff.locate("10.0.0.1", {"x-forwarded-for": f"{STOCKHOLM}:50123, 10.0.0.7:443"}).lat == 59.33
    forwarded = ClientLocator(0.0, 0.0, mmdb, forwarded_for_header="Forwarded", trusted_proxies=["10.0.0.0/8"])
    header = {"forwarded": f'for={SEATTLE};proto=https, For="10.0.0.7:8443";by=10.0.0.1'}
    assert forwarded.locate("10.0.0.1", header).lat == 47.61
    assert forwarded.locate("10.0.0.1", {"forwarded": f'for="[2001:db8::1]:4711", for={LONDON}'}).lat == 51.5
    # Nothing usable (unknown, obfuscated), or sent by an untrusted peer: the router's location.
    assert forwarded.locate("10.0.0.1", {"forwarded": "for=unknown"}) == forwarded.own
    assert forwarded.locate("10.0.0.1", {"forwarded": "for=_hidden;proto=https"}) == forwarded.own
    assert forwarded.locate("8.8.4.4", {"forwarded": f"for={SEATTLE}"}) == forwarded.own


def test_repeated_header_lines_count_in_order_and_the_proxys_location_line_wins(mmdb):
    locator = ClientLocator(0.0, 0.0, mmdb, location_header="X-Client-Location", trusted_proxies=["10.0.0.0/8"])
    # The client's own lines come first; the trusted proxy's come last.
    headers = Headers(raw=[(b"x-forwarded-for", LONDON.encode()), (b"x-forwarded-for", b"8.8.8.8"),
                           (b"x-client-location", b"51.5,-0.12"), (b"x-client-location", b"-33.9,151.2")])
    assert locator.locate("10.0.0.1", headers) == Location(-33.9, 151.2, "header")


async def test_a_client_cannot_pick_its_site_with_its_own_forwarded_for_line(cluster, make_router, http, mmdb):
    # A proxy that adds its own X-Forwarded-For line (HAProxy's `option forwardfor`) leaves the client's
    # line first; the router read only the first line, so a Seattle client saying "London" went to London.
    for site, lat, lon in CITIES.values():
        await cluster.add_site(site, lat, lon)
    key = await cluster.create_key()
    _router, url = await make_router(geoip_db=mmdb, trusted_proxies=["127.0.0.1/32"])
    headers = [("Authorization", f"Bearer {key}"), ("X-Forwarded-For", LONDON), ("X-Forwarded-For", SEATTLE)]
    response = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["x-edgefire-prefill-site"] == "sea"


async def test_forwarded_for_from_a_peer_not_in_trusted_proxies_is_ignored(cluster, make_router, http, mmdb):
    # Uvicorn believed X-Forwarded-For from any local peer on its own (FORWARDED_ALLOW_IPS), so with no
    # trusted_proxies a client on the router's host chose its site by naming an address.
    for site, lat, lon in CITIES.values():
        await cluster.add_site(site, lat, lon)
    key = await cluster.create_key()
    _router, url = await make_router(geoip_db=mmdb, lat=51.0, lon=0.0)  # trusted_proxies: none
    response = await http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": SEATTLE})
    assert response.status_code == 200, response.text
    assert response.headers["x-edgefire-prefill-site"] == "lon"  # the router's own location, not Seattle
