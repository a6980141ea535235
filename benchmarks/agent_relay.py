"""Agent relay cost: the CPU an agent's event loop spends passing a step's tokens to their streams,
against the same messages from a bare gRPC server, in one run.

    .venv/bin/python benchmarks/agent_relay.py [--batches 1,8,32,64] [--tokens 300] [--seconds 3] [--size tiny]

An agent streams every request's tokens over its own gRPC stream (Generate/Decode): after each
step the engine thread hands the step's tokens to the event loop, which writes one message per
request. That loop shares the process's GIL, and on a one-core site its core, with the engine's
step: whatever it spends per message is time a step waits. On a GPU site the step costs the CPU
little, but a batch of 256 makes 256 messages a step.

Two processes held to separate CPUs where taskset allows: the server (first the real agent,
`edgefire agent` with the demo model, one torch thread; then a bare gRPC server of the same
service that answers Generate with prebuilt messages, as fast as its readers take them) and this
load generator, which runs `batch` concurrent Generate streams of `--tokens` tokens each. The
server's CPU is read per thread from /proc over each run: the agent's event loop (its main
thread), its engine thread (the busiest other thread), and the bare server's loop. "Relay per
message" is the agent loop's CPU over the messages it wrote; the bare server's figure is what
gRPC alone costs a message in this process model, the floor for one message per request per step.

Each batch runs twice on the same agent: per-request streams (Generate), then the same requests over
one Session stream (node_agent.client.AgentSession, the router's default), where the agent writes one
message per step for all of them. The comparison is the agent loop's CPU per token of each.
Linux only (/proc, taskset).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import endless_model, log, machine_line, markdown_table  # noqa: E402
from node_agent.auth import token_digest  # noqa: E402

TOKEN = "bench-relay"             # the agent token this load generator presents, as a router does
PEER_TOKEN = "bench-relay-peer"
MODEL = "bench"

# A bare server of the agent's service: Generate answers `max_tokens` one-token messages at once.
_BARE = """
import asyncio, sys
sys.path.insert(0, {root!r})
from grpc import aio
from node_agent.proto import agent_pb2, agent_pb2_grpc

class Bare(agent_pb2_grpc.AgentServicer):
    async def Generate(self, request, context):
        for i in range(request.sampling.max_tokens):
            yield agent_pb2.TokenChunk(tokens=[agent_pb2.Token(token_id=i % 1000)],
                                       finish_reason="length" if i == request.sampling.max_tokens - 1 else "")

async def main():
    server = aio.server()
    agent_pb2_grpc.add_AgentServicer_to_server(Bare(), server)
    server.add_insecure_port({address!r})
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_ticks(pid: int) -> dict[int, int]:
    """user + system clock ticks of each thread of a process."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def pinned(cpu: int | None, argv: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


async def run_streams(address: str, batch: int, tokens: int, min_seconds: float,
                      sessions: bool = False) -> tuple[int, int, float]:
    """(messages, tokens) the server sent over rounds of `batch` concurrent streams lasting at least
    `min_seconds`, and the seconds they took. `sessions`: every stream over one Session, whose
    messages are the batches the agent wrote."""
    from node_agent.client import AgentClient
    from node_agent.proto import agent_pb2

    async def one(client: AgentClient, index: int) -> tuple[int, int]:
        request = agent_pb2.GenerateRequest(
            model=MODEL, prompt_ids=[5 + index % 50] * 16, request_id=f"relay-{index}",
            sampling=agent_pb2.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        messages = received = 0
        async for chunk in client.generate(request):
            messages += 1
            received += len(chunk.tokens)
        return messages, received

    messages = received = 0
    async with AgentClient(address, TOKEN, sessions=sessions) as client:
        await one(client, -1)  # the connection and the first request's warm-up stay out of the figures
        session = client._session
        if sessions and session is None:
            raise RuntimeError("the agent did not keep the Session open")
        batches_before = session.num_batches if sessions else 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < min_seconds:  # long enough for /proc's clock ticks
            for m, t in await asyncio.gather(*(one(client, i) for i in range(batch))):
                messages, received = messages + m, received + t
        if sessions:
            messages = session.num_batches - batches_before
    return messages, received, elapsed


def measure(pid: int, address: str, batch: int, tokens: int, min_seconds: float, sessions: bool = False) -> dict:
    before = thread_ticks(pid)
    messages, received, elapsed = asyncio.run(run_streams(address, batch, tokens, min_seconds, sessions))
    after = thread_ticks(pid)
    used = {tid: (after[tid] - before.get(tid, 0)) / os.sysconf("SC_CLK_TCK") for tid in after}
    loop_s = used.pop(pid, 0.0)
    engine_s = max(used.values(), default=0.0)
    return {"messages": messages, "tokens": received, "seconds": elapsed, "loop_s": loop_s, "engine_s": engine_s,
            "other_s": sum(used.values()) - engine_s}


def wait_ready(address: str, timeout: float = 120.0) -> None:
    from node_agent.client import AgentClient

    async def probe() -> None:
        async with AgentClient(address, TOKEN) as client:
            await client.health(timeout=2)

    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(probe())
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64", help="concurrent streams per run (default 1,8,32,64)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per stream (default 300)")
    parser.add_argument("--seconds", type=float, default=3.0, help="the least each run lasts (default 3)")
    parser.add_argument("--size", default="tiny", help="demo model size (default tiny: the step costs little, "
                                                       "as on a GPU)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[1], cpus[0]) if len(cpus) > 1 and shutil.which("taskset") else (None, None)
    if client_cpu is not None:
        os.sched_setaffinity(0, [client_cpu])
    print(machine_line())
    log(f"server on CPU {server_cpu}, load generator on CPU {client_cpu}; {args.tokens} tokens a stream")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="edgefire-relay-") as tmp:
        model_dir = endless_model(Path(tmp) / "model", args.size)
        grpc_port, metrics_port, kv_port = free_port(), free_port(), free_port()
        config = Path(tmp) / "agent.toml"
        config.write_text(f'site = "relay"\ngrpc_listen = "127.0.0.1:{grpc_port}"\n'
                          f'metrics_listen = "127.0.0.1:{metrics_port}"\npeer_token = "{PEER_TOKEN}"\n'
                          f'agent_token_sha256 = "{token_digest(TOKEN)}"\n'
                          f'kv_data_port = {kv_port}\nmax_num_seqs = {max(batches) + 1}\n'
                          f'max_waiting = {max(batches) + 1}\ndevice = "cpu"\n'
                          f'dtype = "float32"\n[models]\n{MODEL} = "{model_dir}"\n')
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        log("starting the agent")
        agent = subprocess.Popen(pinned(server_cpu, [sys.executable, "-m", "deploy.cli", "--log-level", "WARNING",
                                                     "agent", "--config", str(config)]), cwd=ROOT, env=env)
        try:
            address = f"127.0.0.1:{grpc_port}"
            wait_ready(address)
            for batch in batches:
                rows[("agent", batch)] = measure(agent.pid, address, batch, args.tokens, args.seconds)
                log(f"agent, {batch} streams: {rows[('agent', batch)]}")
                rows[("session", batch)] = measure(agent.pid, address, batch, args.tokens, args.seconds, True)
                log(f"agent, {batch} requests over one session: {rows[('session', batch)]}")
        finally:
            agent.terminate()
            agent.wait(timeout=30)
        bare_port = free_port()
        bare = subprocess.Popen(pinned(server_cpu, [sys.executable, "-c",
                                                    _BARE.format(root=str(ROOT), address=f"127.0.0.1:{bare_port}")]),
                                stdout=subprocess.PIPE, text=True, env=env)
        try:
            bare.stdout.readline()
            for batch in batches:
                rows[("bare", batch)] = measure(bare.pid, f"127.0.0.1:{bare_port}", batch, args.tokens, args.seconds)
                log(f"bare gRPC server, {batch} streams: {rows[('bare', batch)]}")
        finally:
            bare.terminate()
            bare.wait(timeout=30)
    table = [("streams", "agent messages / tokens", "agent tokens/s", "relay per message (agent loop)",
              "gRPC alone per message (bare server)", "engine thread per token", "loop share of the agent's CPU")]
    for batch in batches:
        a, b = rows[("agent", batch)], rows[("bare", batch)]
        per_message = a["loop_s"] / a["messages"] * 1e6
        floor = b["loop_s"] / b["messages"] * 1e6
        total = a["loop_s"] + a["engine_s"] + a["other_s"]
        table.append((batch, f"{a['messages']} / {a['tokens']}", f"{a['tokens'] / a['seconds']:.0f}",
                      f"{per_message:.1f} us", f"{floor:.1f} us", f"{a['engine_s'] / a['tokens'] * 1e6:.1f} us",
                      f"{a['loop_s'] / total:.0%}" if total else "-"))
    print()
    print(markdown_table(table))
    table = [("streams", "per-request: messages / tokens", "per-request: agent loop per token",
              "session: messages / tokens", "session: agent loop per token", "session: tokens/s",
              "session: loop share of the agent's CPU")]
    for batch in batches:
        a, s = rows[("agent", batch)], rows[("session", batch)]
        total = s["loop_s"] + s["engine_s"] + s["other_s"]
        table.append((batch, f"{a['messages']} / {a['tokens']}", f"{a['loop_s'] / a['tokens'] * 1e6:.1f} us",
                      f"{s['messages']} / {s['tokens']}", f"{s['loop_s'] / s['tokens'] * 1e6:.1f} us",
                      f"{s['tokens'] / s['seconds']:.0f}", f"{s['loop_s'] / total:.0%}" if total else "-"))
    print()
    print(markdown_table(table))
    biggest, session = rows[("agent", batches[-1])], rows[("session", batches[-1])]
    per_message = biggest["loop_s"] / biggest["messages"]
    print(f"\nAt {per_message * 1e6:.0f} us a message, a step of 256 requests costs the event loop "
          f"{256 * per_message * 1e3:.1f} ms of relaying (one message per request per step), with the GIL held; "
          f"over a session, at {session['loop_s'] / session['tokens'] * 1e6:.0f} us a token, "
          f"{256 * session['loop_s'] / session['tokens'] * 1e3:.1f} ms.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
