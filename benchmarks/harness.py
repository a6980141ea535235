"""What the cluster benchmarks share: a cluster of real processes on loopback that cleans up after
itself, a demo model that never stops early, and streamed completions timed token by token.

`running_cluster` starts a `deploy.launcher.Cluster` (the one `edgefire up` runs) on free ports in
a temporary state directory and always stops it: on return, on an error and on Ctrl-C or SIGTERM.
Agents can be held to CPUs (`SiteSpec.cpus`), so two sites on one machine do not borrow each
other's cores.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.cluster_config import ClusterConfig, SiteSpec  # noqa: E402
from deploy.launcher import Cluster  # noqa: E402

# Every benchmark site stands in one city, so client distance favours none of them.
CITY = ("frankfurt", "eu-central", "DE", 50.11, 8.68)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def endless_model(out_dir: Path, size: str, model_dir: Path | None = None) -> Path:
    """A checkpoint (the demo model of `size` unless `model_dir` is given) with no end-of-text token,
    so every answer runs to max_tokens and both sides of a comparison generate the same amount."""
    from engine.demo import make_demo_model

    out_dir = Path(out_dir)
    if model_dir is None:
        make_demo_model(out_dir, size)
    else:
        shutil.copytree(model_dir, out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return out_dir


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def site(name: str, role: str, cpus: list[int] | None = None) -> SiteSpec:
    _, region, country, lat, lon = CITY
    return SiteSpec(name, region, country, lat, lon, role, cpus=list(cpus or []))


def cpu_for_sites(num_sites: int) -> list[list[int]]:
    """One CPU per site, round robin over the CPUs this process may use (sites share when too few)."""
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not available or not shutil.which("taskset"):
        return [[] for _ in range(num_sites)]
    return [[available[i % len(available)]] for i in range(num_sites)]


# One thread of small matmuls for about half a second: the work of a one-core site.
_PROBE = ("import time, torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nfor _ in range(50): a @ a\n"
          "started = time.perf_counter()\nfor _ in range(4000): a @ a\nprint(time.perf_counter() - started)")
# Spins until killed, or until its parent is gone (a benchmark stopped by SIGTERM runs no `finally`).
# The parent's pid comes as an argument: read with os.getppid() after the slow torch import, it would be
# init's for a spinner whose parent died meanwhile, and the loop would never end.
_SPIN = ("import os, sys, torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nparent = int(sys.argv[1])\n"
         "while os.getppid() == parent:\n    for _ in range(100): a @ a")


def core_interference(cpus: list[list[int]]) -> float | None:
    """How many times longer one thread of matmuls takes on the first site's CPU while the second site's
    CPU runs the same loop (1.0: the two CPUs are independent; 2.0: they are one core's two hardware
    threads, or share what limits it). None where the sites are not held to separate CPUs."""
    if len(cpus) < 2 or not cpus[0] or not cpus[1] or cpus[0] == cpus[1]:
        return None

    def timed() -> float:
        out = subprocess.run(["taskset", "-c", str(cpus[0][0]), sys.executable, "-c", _PROBE],
                             capture_output=True, text=True, check=True)
        return float(out.stdout)

    alone = min(timed() for _ in range(2))
    spinner = subprocess.Popen(["taskset", "-c", str(cpus[1][0]), sys.executable, "-c", _SPIN, str(os.getpid())])
    try:
        time.sleep(1.0)  # past the spinner's import
        busy = min(timed() for _ in range(2))
    finally:
        spinner.kill()
        spinner.wait()
    return busy / alone


def pin_process(pid: int, cpus: list[int]) -> None:
    """Hold every thread of a running process to these CPUs (threads it starts later inherit it).
    Linux only; a thread that ends meanwhile is skipped."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def set_priority(pid: int, nice: int) -> None:
    """Give every thread of a running process this nice value (threads it starts later inherit it;
    a negative one needs root). Linux only; a thread that ends meanwhile is skipped."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (ProcessLookupError, FileNotFoundError):
            continue


@contextmanager
def running_cluster(model_dir: Path, model_name: str, sites: list[SiteSpec], state_dir: Path,
                    agent: dict | None = None, router: dict | None = None) -> Iterator[Cluster]:
    config = ClusterConfig(model_dir=model_dir, model_name=model_name, sites=sites, state_dir=state_dir,
                           router_port=0, registry_port=0,
                           agent={"device": "cpu", "dtype": "float32", **(agent or {})}, router=router or {})
    cluster = Cluster(config)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so `finally` blocks stop the clusters either way."""
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def random_prompt(rng: random.Random, num_tokens: int, vocab: int) -> list[int]:
    """Token ids no other request shares a first block with, so nothing hits the prefix cache by chance."""
    return [rng.randrange(5, vocab) for _ in range(num_tokens)]


@dataclass(slots=True)
class StreamResult:
    kind: str
    started: float
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)   # perf_counter at which each token arrived
    num_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_site: str = ""
    decode_site: str = ""
    text: str = ""
    error: str = ""

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def split(self) -> bool:
        return self.prefill_site != self.decode_site


class HttpExchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time.

    While an answer streams in, it only keeps each read with the moment it arrived; the answer is
    parsed once it is whole. The load generator shares the machine's cores with the router and the
    sites, so the less it does per token, the less it delays the tokens it times.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reads: list[tuple[float, int]] = []   # (perf_counter, bytes received so far) per read
        self.data = bytearray()
        self.done: asyncio.Future | None = None
        self.head_end = -1
        self.status = 0
        self.headers: dict[str, str] = {}          # lower-case names
        self.length: int | None = None            # Content-Length; None: chunked
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> HttpExchange:
        connection = cls()
        await asyncio.get_running_loop().create_connection(lambda: connection, host, port)
        return connection

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the router closed the connection before the answer ended"))

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.reads.append((time.perf_counter(), len(self.data)))
        if self.head_end < 0:
            self.head_end = self.data.find(b"\r\n\r\n")
            if self.head_end < 0:
                return
            self.head_end += 4
            self._parse_head()
        if (self.data.endswith(b"\r\n0\r\n\r\n") if self.length is None
                else len(self.data) - self.head_end >= self.length):
            self.done.set_result(None)

    def _parse_head(self) -> None:
        lines = bytes(self.data[:self.head_end - 4]).decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if "content-length" in self.headers:
            self.length = int(self.headers["content-length"])

    async def exchange(self, request: bytes, timeout: float | None = None) -> None:
        """Sends a whole request and returns once its whole answer is in (`status`, `headers`, `body()`)."""
        self.reads.clear()
        self.data.clear()
        self.head_end, self.status, self.length = -1, 0, None
        self.headers = {}
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await asyncio.wait_for(self.done, timeout)

    def body(self) -> list[tuple[bytes, float]]:
        """The body's pieces in order, each with the moment its last byte arrived."""
        ends = [n for _, n in self.reads]
        when = lambda offset: self.reads[bisect.bisect_left(ends, offset)][0]  # noqa: E731
        if self.length is not None:
            return [(bytes(self.data[self.head_end:self.head_end + self.length]), when(self.head_end + self.length))]
        pieces, at = [], self.head_end
        while True:
            line_end = self.data.index(b"\r\n", at)
            size = int(bytes(self.data[at:line_end]).split(b";")[0], 16)
            if size == 0:
                return pieces
            start = line_end + 2
            pieces.append((bytes(self.data[start:start + size]), when(start + size)))
            at = start + size + 2


def post_request(host: str, port: int, path: str, payload: bytes, api_key: str = "",
                 headers: dict[str, str] | None = None) -> bytes:
    """The bytes of an HTTP/1.1 POST of a JSON payload."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}"]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class StreamClient:
    """Streamed completions against a router, timed token by token, over bare keep-alive connections."""

    def __init__(self, base_url: str, api_key: str = "", timeout: float = 300.0) -> None:
        url = httpx.URL(base_url)
        self.host, self.port, self.timeout = url.host, url.port or 80, timeout
        self.api_key = api_key
        self.idle: list[HttpExchange] = []

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        for connection in self.idle:
            connection.transport.close()
        self.idle.clear()

    async def stream(self, path: str, body: dict, kind: str = "", headers: dict | None = None) -> StreamResult:
        """One streamed completion (`/v1/completions` or `/v1/chat/completions`), timed per SSE event."""
        payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
        request = post_request(self.host, self.port, path, payload, self.api_key, headers)
        result = StreamResult(kind, time.perf_counter())
        connection = None
        try:
            connection = self.idle.pop() if self.idle else None
            if connection is None or connection.closed:
                connection = await HttpExchange.open(self.host, self.port)
            await connection.exchange(request, self.timeout)
        except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
            if connection is not None and connection.transport is not None:
                connection.transport.close()
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        pieces = connection.body()
        if connection.headers.get("connection", "").lower() != "close":
            self.idle.append(connection)
        else:
            connection.transport.close()
        result.prefill_site = connection.headers.get("x-edgefire-prefill-site", "")
        result.decode_site = connection.headers.get("x-edgefire-decode-site", "")
        if connection.status != 200:
            result.error = f"HTTP {connection.status}: {b''.join(p for p, _ in pieces)[:200]!r}"
            return result
        _read_events(result, pieces)
        return result


def _read_events(result: StreamResult, pieces: list[tuple[bytes, float]]) -> None:
    """Fills `result` from an SSE body's pieces, each token timed by the arrival of its event's end."""
    finish, pending = None, b""
    for piece, arrived in pieces:
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            line = event.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                result.error = data["error"]["message"][:200]
                return
            if data.get("usage"):
                usage = data["usage"]
                result.num_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for choice in data["choices"]:
                finish = choice.get("finish_reason") or finish
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                # With `logprobs` asked for, a chunk lists its tokens (an agent step can carry
                # several); without, text held back for incomplete UTF-8 can merge tokens.
                logprobs = choice.get("logprobs") or {}
                num_tokens = len(logprobs.get("tokens") or logprobs.get("content") or ()) or (1 if text else 0)
                if not num_tokens:
                    continue  # the role chunk, a bare finish chunk
                if result.ttft_s is None:
                    result.ttft_s = arrived - result.started
                result.token_times.extend([arrived] * num_tokens)
                result.text += text
    if finish not in ("stop", "length"):
        result.error = f"stream ended without a finish reason after {len(result.token_times)} tokens"
    elif result.ttft_s is None:
        result.error = "no token was seen (ask for logprobs to see tokens whose text is held back)"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def markdown_table(rows: list[tuple]) -> str:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs, 1-minute load {load:.2f}, {time.strftime('%Y-%m-%d %H:%M')}"
