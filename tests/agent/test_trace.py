"""A request's trace across two agents: the decode site pulls the prefill site's KV over the data
port (no metadata there: the prefill site finds the trace by the lease), and every log line either
site writes about the request names its request id and trace id."""

from __future__ import annotations

import logging

from node_agent.proto import agent_pb2
from node_agent.trace import RequestLogFilter, bind, new_trace
from tests.agent.conftest import MODEL, collect, prompt, sampling


async def test_both_sites_log_a_split_request_under_its_trace(start_agent, connect, caplog):
    a, b = await start_agent("site-a"), await start_agent("site-b")
    client_a, client_b = connect(a), connect(b)
    caplog.handler.addFilter(RequestLogFilter())
    caplog.set_level(logging.INFO, logger="node_agent")
    trace = new_trace()
    bind("req-traced", trace)  # as the router does: the calls below carry its traceparent
    prompt_ids = prompt(40)
    result = await client_a.prefill(agent_pb2.PrefillRequest(request_id="req-traced", model=MODEL,
                                                             prompt_ids=prompt_ids, sampling=sampling()))
    await collect(client_b.decode(agent_pb2.DecodeRequest(
        request_id="req-traced", model=MODEL, prompt_ids=prompt_ids, generated_ids=[result.first_token.token_id],
        sampling=sampling(), kv_source=agent_pb2.KVSource(address=a.address, kv_handle=result.kv_handle))))
    assert b.metrics.kv_pulls.labels("site-a", "data_port")._value.get() == 1

    about = [r for r in caplog.records if r.name.startswith("node_agent") and "site-" not in r.getMessage()
             and ("prefill" in r.getMessage() or "decode" in r.getMessage() or "KV lease" in r.getMessage())]
    messages = [r.getMessage() for r in about]
    # the prefill site: the prefill, then the export the decode site read over the data port
    assert any(m.startswith("prefill tiny: 40 prompt tokens") for m in messages)
    assert any(m.startswith(f"KV lease {result.kv_handle}: export of") for m in messages)
    assert any(m.startswith(f"KV lease {result.kv_handle}: export closed") for m in messages)
    # the decode site: its start (naming the source) and its end
    assert any(m.startswith("decode tiny: 40 prompt + 1 generated tokens") and a.address in m for m in messages)
    assert any(m.startswith("decode tiny done: 11 token(s)") for m in messages)  # the 1st came from the prefill
    assert all(r.request_context == f" [request_id=req-traced trace_id={trace.trace_id}]" for r in about), \
        [(r.getMessage(), r.request_context) for r in about]
