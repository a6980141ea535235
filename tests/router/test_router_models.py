"""Which models the router offers (issue 17, defect 10): `/v1/models` lists a model only when live
sites can serve it (someone prefills it, someone decodes it, in the regions the key may use), and a
request for any other model is a 404 `model_not_found`, not a 503 that invites retrying forever."""

from __future__ import annotations

import asyncio

from router_fake_agent import MODEL
from test_router_errors import CHAT, assert_openai_error


async def models(http, url: str, key: str) -> list[str]:
    response = await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return [m["id"] for m in response.json()["data"]]


async def ask(http, url: str, key: str, model: str):
    return await http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": model},
                           headers={"Authorization": f"Bearer {key}"})


async def test_only_models_live_sites_serve_in_the_keys_regions_are_listed_and_others_are_404(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7)
    # Registered but never heard from: its model is not served by anyone.
    await cluster.admin.create_site("ghost", region="eu", country="XX", lat=52.5, lon=13.4,
                                    grpc_address="127.0.0.1:9", models=[{"model": "ghost-model", "role": "both"}],
                                    heartbeat_interval_s=60)
    # Alive, but only prefills its model: no site could decode it.
    await cluster.admin.create_site("half", region="eu", country="XX", lat=48.1, lon=11.6,
                                    grpc_address="127.0.0.1:9", models=[{"model": "half-model", "role": "prefill"}],
                                    heartbeat_interval_s=60)
    await cluster.heartbeat("half")
    key = await cluster.create_key()
    _router, url = await make_router()
    assert await models(http, url, key) == [MODEL]
    for model in ("ghost-model", "half-model", "never-heard-of"):
        error = assert_openai_error(await ask(http, url, key, model), 404, "model")
        assert error["code"] == "model_not_found" and model in error["message"]
    assert (await ask(http, url, key, MODEL)).status_code == 200
    # A key limited to regions where no site serves the model sees none, and a 403 saying so (not "does
    # not exist": the model does, elsewhere).
    us_key = await cluster.create_key(allowed_regions=["us"])
    assert await models(http, url, us_key) == []
    error = assert_openai_error(await ask(http, url, us_key, MODEL), 403, "model")
    assert error["code"] == "model_not_in_allowed_regions"


async def test_a_served_model_whose_sites_are_full_is_listed_and_503(cluster, make_router, http):
    await cluster.add_site("fra", 50.1, 8.7, kv_blocks_free=0)
    key = await cluster.create_key()
    _router, url = await make_router()
    assert await models(http, url, key) == [MODEL]
    response = await ask(http, url, key, MODEL)
    assert assert_openai_error(response, 503)["code"] == "no_capacity"
    assert int(response.headers["retry-after"]) >= 1


async def test_a_model_whose_sites_went_stale_is_503_and_retry_not_404(cluster, make_router, http):
    """A slow registry or sites restarting can leave no live site for a while (the soak saw such a window
    turn into 404s for the cluster's only model). The model is still the router's: 503 + Retry-After."""
    await cluster.add_site("fra", 50.1, 8.7)
    await cluster.add_site("lis", 38.7, -9.1, role="prefill")   # keeps the registry's view changing
    key = await cluster.create_key()
    _router, url = await make_router(heartbeat_max_age_s=0.3)
    await asyncio.sleep(0.8)
    await cluster.heartbeat("lis")   # a new snapshot, in which fra's heartbeat is older than 0.3 s
    await asyncio.sleep(0.5)
    response = await ask(http, url, key, MODEL)
    assert assert_openai_error(response, 503)["code"] == "no_capacity"
    assert int(response.headers["retry-after"]) >= 1
    assert await models(http, url, key) == []   # not offered while no site can decode it
    await cluster.heartbeat("fra")
    await asyncio.sleep(0.5)  # the router's snapshot refresh (0.2 s) takes the new heartbeat in
    assert (await ask(http, url, key, MODEL)).status_code == 200
    # Heard from longer ago than recently_served_s: the model is no longer the router's to offer.
    _router, url = await make_router(heartbeat_max_age_s=0.3, recently_served_s=0.3)
    await asyncio.sleep(0.8)
    await cluster.heartbeat("lis")
    await asyncio.sleep(0.5)
    assert_openai_error(await ask(http, url, key, MODEL), 404, "model")
