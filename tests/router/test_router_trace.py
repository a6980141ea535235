"""W3C trace context through the router: a client's traceparent is joined (a bad one starts a new
trace), every agent call carries it, the response names it, and the router's log lines about the
request end with its request id and trace id, failover included."""

from __future__ import annotations

import logging

import grpc
import pytest
from router_fake_agent import MODEL

from node_agent.trace import RequestLogFilter, new_trace, parse_traceparent

FRA, PAR = (50.1, 8.7), (48.86, 2.35)
CLIENT_TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "trace me"}], "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("value, expected", [
    (CLIENT_TRACE, ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")),
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", ("4bf92f3577b34da6a3ce929d0e0e4736",
                                                                  "00f067aa0ba902b7", "00")),
    # a later version may append fields; its first four are read as version 00's
    ("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next",
     ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")),
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),  # all-zero parent id
    ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),  # upper case
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # forbidden version
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),  # version 00 is exactly 55
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
    ("not a traceparent", None), ("", None),
])
def test_traceparent_parsing_follows_the_specification(value, expected):
    parsed = parse_traceparent(value)
    assert (None if parsed is None else (parsed.trace_id, parsed.span_id, parsed.flags)) == expected
    if parsed is not None:
        assert parse_traceparent(parsed.traceparent()) == parsed


def test_a_new_trace_and_its_children_are_valid():
    trace = new_trace()
    child = trace.child()
    assert parse_traceparent(child.traceparent()) == child
    assert child.trace_id == trace.trace_id and child.span_id != trace.span_id


@pytest.fixture
async def two_sites(cluster, make_router):
    near = await cluster.add_site("fra", *FRA)
    far = await cluster.add_site("par", *PAR)
    key = await cluster.create_key()
    _router, url = await make_router()
    return near, far, {"Authorization": f"Bearer {key}"}, url


def sent_trace(agent) -> list:
    return [parse_traceparent(m.get("traceparent")) for m in agent.metadata]


async def test_the_clients_trace_reaches_every_site_and_the_router_log(two_sites, http, caplog):
    near, far, auth, url = two_sites
    caplog.handler.addFilter(RequestLogFilter())
    caplog.set_level(logging.INFO)
    near.refuse = grpc.StatusCode.UNAVAILABLE  # the request fails over from fra to par
    response = await http.post(f"{url}/v1/chat/completions", json=BODY, headers={**auth, "traceparent": CLIENT_TRACE})
    assert response.status_code == 200 and response.headers["x-edgefire-decode-site"] == "par"

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    assert response.headers["x-edgefire-trace-id"] == trace_id
    sent = sent_trace(near)[-1:] + sent_trace(far)[-1:]
    assert [t.trace_id for t in sent] == [trace_id, trace_id]
    assert all(t.span_id != "00f067aa0ba902b7" for t in sent)  # each call is a child of the router's span
    failed = [r for r in caplog.records if "site fra failed" in r.getMessage()]
    assert failed and all(r.request_context == f" [request_id={response.headers['x-request-id']} "
                                               f"trace_id={trace_id}]" for r in failed)


async def test_without_a_valid_traceparent_the_router_starts_a_trace(two_sites, http):
    near, _far, auth, url = two_sites
    traces = []
    for headers in (auth, {**auth, "traceparent": "00-garbage"}):
        response = await http.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)
        assert response.status_code == 200
        trace_id = response.headers["x-edgefire-trace-id"]
        assert sent_trace(near)[-1].trace_id == trace_id
        traces.append(trace_id)
    assert len(set(traces)) == 2 and all(len(t) == 32 and int(t, 16) for t in traces)


async def test_a_repeated_traceparent_is_invalid_and_starts_a_new_trace(two_sites, http):
    near, _far, auth, url = two_sites
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = [*auth.items(), ("traceparent", CLIENT_TRACE), ("traceparent", other)]
    response = await http.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)
    assert response.status_code == 200
    trace_id = response.headers["x-edgefire-trace-id"]
    assert trace_id not in (CLIENT_TRACE.split("-")[1], other.split("-")[1])
    assert sent_trace(near)[-1].trace_id == trace_id


async def test_an_error_names_its_request_and_trace_as_the_logs_do(two_sites, http, caplog):
    near, far, auth, url = two_sites
    caplog.handler.addFilter(RequestLogFilter())
    caplog.set_level(logging.INFO)
    near.refuse = far.refuse = grpc.StatusCode.UNAVAILABLE  # every site fails: the client gets an error
    response = await http.post(f"{url}/v1/chat/completions", json=BODY, headers={**auth, "traceparent": CLIENT_TRACE})
    assert response.status_code >= 500
    assert response.headers["x-edgefire-trace-id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    context = f" [request_id={response.headers['x-request-id']} trace_id=4bf92f3577b34da6a3ce929d0e0e4736]"
    assert any(r.request_context == context and "site fra failed" in r.getMessage() for r in caplog.records)

    bad = await http.post(f"{url}/v1/chat/completions", json={**BODY, "max_tokens": -1}, headers=auth)
    assert bad.status_code == 400
    assert bad.headers["x-request-id"].startswith("req-") and len(bad.headers["x-edgefire-trace-id"]) == 32
