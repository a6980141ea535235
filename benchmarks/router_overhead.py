"""Router overhead: the same streamed requests through the router and straight to an agent, in one run.

    .venv/bin/python benchmarks/router_overhead.py [--requests 400] [--seconds 5] [--concurrency 32]
                                                   [--tokens-per-message 4]

Three processes on loopback: a "cluster" (registry service + a fake agent that answers at once),
the router (uvicorn + uvloop, as `edgefire router` runs it), and this load generator (uvloop).
Latency is measured one request at a time, the two paths alternating; throughput with
`--concurrency` streams in flight, one path after the other. The direct path calls the agent's
Generate over gRPC; the router path posts a streamed chat completion (SSE) and reads to
`data: [DONE]`. Both ask for the same prompt and number of tokens. A third path goes through the
router to a second fake agent that sends `--tokens-per-message` tokens a message, as an agent does
with a speculative step's accepted tokens (or tokens that queued while its reader was behind): what
a message carrying several tokens saves the router. The HTTP client is a bare
keep-alive HTTP/1.1 protocol, so its own cost stays small next to the router's. The router's CPU
time per request (all its threads, over the throughput run) is read from the router process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "router")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.harness import HttpExchange, percentile, post_request  # noqa: E402

ADMIN, ROUTER_TOKEN = "bench-admin", "bench-router"
MESSAGES = [{"role": "user", "content": "What is the nearest edge site to Frankfurt?"}]


# --- cluster process: registry + instant fake agent ---------------------------------------------

def run_cluster(model_dir: str, db_path: str, tokens_per_message: int, conn) -> None:
    import uvloop
    uvloop.run(_cluster(model_dir, db_path, tokens_per_message, conn))


async def _cluster(model_dir: str, db_path: str, tokens_per_message: int, conn) -> None:
    import socket

    import uvicorn
    from router_fake_agent import FakeAgent, model_info_from_dir, word_token_ids

    from registry.client import RegistryClient
    from registry.migrate import upgrade_to_head
    from registry.service import create_app

    from node_agent.proto import agent_pb2

    info = model_info_from_dir(model_dir)
    agent = await FakeAgent("bench", info, word_token_ids(info)).start()
    batched_info = agent_pb2.ModelInfo()
    batched_info.CopyFrom(info)
    batched_info.model = f"{info.model}-batched"   # served by the batching agent alone
    batched = await FakeAgent("bench-batched", batched_info, word_token_ids(info)).start()
    batched.tokens_per_chunk = tokens_per_message
    url = f"sqlite:///{db_path}"
    upgrade_to_head(url)
    app = create_app(url, ADMIN, ROUTER_TOKEN)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    registry_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with RegistryClient(registry_url, ADMIN) as admin:
        for name, served, model in (("bench", agent, info.model), ("bench-batched", batched, batched_info.model)):
            await admin.create_site(name, region="eu", country="DE", lat=50.1, lon=8.7, grpc_address=served.address,
                                    models=[{"model": model, "role": "both"}], heartbeat_interval_s=600)
            site_token = (await admin.issue_site_token(name))["token"]
            async with RegistryClient(registry_url, site_token) as site:
                await site.heartbeat({"kv_blocks_total": 100000, "kv_blocks_free": 100000, "block_size": 16})
        api_key = (await admin.create_api_key("bench"))["key"]
    conn.send({"registry_url": registry_url, "agent": agent.address, "api_key": api_key, "model": info.model,
               "batched_model": batched_info.model})
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until told to stop
    server.should_exit = True
    await task
    await agent.stop()
    await batched.stop()


# --- router process -------------------------------------------------------------------------------

def run_router(registry_url: str, conn) -> None:
    if os.environ.get("BENCH_LOOP") == "asyncio":
        runner = asyncio.run
    else:
        import uvloop
        runner = uvloop.run
    if os.environ.get("BENCH_PROFILE"):
        import cProfile
        cProfile.runctx("runner(_router(registry_url, conn))", globals(), locals(), os.environ["BENCH_PROFILE"])
    else:
        runner(_router(registry_url, conn))


async def _router(registry_url: str, conn) -> None:
    import logging

    from router.config import RouterConfig
    from router.server import Router

    logging.basicConfig(level=logging.WARNING)
    config = RouterConfig(host="127.0.0.1", port=0, registry_url=registry_url, registry_token=ROUTER_TOKEN,
                          lat=50.1, lon=8.7)
    async with Router(config) as router:
        url = await router.start_server()
        conn.send(url)
        while await asyncio.get_running_loop().run_in_executor(None, conn.recv) == "cpu":
            conn.send(time.process_time())  # every thread of the router process (gRPC's poller too)


# --- load generator -------------------------------------------------------------------------------

class RoutedRequest:
    """The same streamed chat completion, posted again and again over one keep-alive connection
    (a bare protocol, `harness.HttpExchange`: the load generator shares the two cores with the
    router and the agent, so every microsecond it spends is one the router does not get)."""

    def __init__(self, host: str, port: int, api_key: str, body: bytes) -> None:
        self.host, self.port = host, port
        self.request = post_request(host, port, "/v1/chat/completions", body, api_key)
        self.connection: HttpExchange | None = None

    async def post(self) -> None:
        if self.connection is None:
            self.connection = await HttpExchange.open(self.host, self.port)
        await self.connection.exchange(self.request)
        if self.connection.status != 200:
            raise RuntimeError(self.connection.data.decode(errors="replace"))
        if b"data: [DONE]" not in self.connection.data[-64:]:
            raise RuntimeError("stream ended without [DONE]")


async def measure(args, cluster: dict, router_url: str, router_conn) -> dict:
    import grpc

    from node_agent.proto import agent_pb2, agent_pb2_grpc

    host, port = router_url.removeprefix("http://").split(":")
    def body(model: str) -> bytes:
        return json.dumps({"model": model, "messages": MESSAGES, "max_tokens": args.tokens, "temperature": 0,
                           "stream": True}).encode()
    channel = grpc.aio.insecure_channel(cluster["agent"])
    stub = agent_pb2_grpc.AgentStub(channel)
    # The same prompt ids the router sends, so both paths do the same agent work.
    from engine.tokenizer import ChatTokenizer
    tokenizer = ChatTokenizer.from_dir(args.model_dir)
    prompt_ids = tokenizer.encode_chat(MESSAGES)
    direct_request = agent_pb2.GenerateRequest(request_id="bench", model=cluster["model"], prompt_ids=prompt_ids,
                                               sampling=agent_pb2.SamplingParams(max_tokens=args.tokens))
    metadata = (("authorization", "Bearer x"), ("x-request-id", "bench"))

    async def direct(_i: int = 0) -> None:   # one channel for every worker
        async for _chunk in stub.Generate(direct_request, timeout=10, metadata=metadata):
            pass

    connections = [RoutedRequest(host, int(port), cluster["api_key"], body(cluster["model"]))
                   for _ in range(args.concurrency)]
    batched = [RoutedRequest(host, int(port), cluster["api_key"], body(cluster["batched_model"]))
               for _ in range(args.concurrency)]

    async def routed(i: int = 0) -> None:
        await connections[i].post()

    async def routed_batched(i: int = 0) -> None:
        await batched[i].post()

    paths = {"direct": direct, "router": routed, "router-batched": routed_batched}
    for call in paths.values():
        for _ in range(50):  # warm up: channels, tokenizer assets, caches
            await call()
    # Latency: the two paths alternate request by request, so both see the same load on the machine.
    latencies = {name: [] for name in paths}
    for _ in range(args.requests):
        for name, call in paths.items():
            start = time.perf_counter()
            await call()
            latencies[name].append((time.perf_counter() - start) * 1000)
    results = {}
    for name, call in paths.items():
        router_cpu = router_cpu_s(router_conn)
        rps = await throughput(call, args)
        # Router CPU per request served during the throughput run (~0 on the direct path: a check).
        cpu_ms = (router_cpu_s(router_conn) - router_cpu) * 1000 / (rps * args.seconds)
        results[name] = {"latencies": latencies[name], "rps": rps, "router_cpu_ms": cpu_ms}
    await channel.close()
    return results


def router_cpu_s(router_conn) -> float:
    router_conn.send("cpu")
    return router_conn.recv()


async def throughput(call, args) -> float:
    done = 0
    deadline = time.perf_counter() + args.seconds

    async def worker(i: int) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call(i)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    return done / (time.perf_counter() - start)


def main() -> int:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests per path for latency")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per streamed completion")
    parser.add_argument("--tokens-per-message", type=int, default=4,
                        help="tokens a message from the second fake agent carries (default 4)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        from engine.demo import make_demo_model
        args.model_dir = str(make_demo_model(Path(tmp) / "model", size="tiny"))
        cluster_conn, cluster_child = ctx.Pipe()
        cluster_proc = ctx.Process(target=run_cluster, args=(args.model_dir, str(Path(tmp) / "r.db"),
                                                             args.tokens_per_message, cluster_child))
        cluster_proc.start()
        cluster = cluster_conn.recv()
        router_conn, router_child = ctx.Pipe()
        router_proc = ctx.Process(target=run_router, args=(cluster["registry_url"], router_child))
        router_proc.start()
        router_url = router_conn.recv()
        try:
            results = uvloop.run(measure(args, cluster, router_url, router_conn))
        finally:
            router_conn.send("stop")
            cluster_conn.send("stop")
            router_proc.join(20)
            cluster_proc.join(20)
    direct, routed = results["direct"]["latencies"], results["router"]["latencies"]
    print(f"streamed completions of {args.tokens} tokens; latency over {args.requests} sequential requests, "
          f"throughput over {args.seconds:g} s at concurrency {args.concurrency}; router-batched: "
          f"{args.tokens_per_message} tokens a message from its agent")
    print(f"{'path':14} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'router CPU ms/req':>18}")
    for name, result in results.items():
        values = result["latencies"]
        print(f"{name:14} {percentile(values, 0.5):8.3f} {percentile(values, 0.99):8.3f} {result['rps']:8.1f} "
              f"{result['router_cpu_ms']:18.3f}")
    print(f"added by the router: p50 {percentile(routed, 0.5) - percentile(direct, 0.5):.3f} ms, "
          f"p99 {percentile(routed, 0.99) - percentile(direct, 0.99):.3f} ms; "
          f"router streamed requests/s {results['router']['rps']:.1f}; with {args.tokens_per_message} tokens a "
          f"message: router CPU {results['router-batched']['router_cpu_ms'] / results['router']['router_cpu_ms']:.2f}x, "
          f"{results['router-batched']['rps']:.1f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
