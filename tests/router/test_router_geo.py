"""Client geolocation: a generated GeoLite2-City database sends clients of each city to their nearest site."""

from __future__ import annotations

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet
from router_fake_agent import MODEL

from router.geo import ClientLocator

CITIES = {  # client network -> (lat, lon), one per site
    "81.2.69.0/24": ("lon", 51.5, -0.12),
    "89.160.20.0/24": ("sto", 59.33, 18.07),
    "216.160.83.0/24": ("sea", 47.61, -122.33),
}


def write_mmdb(path, cities=CITIES) -> str:
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-City")
    for network, (_site, lat, lon) in cities.items():
        writer.insert_network(IPSet([network]), {"location": {"latitude": lat, "longitude": lon}})
    writer.to_db_file(str(path))
    return str(path)


@pytest.fixture
def mmdb(tmp_path):
    return write_mmdb(tmp_path / "city.mmdb")


async def test_clients_from_each_city_go_to_their_nearest_site(cluster, make_router, http, mmdb):
    for site, lat, lon in CITIES.values():
        await cluster.add_site(site, lat, lon)
    key = await cluster.create_key()
    _router, url = await make_router(geoip_db=mmdb, trusted_proxies=["127.0.0.1/32"])
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    for network, (site, _lat, _lon) in CITIES.items():
        client_ip = network.replace("0/24", "17")
        response = await http.post(f"{url}/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}", "X-Forwarded-For": client_ip})
        assert response.status_code == 200, response.text
        assert response.headers["x-edgefire-prefill-site"] == site, client_ip


def test_lookup_order_geoip_then_trusted_header_then_router(mmdb, tmp_path):
    locator = ClientLocator(10.0, 20.0, mmdb, location_header="x-client-location",
                            trusted_proxies=["10.0.0.0/8"])
    assert locator.locate("81.2.69.5", {}).source == "geoip"
    # A public address the database does not know, behind a trusted proxy that sent a location.
    via_proxy = locator.locate("10.1.1.1", {"x-forwarded-for": "8.8.8.8", "x-client-location": "1.5,2.5"})
    assert (via_proxy.lat, via_proxy.lon, via_proxy.source) == (1.5, 2.5, "header")
    # The same headers from an untrusted peer are ignored.
    spoofed = locator.locate("8.8.4.4", {"x-forwarded-for": "81.2.69.5", "x-client-location": "1.5,2.5"})
    assert spoofed.source == "router"
    assert locator.locate("192.168.1.9", {}) == locator.own
    assert locator.locate(None, {}) == locator.own


def test_reload_picks_up_a_replaced_database(tmp_path):
    path = write_mmdb(tmp_path / "city.mmdb", {"81.2.69.0/24": ("x", 1.0, 1.0)})
    locator = ClientLocator(0.0, 0.0, path)
    assert locator.locate("81.2.69.1", {}).lat == 1.0
    write_mmdb(tmp_path / "next.mmdb", {"81.2.69.0/24": ("x", 2.0, 2.0)})
    (tmp_path / "next.mmdb").replace(path)
    locator.reload()
    assert locator.locate("81.2.69.1", {}).lat == 2.0
    locator.close()
