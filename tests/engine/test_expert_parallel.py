"""Expert-parallel MoE dispatch over gloo: two processes, each holding half of the experts, give
what one process holding all of them gives, for spread, skewed and tiny batches."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine import ops
from engine.expert_parallel import ExpertGroup, moe_forward_parallel
from engine.moe import MoEWeights, moe_forward

HIDDEN, INTER, NUM_EXPERTS, TOP_K = 32, 48, 4, 2
BATCHES = {"spread": 37, "one token": 1, "odd": 5}


def make_moe(skew: bool) -> MoEWeights:
    generator = torch.Generator().manual_seed(3)
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    if skew:  # expert 3's logit dwarfs the rest for every token: all of them go to the second rank
        router[3] = 0
        router[3, 0] = 1e4
    return MoEWeights(router, torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.2,
                      torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator) * 0.2, TOP_K, True)


def inputs(num_tokens: int, skew: bool) -> torch.Tensor:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    if skew:
        x[:, 0] = x[:, 0].abs() + 1
    return x


def _rank_main(rank: int, store_path: str, out_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = ExpertGroup(dist.ProcessGroupGloo(store, rank, 2, options), rank, 2, NUM_EXPERTS)
    out = {}
    for skew in (False, True):
        whole = make_moe(skew)
        local = MoEWeights(whole.router, whole.gate_up[group.local_experts].clone(),
                           whole.down[group.local_experts].clone(), TOP_K, True)
        for name, num_tokens in BATCHES.items():
            out[(skew, name)] = moe_forward_parallel(local, inputs(num_tokens, skew), group, ops)
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def two_rank_outputs(tmp_path_factory):
    """Each rank in its own process (`python -m` this file), as the engine runs ranks."""
    directory = tmp_path_factory.mktemp("ep")
    repo = Path(__file__).resolve().parents[2]
    processes = [subprocess.Popen([sys.executable, "-m", "tests.engine.test_expert_parallel", str(rank),
                                   str(directory / "store"), str(directory / f"rank{rank}.pt")], cwd=repo,
                                  stderr=subprocess.PIPE, text=True) for rank in range(2)]
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            break  # one failed: the other would wait on it until gloo's timeout
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    for rank, process in enumerate(processes):
        assert process.returncode == 0, f"rank {rank} failed: {process.stderr.read()[-2000:]}"
    return {rank: torch.load(directory / f"rank{rank}.pt") for rank in range(2)}


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "all on one rank's expert"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_two_ranks_match_one(two_rank_outputs, skew, batch):
    moe = make_moe(skew)
    x = inputs(BATCHES[batch], skew)
    expected = moe_forward(moe, x, ops)
    for rank in range(2):
        torch.testing.assert_close(two_rank_outputs[rank][(skew, batch)], expected, rtol=1e-5, atol=1e-6)
    if skew:
        from engine.moe import route
        _, ids = route(x, moe.router, TOP_K, True)
        assert (ids[:, 0] == 3).all()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
