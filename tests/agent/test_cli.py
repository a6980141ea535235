"""`edgefire agent` as its own process: serves, and drains to a clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys

from grpc import aio

from node_agent.proto import agent_pb2
from tests.agent.conftest import MODEL, PEER_TOKEN, prompt, sampling


async def test_agent_process_serves_and_drains_on_sigterm(tmp_path, tiny_model_dir, unused_tcp_port, connect):
    config = tmp_path / "site.toml"
    config.write_text(f'site = "proc-1"\npeer_token = "{PEER_TOKEN}"\nkv_cache_bytes = 4194304\n'
                      f'metrics_listen = "none"\n[models]\n{MODEL} = "{tiny_model_dir}"\n')
    address = f"127.0.0.1:{unused_tcp_port}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.cli", "agent", "--config", str(config), "--grpc-listen", address,
        "--metrics-listen", "none", "--drain-timeout-s", "5", env={**os.environ, "EDGEFIRE_AGENT_DEVICE": "cpu"})
    client = connect(address)
    processes = [process]
    try:
        for _ in range(300):
            try:
                await client.health(timeout=1)
                break
            except aio.AioRpcError:
                await asyncio.sleep(0.1)
        stream = client.generate(agent_pb2.GenerateRequest(model=MODEL, prompt_ids=prompt(20),
                                                           sampling=sampling(max_tokens=40)))
        first = await stream.read()
        # a second agent given the same port refuses to start, and says why, rather than sharing the
        # port (gRPC's SO_REUSEPORT) and taking half of this one's requests
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deploy.cli", "agent", "--config", str(config), "--grpc-listen", address,
            "--metrics-listen", "none", env={**os.environ, "EDGEFIRE_AGENT_DEVICE": "cpu"},
            stderr=asyncio.subprocess.PIPE)
        processes.append(second)
        _, stderr = await asyncio.wait_for(second.communicate(), 60)
        assert second.returncode == 2
        assert f"grpc_listen {address}: cannot listen there" in stderr.decode()
        process.send_signal(signal.SIGTERM)
        rest = []
        while (chunk := await stream.read()) is not aio.EOF:
            rest.extend(chunk.tokens)
        assert len(first.tokens) + len(rest) == 40  # the in-flight request finished during the drain
        assert await asyncio.wait_for(process.wait(), 20) == 0
    finally:
        for started in processes:
            if started.returncode is None:
                started.kill()
                await started.wait()


async def test_agent_with_a_checkpoint_it_refuses_exits_2_naming_the_model(tmp_path, tiny_model_dir, unused_tcp_port):
    """A checkpoint the engine refuses ends the agent with one line naming the model, its directory and
    what is wrong (it was a 40-line traceback ending in 'missing tensor', and exit status 1, which
    supervisors read as a crash to restart)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (broken / "config.json").write_text(json.dumps(config))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deploy.cli", "agent", "--site", "proc-2", "--peer-token", PEER_TOKEN,
        "--model", f"{MODEL}={broken}", "--grpc-listen", f"127.0.0.1:{unused_tcp_port}", "--metrics-listen", "none",
        env={**os.environ, "EDGEFIRE_AGENT_DEVICE": "cpu"}, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    text = stderr.decode()
    assert process.returncode == 2, text
    assert f"cannot start: model {MODEL} ({broken}): checkpoint is missing tensor" in text
    assert "Traceback" not in text
