"""Failover with fake agents: refusals before the first token, sites lost mid-stream, total failure."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from router_fake_agent import MODEL

FRA, PAR, LON = (50.1, 8.7), (48.86, 2.35), (51.5, -0.12)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "tell me about edge sites"}], "max_tokens": 12,
        "temperature": 0}


async def post(http, url, key, body=CHAT):
    return await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)


async def stream(http, url, key, body=CHAT):
    async with http.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        lines = [line async for line in response.aiter_lines() if line]
    return response, lines


def stream_text(lines):
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")), events


@pytest.fixture
async def two_sites(cluster, make_router):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router()
    return near, far, key, url


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE])
async def test_refusal_before_first_token_moves_to_next_site(two_sites, http, code):
    near, far, key, url = two_sites
    reference = (await post(http, url, key)).json()["choices"][0]["message"]["content"]
    near.refuse = code
    response = await post(http, url, key)
    assert response.status_code == 200
    assert response.headers["x-edgefire-decode-site"] == "par"
    assert response.headers["x-edgefire-attempts"] == "2"
    assert response.json()["choices"][0]["message"]["content"] == reference


async def test_a_site_moved_to_the_prefill_pool_still_prefills_the_request(cluster, make_router, http):
    # The planner narrowed fra to prefill; this router's snapshot does not show it yet.
    near = await cluster.add_site("fra", *FRA)
    await cluster.add_site("lon", *LON, role="decode")
    key = await cluster.create_key()
    _router, url = await make_router()
    near.refuse, near.refuse_methods = grpc.StatusCode.FAILED_PRECONDITION, frozenset({"Generate"})
    for _ in range(4):  # more than failures_to_cool_down: a role refusal is no failure
        response = await post(http, url, key)
        assert response.status_code == 200
        assert (response.headers["x-edgefire-prefill-site"], response.headers["x-edgefire-decode-site"]) == \
            ("fra", "lon")
        assert response.headers["x-edgefire-attempts"] == "2"
    assert [method for method, _ in near.calls[-2:]] == ["Generate", "Prefill"]  # fra still goes first


async def test_hung_site_times_out_and_next_site_answers(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router(first_token_timeout_s=0.5)
    near.hang = True
    response = await post(http, url, key)
    assert response.status_code == 200
    assert response.headers["x-edgefire-decode-site"] == "par"


async def test_site_silent_mid_stream_times_out_and_the_stream_resumes(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router(token_idle_timeout_s=0.3)
    _response, lines = await stream(http, url, key)
    reference_text, _ = stream_text(lines)
    near.stall_after = 3
    response, lines = await stream(http, url, key)
    assert response.headers["x-edgefire-decode-site"] == "fra"  # the stream began there
    assert lines[-1] == "data: [DONE]"
    assert stream_text(lines)[0] == reference_text
    method, resume = far.calls[-1]
    assert method == "Decode" and len(resume.generated_ids) == 3


async def test_a_silent_site_the_registry_lost_is_given_up_before_its_timeout(cluster, make_router, http):
    """A frozen site (no answer, connections open) would hold the stream for the whole idle timeout; once
    the router's view no longer counts it alive, the silent stream resumes elsewhere within seconds."""
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router(token_idle_timeout_s=30.0, first_token_timeout_s=30.0)
    _response, lines = await stream(http, url, key)
    reference_text, _ = stream_text(lines)
    near.stall_after = 3
    streaming = asyncio.create_task(stream(http, url, key))
    while not any(method == "Generate" for method, _ in near.calls[1:]):
        await asyncio.sleep(0.05)
    await cluster.admin.delete_site("fra", force=True)   # its heartbeats are gone: the registry lists it no more
    response, lines = await asyncio.wait_for(streaming, 15)   # well inside the 30 s idle timeout
    assert response.headers["x-edgefire-decode-site"] == "fra"
    assert lines[-1] == "data: [DONE]"
    assert stream_text(lines)[0] == reference_text
    method, resume = far.calls[-1]
    assert method == "Decode" and len(resume.generated_ids) == 3


async def test_a_site_that_still_streams_is_not_cut_when_the_registry_loses_it(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router(token_idle_timeout_s=30.0, first_token_timeout_s=30.0)
    near.token_delay_s = 0.3   # slow, but never silent for long
    streaming = asyncio.create_task(stream(http, url, key))
    while not any(method == "Generate" for method, _ in near.calls):
        await asyncio.sleep(0.05)
    await cluster.admin.delete_site("fra", force=True)
    response, lines = await streaming
    assert lines[-1] == "data: [DONE]" and response.headers["x-edgefire-decode-site"] == "fra"
    assert not any(method in ("Generate", "Decode") for method, _ in far.calls)   # it finished where it began


async def test_a_site_live_only_after_placement_takes_the_resume(cluster, make_router, http):
    """The placement had one site; when it stalls mid-stream, the site that came live since takes over."""
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR, heartbeat=False)  # not live yet: no pair of the placement
    key = await cluster.create_key()
    _router, url = await make_router(token_idle_timeout_s=1.0)
    _response, lines = await stream(http, url, key)
    reference_text, _ = stream_text(lines)
    near.stall_after = 3
    streaming = asyncio.create_task(stream(http, url, key))
    await asyncio.sleep(0.3)  # placed on fra alone, which stalls after 3 tokens
    await cluster.heartbeat("par")
    response, lines = await streaming
    assert response.headers["x-edgefire-decode-site"] == "fra"  # the stream began there
    assert lines[-1] == "data: [DONE]"
    assert stream_text(lines)[0] == reference_text
    method, resume = far.calls[-1]
    assert method == "Decode" and len(resume.generated_ids) == 3


async def test_a_stream_whose_last_site_stalls_waits_for_a_site_to_come_live(cluster, make_router, http):
    """No site is left when the stream's only site stalls; one comes live a moment later and finishes it
    (an uncordon or a late heartbeat the router had not seen yet), instead of the stream breaking."""
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR, heartbeat=False)
    key = await cluster.create_key()
    _router, url = await make_router(token_idle_timeout_s=2.0, max_full_wait_s=5.0)  # waits up to 2 s
    _response, lines = await stream(http, url, key)
    reference_text, _ = stream_text(lines)
    near.stall_after = 3
    streaming = asyncio.create_task(stream(http, url, key))
    await asyncio.sleep(2.5)  # fra stalled after 3 tokens and timed out at ~2 s: nothing was left then
    assert not streaming.done()
    await cluster.heartbeat("par")
    response, lines = await streaming
    assert response.headers["x-edgefire-decode-site"] == "fra"
    assert lines[-1] == "data: [DONE]"
    assert stream_text(lines)[0] == reference_text
    method, resume = far.calls[-1]
    assert method == "Decode" and len(resume.generated_ids) == 3


async def test_decode_site_lost_mid_stream_resumes_without_gap_or_repeat(two_sites, http):
    near, far, key, url = two_sites
    _response, lines = await stream(http, url, key)
    reference_text, _ = stream_text(lines)
    near.die_after = 4
    response, lines = await stream(http, url, key)
    assert response.headers["x-edgefire-decode-site"] == "fra"  # the stream began there
    text, events = stream_text(lines)
    assert lines[-1] == "data: [DONE]"
    assert text == reference_text
    assert events[-1]["usage"]["completion_tokens"] == 12
    method, resume = far.calls[-1]
    assert method == "Decode" and not resume.HasField("kv_source")
    prompt = list(resume.prompt_ids)
    assert list(resume.generated_ids) == near.reference_ids(prompt, 12)[:4]


async def test_non_streaming_resume_matches_fault_free_run(two_sites, http):
    near, _far, key, url = two_sites
    reference = (await post(http, url, key)).json()["choices"][0]["message"]["content"]
    near.die_after = 7
    response = await post(http, url, key)
    assert response.json()["choices"][0]["message"]["content"] == reference
    assert response.headers["x-edgefire-decode-site"] == "par"
    assert response.headers["x-edgefire-attempts"] == "2"


async def test_split_prefill_then_decode_with_kv_source_and_decode_loss(cluster, make_router, http):
    prefill = await cluster.add_site("fra-p", *FRA, role="prefill")
    decode = await cluster.add_site("fra-d", *FRA, role="decode")
    spare = await cluster.add_site("lon-d", *LON, role="decode")
    key = await cluster.create_key()
    _router, url = await make_router()
    reference = (await post(http, url, key)).json()["choices"][0]["message"]["content"]
    method, request = decode.calls[-1]
    assert method == "Decode" and request.kv_source.address == prefill.address
    decode.die_after = 0  # lost before its first token: the prefill's token is already sent
    response = await post(http, url, key)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == reference
    assert response.headers["x-edgefire-prefill-site"] == "fra-p"
    assert spare.calls[-1][0] == "Decode" and len(spare.calls[-1][1].generated_ids) == 1
    assert prefill.released  # the lease the lost decode site never took is ended


async def test_everything_failing_before_first_token_is_503_with_retry_after(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    # Full everywhere, for good: the wait for room (the tests below wait it out) ends
    # in a fraction of a second rather than at the 2 s first-token timeout, twice.
    _router, url = await make_router(max_full_wait_s=0.2)
    near.refuse = far.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    response = await post(http, url, key)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response, lines = await stream(http, url, key)
    assert response.status_code == 503


async def test_everything_failing_mid_stream_ends_with_error_event_and_no_done(two_sites, http):
    near, far, key, url = two_sites
    near.die_after = 3
    far.die_after = 2
    response, lines = await stream(http, url, key)
    assert response.status_code == 200
    assert lines[-1] != "data: [DONE]"
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["error"]["code"] == "stream_interrupted"
    text, _ = stream_text(lines[:-1])
    assert len(text.split()) == 5  # 3 words from fra, 2 from par, none repeated


async def test_failing_site_cools_down_and_is_skipped(cluster, make_router, http):
    near = await cluster.add_site("fra", *FRA)
    await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router(failures_to_cool_down=2, cooldown_s=60)
    near.refuse = grpc.StatusCode.UNAVAILABLE
    for _ in range(2):
        assert (await post(http, url, key)).headers["x-edgefire-attempts"] == "2"
    calls_before = len(near.calls)
    response = await post(http, url, key)
    assert response.headers["x-edgefire-attempts"] == "1"
    assert len(near.calls) == calls_before


async def test_the_only_decode_site_full_for_a_moment_is_waited_for_not_failed(cluster, make_router, http):
    """RESOURCE_EXHAUSTED from every candidate means full, not broken: the router retries after a
    short wait (within the first-token / idle timeout) instead of failing the stream."""
    await cluster.add_site("fra-p", *FRA, role="prefill")
    decode = await cluster.add_site("fra-d", *FRA, role="decode")  # the only decode site
    key = await cluster.create_key()
    _router, url = await make_router()
    reference = (await post(http, url, key)).json()["choices"][0]["message"]["content"]
    decode.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    asyncio.get_running_loop().call_later(0.5, setattr, decode, "refuse", None)
    response, lines = await stream(http, url, key)
    text, events = stream_text(lines)
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert not any("error" in e for e in events) and text == reference
    assert sum(1 for method, _ in decode.calls if method == "Decode") >= 3  # refused, waited, refused ... served


async def test_a_decode_site_full_past_the_timeout_ends_with_a_clear_error(cluster, make_router, http):
    await cluster.add_site("fra-p", *FRA, role="prefill")
    decode = await cluster.add_site("fra-d", *FRA, role="decode")
    key = await cluster.create_key()
    _router, url = await make_router(first_token_timeout_s=0.6, token_idle_timeout_s=0.6)
    decode.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    response = await post(http, url, key)
    assert response.status_code == 503, response.text
    assert "full" in response.json()["error"]["message"]
