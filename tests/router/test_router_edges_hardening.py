"""Router edges a client meets: a model its key's regions exclude (a 403 that says so, not "does not
exist"), the W3C `tracestate` carried beside `traceparent` to every site, and one task watching a
streamed request for a hang-up from its first-token wait to its last event."""

from __future__ import annotations

import asyncio
import contextvars
import json

import openai
import pytest
from router_fake_agent import MODEL

from node_agent.trace import bind, from_metadata, outgoing_metadata, parse_traceparent, parse_tracestate
from router.placement import Availability, model_availability

CLIENT_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "temperature": 0}


# -- a model outside the key's regions ------------------------------------------------------------

async def test_a_model_served_only_outside_the_keys_regions_is_a_403_saying_so(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7, region="eu")
    await cluster.add_site("nyc", 40.7, -74.0, region="us-east")
    asia_key = await cluster.create_key(allowed_regions=["ap-south", "ap-east"])
    router, url = await make_router()
    assert model_availability(router.feed.current(), router.service.cost, MODEL, frozenset({"ap-south"})) == \
        Availability(outside_regions=("eu", "us-east"))
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=asia_key, max_retries=0) as client:
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.models.retrieve(MODEL)
        with pytest.raises(openai.NotFoundError):  # a model no site serves is still unknown
            await client.models.retrieve("no-such-model")
    error = refused.value.body
    assert refused.value.status_code == 403 and error["code"] == "model_not_in_allowed_regions"
    assert error["param"] == "model" and error["type"] == "request_forbidden"
    assert "ap-east, ap-south" in error["message"] and "eu, us-east" in error["message"]
    assert "does not exist" not in error["message"]


async def test_availability_tells_live_resting_outside_and_unknown_apart(cluster, make_router):
    await cluster.add_site("fra", 50.1, 8.7, region="eu")
    await cluster.add_site("nyc", 40.7, -74.0, region="us")
    router, _url = await make_router()
    snapshot, cost = router.feed.current(), router.service.cost
    assert model_availability(snapshot, cost, MODEL) == Availability(live=True)
    assert model_availability(snapshot, cost, MODEL, frozenset({"us"})) == Availability(live=True)
    assert model_availability(snapshot, cost, MODEL, frozenset({"ap"})) == Availability(outside_regions=("eu", "us"))
    assert model_availability(snapshot, cost, "other", frozenset({"ap"})) == Availability()
    # the key's own region's site stops being live but served lately: a wait (503), not a refusal
    for site in snapshot.sites:
        if site.region == "us":
            site.alive = False
    snapshot.placement_cache.clear()
    assert model_availability(snapshot, cost, MODEL, frozenset({"us"})) == Availability(resting=True)


# -- tracestate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values, expected", [
    (["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"], "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
    (["congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7"], "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),  # split over headers
    ([" congo=a b ,, \trojo=x "], "congo=a b,rojo=x"),          # optional whitespace, empty members
    (["tenant1@vendor=v"], "tenant1@vendor=v"),
    (["congo=1,congo=2"], ""),                                   # a key twice
    (["Congo=1"], ""), (["congo"], ""), (["congo="], ""), (["congo=a,b=c=d"], ""),
    (["tenant@vendor-name-too-long=v"], ""),
    ([",".join(f"k{i}=v" for i in range(33))], ""),              # more than 32 members
])
def test_tracestate_parsing_follows_the_specification(values, expected):
    assert parse_tracestate(values) == expected


def test_a_tracestate_over_512_characters_drops_long_members_first_then_from_the_end():
    members = ["first=1", "huge=" + "x" * 200] + [f"k{i}=" + "v" * 40 for i in range(12)]
    kept = parse_tracestate([",".join(members)]).split(",")
    assert "huge=" + "x" * 200 not in kept and kept[0] == "first=1"
    assert kept == [m for m in members if not m.startswith("huge")][:len(kept)]
    assert len(",".join(kept)) <= 512 < len(",".join(kept + [members[len(kept) + 1]]))


def _sent_by_an_agent_that_received(metadata) -> dict[str, str]:
    """What an agent's own call sends once its RPC is bound to `metadata` (in a context of its own, as
    each RPC's task has, so nothing stays bound after)."""
    def call() -> dict[str, str]:
        bind("req-1", from_metadata(metadata).child())
        return dict(outgoing_metadata())
    return contextvars.copy_context().run(call)


def test_an_agent_passes_the_callers_tracestate_on_to_its_own_calls():
    """A decode site pulling KV from the prefill site calls it under the router's trace, state included."""
    sent = _sent_by_an_agent_that_received([("authorization", "Bearer x"), ("traceparent", CLIENT_TRACE),
                                            ("tracestate", "congo=t61rcWkgMzE")])
    assert parse_traceparent(sent["traceparent"]).trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert sent["tracestate"] == "congo=t61rcWkgMzE"
    sent = _sent_by_an_agent_that_received([("traceparent", CLIENT_TRACE), ("tracestate", "bad key=1")])
    assert "tracestate" not in sent


@pytest.fixture
async def one_site(cluster, make_router):
    agent = await cluster.add_site("fra", 50.1, 8.7)
    key = await cluster.create_key()
    router, url = await make_router()
    return agent, {"Authorization": f"Bearer {key}"}, url, router


async def test_the_clients_tracestate_reaches_the_site_beside_its_traceparent(one_site, http):
    agent, auth, url, _router = one_site
    state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    for headers, sent_state in (
            ([("traceparent", CLIENT_TRACE), ("tracestate", state)], state),
            ([("traceparent", CLIENT_TRACE), ("tracestate", "congo=t61rcWkgMzE"),
              ("tracestate", "rojo=00f067aa0ba902b7")], state),                             # one list, two headers
            ([("traceparent", CLIENT_TRACE), ("tracestate", "congo=1,congo=2")], None),   # malformed: dropped
            ([("traceparent", "00-garbage"), ("tracestate", state)], None)):              # no parent: no state
        response = await http.post(f"{url}/v1/chat/completions", json=BODY, headers=[*auth.items(), *headers])
        assert response.status_code == 200, response.text
        sent = agent.metadata[-1]
        assert parse_traceparent(sent["traceparent"]).trace_id == response.headers["x-edgefire-trace-id"]
        assert sent.get("tracestate") == sent_state


# -- one hang-up watch per stream ---------------------------------------------------------------

async def test_a_streamed_request_is_watched_for_a_hang_up_by_one_task(one_site):
    agent, auth, _url, router = one_site
    agent.token_delay_s = 0.01
    body = json.dumps({**BODY, "max_tokens": 8, "stream": True}).encode()
    readers: set[asyncio.Task] = set()
    finished = asyncio.Event()
    messages: list[dict] = []

    async def receive() -> dict:
        if not messages:
            messages.append({})  # the body goes out once; afterwards the connection stays open
            return {"type": "http.request", "body": body, "more_body": False}
        readers.add(asyncio.current_task())
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "client": ("127.0.0.1", 1),
             "headers": [(b"authorization", auth["Authorization"].encode()), (b"content-type", b"application/json")]}
    await router.app(scope, receive, send)
    events = b"".join(m.get("body", b"") for m in messages if m.get("type") == "http.response.body")
    assert messages[1]["status"] == 200 and events.endswith(b"data: [DONE]\n\n")
    assert len(readers) == 1


# -- a repetition penalty below float32's range --------------------------------------------------

async def test_a_repetition_penalty_below_float32s_range_still_reaches_the_site_as_a_penalty(one_site, http):
    """The agent API carries the penalty as a float32, where 1e-46 is 0, which agents read as unset (no
    penalty at all): the client would get the unpenalized answer for the strongest penalty it can ask."""
    agent, auth, url, _router = one_site
    response = await http.post(f"{url}/v1/chat/completions", json={**BODY, "repetition_penalty": 1e-46}, headers=auth)
    assert response.status_code == 200, response.text
    sent = next(request for method, request in reversed(agent.calls) if method == "Generate")
    assert 0 < sent.sampling.repetition_penalty < 1e-37
