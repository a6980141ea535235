"""KV transfer between two agents on loopback, in clear and over TLS, beside a raw TCP copy of the same bytes, in one run.

Two source agents run as their own processes (`edgefire agent`): one in clear, one with TLS (a
local CA from deploy.tls, client certificates demanded, as `edgefire up --tls` runs them). Each
prefills a long prompt; this process pulls the KV exactly as a decode agent does (data port or
FetchKV stream -> checked, checksummed KVPayload) and times it. Then a separate sender process
writes the same number of bytes over a plain loopback TCP socket into a preallocated buffer here:
the ceiling for any protocol on this machine. Each round runs every pull and the raw copy back to
back, so all see the same load from whatever else the machine runs; the ratio reported is the
median of the per-round ratios.

    .venv/bin/python benchmarks/kv_transfer.py [--prompt-tokens 4000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKEN = "bench-token"
SENDER = """
import socket, sys
n, port = int(sys.argv[1]), int(sys.argv[2])
block = memoryview(bytes(4 << 20))
with socket.create_connection(("127.0.0.1", port)) as s:
    while n:
        sent = s.send(block[:min(n, len(block))])
        n -= sent
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_tcp_copy(num_bytes: int) -> float:
    """Seconds to receive num_bytes from another process over loopback TCP."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(num_bytes), str(server.getsockname()[1])])
    conn, _ = server.accept()
    started = time.perf_counter()
    received = 0
    while received < num_bytes:
        n = conn.recv_into(view[received:], num_bytes - received)
        if not n:
            raise RuntimeError("sender closed early")
        received += n
    elapsed = time.perf_counter() - started
    conn.close()
    server.close()
    sender.wait(30)
    return elapsed


async def wait_ready(client, process, timeout_s: float = 120) -> None:
    from grpc import aio

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await client.health(timeout=1)
            return
        except aio.AioRpcError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("agent A did not start") from None
            await asyncio.sleep(0.2)


@dataclass(slots=True)
class Source:
    """A source agent as a decode agent sees it: its client, data port and TLS context."""
    client: object            # node_agent.client.AgentClient
    data_address: str
    ssl_context: object       # ssl.SSLContext | None


PATHS = {  # path name -> (source, how)
    "data port": ("plain", "data port"), "FetchKV": ("plain", "FetchKV"),
    "data port, TLS": ("tls", "data port"), "FetchKV, TLS": ("tls", "FetchKV"),
}


async def kv_transfers(sources: dict[str, Source], prompt_tokens: int, repeats: int) -> tuple[int, dict[str, list[float]], float]:
    """Pull the same prompt's KV over both paths a decode agent has (the KV data port and FetchKV), in clear and over TLS."""
    from engine.kv_transfer import KVLayout
    from node_agent.kv_data import receive_bulk
    from node_agent.proto import agent_pb2
    from node_agent.transfer import receive_payload

    prompt_ids = [(7 + 13 * i) % 500 + 5 for i in range(prompt_tokens)]  # inside any demo vocabulary
    params = agent_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    times = {path: [] for path in [*PATHS, "raw"]}
    first_prefill = None
    for round_index in range(repeats + 1):  # the first pull warms the channels; repeats hit the prefix cache
        for path, (source_name, how) in PATHS.items():
            source = sources[source_name]
            started = time.perf_counter()
            result = await source.client.prefill(agent_pb2.PrefillRequest(model="small", prompt_ids=prompt_ids,
                                                                          sampling=params), timeout=300)
            first_prefill = first_prefill or time.perf_counter() - started
            layout = KVLayout.from_json(result.kv_layout)
            started = time.perf_counter()
            if how == "data port":  # what Decode does (it learns the port once, from Health)
                payload = await receive_bulk(source.data_address, TOKEN, result.kv_handle, layout, prompt_ids,
                                             timeout=60, ssl_context=source.ssl_context)
            else:
                payload = await receive_payload(source.client.fetch_kv(result.kv_handle, timeout=60), layout,
                                                prompt_ids)
            times[path].append(time.perf_counter() - started)
            assert payload.num_bytes == result.kv_bytes
        # the raw copy in the same round, so every path sees the same load from whatever else runs
        times["raw"].append(await asyncio.to_thread(raw_tcp_copy, result.kv_bytes))
        print(f"round {round_index}{' (warm-up)' if not round_index else ''}: "
              + ", ".join(f"{path} {t[-1] * 1e3:.0f} ms" for path, t in times.items()), flush=True)
    return result.kv_bytes, {path: t[1:] for path, t in times.items()}, first_prefill


def write_tls_files(directory: Path) -> dict[str, str]:
    from deploy.tls import LocalCA

    ca = LocalCA()
    cert, key = ca.issue("bench", ["127.0.0.1", "localhost"])
    files = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    for name, pem in (("ca", ca.cert_pem), ("cert", cert), ("key", key)):
        files[name].write_bytes(pem)
    return {name: str(path) for name, path in files.items()}


def start_agent(site: str, model_dir: Path, address: str, chunk_bytes: int, tls: dict[str, str] | None):
    tls_flags = ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"],
                 "--tls-client-ca", tls["ca"]] if tls else []
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "--log-level", "WARNING", "agent", "--site", site,
         "--model", f"small={model_dir}", "--peer-token", TOKEN, "--grpc-listen", address,
         "--metrics-listen", "none", "--kv-cache-bytes", str(512 << 20), "--kv-lease-ttl-s", "120",
         "--kv-chunk-bytes", str(chunk_bytes), "--device", "cpu", "--dtype", "float32", *tls_flags],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-chunk-bytes", type=int, default=1 << 20, help="agent A's KV chunk size")
    args = parser.parse_args()

    from engine.demo import make_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_demo_model(Path(tmp) / "small", size="small")
        tls = write_tls_files(Path(tmp))
        addresses = {"plain": f"127.0.0.1:{free_port()}", "tls": f"127.0.0.1:{free_port()}"}
        agents = {name: start_agent(f"bench-{name}", model_dir, address, args.kv_chunk_bytes,
                                    tls if name == "tls" else None) for name, address in addresses.items()}
        print(f"agents starting (clear on {addresses['plain']}, TLS on {addresses['tls']}) ...", flush=True)
        try:
            async def run():
                from node_agent.client import AgentClient
                from node_agent.tls import channel_credentials, client_context

                credentials = {"plain": None, "tls": channel_credentials(tls["ca"], tls["cert"], tls["key"])}
                ssl_contexts = {"plain": None, "tls": client_context(tls["ca"], tls["cert"], tls["key"])}
                clients = {name: AgentClient(address, TOKEN, credentials=credentials[name])
                           for name, address in addresses.items()}
                try:
                    sources = {}
                    for name, client in clients.items():
                        await wait_ready(client, agents[name])
                        port = (await client.health()).kv_data_port
                        sources[name] = Source(client, f"127.0.0.1:{port}", ssl_contexts[name])
                    print("agents ready; prefilling and pulling ...", flush=True)
                    return await kv_transfers(sources, args.prompt_tokens, args.repeats)
                finally:
                    for client in clients.values():
                        await client.close()

            num_bytes, kv_times, prefill_s = asyncio.run(run())
        finally:
            for agent in agents.values():
                agent.terminate()
            for agent in agents.values():
                agent.wait(30)

    raw_times = kv_times.pop("raw")
    mb = num_bytes / 1e6
    print(f"KV of a {args.prompt_tokens}-token prompt (demo 'small', float32): {mb:.1f} MB in "
          f"{args.kv_chunk_bytes >> 10} KiB chunks; first prefill {prefill_s:.2f}s; {len(raw_times)} rounds")
    print(f"{'path':40}{'best MB/s':>11}{'median MB/s':>13}{'median of per-round ratio to raw':>34}")
    rows = [(f"KV transfer, {path} (verified)", times) for path, times in kv_times.items()]
    for name, times in rows + [("raw loopback TCP copy", raw_times)]:
        ratios = sorted(raw / t for raw, t in zip(raw_times, times))
        print(f"{name:40}{mb / min(times):11.1f}{mb / sorted(times)[len(times) // 2]:13.1f}"
              f"{ratios[len(ratios) // 2]:34.0%}")
    ratios = sorted(raw / t for raw, t in zip(raw_times, kv_times["data port"]))
    verdict = "met" if ratios[len(ratios) // 2] >= 0.5 else "missed"
    print(f"target: the KV transfer Decode uses (data port) >= 50% of the raw copy (median round): {verdict}")
    tls_cost = sorted(tls_t / plain_t for tls_t, plain_t in zip(kv_times["data port, TLS"], kv_times["data port"]))
    print(f"TLS on the data port: {tls_cost[len(tls_cost) // 2]:.2f}x the plaintext time (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
