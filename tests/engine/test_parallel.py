"""Tensor- and pipeline-parallel engines (gloo, CPU) compute what the single-process engine computes.

Multi-rank engines are expensive to start (every rank imports torch), so each (checkpoint, layout)
engine starts once per module and serves every check: logits against transformers and against the
single-process engine; one workload with batched requests, chunked prefills, a prefix-cache hit, a
preemption, a seeded sampled request and an abort, whose tokens must equal the single-process
engine's; KV moved between every pair of layouts; and last, a rank killed mid-generation.
Run them alone with `pytest -m parallel`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.errors import RankFailedError
from engine.parallel.layout import ParallelLayout, kv_head_range
from engine.sampling import SamplingParams
from engine.config import load_config
from tests.engine.conftest import _llama, _qwen2, _qwen3, _qwen3_moe, _randomize
from tests.engine.test_mechanics import moved

pytestmark = pytest.mark.parallel

CHECKPOINTS = {
    "llama-gqa": lambda: _llama(num_hidden_layers=4),                                  # 4 heads, 2 KV heads
    "qwen2-tied": lambda: _qwen2(num_hidden_layers=4, tie_word_embeddings=True),       # q/k/v bias, tied head
    "qwen3-mqa": lambda: _qwen3(num_hidden_layers=4, num_key_value_heads=1),           # q/k norm, 1 KV head < tp
    "qwen3-moe": _qwen3_moe,                                # experts in layers 0 and 2, a dense MLP in layer 1
}
# every layout on Llama (it also carries the KV layout pairs); TP x PP on two more; the MoE model
# on stages (TP does not split experts)
CASES = [("llama-gqa", (2, 1)), ("llama-gqa", (1, 2)), ("llama-gqa", (2, 2)),
         ("qwen2-tied", (2, 2)), ("qwen3-mqa", (2, 2)), ("qwen3-moe", (1, 2))]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
NUM_BLOCKS = 16     # in every layout, so every engine meets the same pressure on its pool
BLOCK_SIZE = 8
PROMPT = [5, 17, 260, 3, 99, 41, 41, 7, 150, 310, 2, 64, 88, 12, 19, 200, 201, 202, 17, 5, 1, 9, 33, 47,
          58, 61, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190]


def _kv_budget(model_dir: Path, layout: ParallelLayout) -> int:
    """Per-rank KV bytes that hold NUM_BLOCKS blocks on the rank with the most layers and KV heads."""
    cfg = load_config(model_dir)
    layers = max(len(r) for r in layout.stages(cfg))  # KV: every layer of a stage, dense or not
    heads = len(kv_head_range(cfg.num_kv_heads, layout.tp, 0))
    return NUM_BLOCKS * cfg.kv_parts * layers * BLOCK_SIZE * heads * cfg.head_dim * 4


class Engines:
    """Engines by (checkpoint, layout), started on first use and stopped with the module. A layout is
    (tp, pp) or (tp, pp, ep)."""

    def __init__(self, root: Path, checkpoints: dict = CHECKPOINTS):
        self.root = root
        self.checkpoints = checkpoints
        self.references: dict[str, torch.nn.Module] = {}
        self.started: dict[tuple[str, tuple[int, ...]], LLMEngine] = {}

    def adjust(self, name: str, model: torch.nn.Module) -> None:
        """Change a randomized checkpoint before it is saved (nothing here)."""

    def checkpoint(self, name: str) -> Path:
        directory = self.root / name
        if name not in self.references:
            torch.manual_seed(1234)
            model = self.checkpoints[name]().eval()
            _randomize(model)
            self.adjust(name, model)
            model.save_pretrained(directory)
            self.references[name] = model
        return directory

    def get(self, name: str, layout: tuple[int, ...]) -> LLMEngine:
        key = (name, layout)
        if key not in self.started:
            directory = self.checkpoint(name)
            parallel = ParallelLayout(*layout)
            config = EngineConfig(kv_cache_bytes=_kv_budget(directory, parallel), block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=24, max_num_seqs=8, show_progress=False,
                                  tensor_parallel_size=parallel.tp, pipeline_parallel_size=parallel.pp,
                                  expert_parallel_size=parallel.ep)
            self.started[key] = LLMEngine(directory, config)
        return self.started[key]

    def close(self) -> None:
        for engine in self.started.values():
            engine.shutdown()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    made = Engines(tmp_path_factory.mktemp("parallel"))
    yield made
    made.close()


def _run(engine: LLMEngine, outputs: dict[str, list[int]], cached: dict[str, int], steps: int | None = None) -> None:
    while engine.has_work() and steps != 0:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out.token.token_id)
            cached[out.request_id] = out.num_cached_tokens
        steps = None if steps is None else steps - 1


def _workload(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, int]]:
    """One prompt alone, then five at once in a pool too small for all of them: a prompt that extends
    the first one's (a prefix-cache hit), long prompts cut into chunks (24-token budget), a seeded
    sampled request, and one aborted after two steps."""
    generator = torch.Generator().manual_seed(3)
    prompts = {name: torch.randint(0, 320, (n,), generator=generator).tolist()
               for name, n in (("first", 40), ("a", 5), ("c", 17), ("d", 33), ("gone", 12))}
    prompts["extends-first"] = prompts["first"][:32] + [7, 8, 9]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    engine.add_request("first", prompts["first"], greedy)
    _run(engine, outputs, cached)
    for name in ("extends-first", "a", "c", "gone"):
        engine.add_request(name, prompts[name], greedy)
    engine.add_request("d", prompts["d"], seeded)
    _run(engine, outputs, cached, steps=2)
    assert engine.abort("gone")
    _run(engine, outputs, cached)
    outputs.pop("gone", None)
    return outputs, cached


@pytest.fixture(scope="module")
def reference_runs(engines):
    """The single-process engine's workload, per checkpoint."""
    return {name: _workload(engines.get(name, (1, 1))) for name in CHECKPOINTS}


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-tp{t}pp{p}" for n, (t, p) in CASES])
def test_logits_match_transformers_and_the_single_process_engine(engines, name, layout):
    assert_prompt_logits(engines, name, layout, (1, 1))


def assert_prompt_logits(engines, name: str, layout: tuple, single: tuple) -> None:
    """PROMPT's logits on the `layout` engine: within 1e-4 of transformers', within 1e-5 of the `single` one's."""
    ours = engines.get(name, layout).prompt_logits(PROMPT)
    with torch.no_grad():
        theirs = engines.references[name](torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours, engines.get(name, single).prompt_logits(PROMPT), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{n}-tp{t}pp{p}" for n, (t, p) in CASES])
def test_workload_tokens_equal_the_single_process_engine(engines, reference_runs, name, layout, monkeypatch):
    engine = engines.get(name, layout)
    in_flight_at_submit = []
    submit = engine.executor.submit
    monkeypatch.setattr(engine.executor, "submit",
                        lambda inputs: (in_flight_at_submit.append(len(engine._in_flight)), submit(inputs)))
    assert_workload(engine, reference_runs[name])
    # with 2 stages a batch was started while another was still in the pipeline
    assert max(in_flight_at_submit) == layout[1] - 1


def assert_workload(engine: LLMEngine, reference) -> None:
    """_workload on engine gives the tokens it gave on the single-process engine (reference: its result
    there), and the run met what it is meant to: a cache hit, a chunked prompt, a preemption; every block back."""
    outputs, cached = _workload(engine)
    expected, expected_cached = reference
    assert outputs == expected
    assert len(outputs["a"]) == 10 and len(outputs["d"]) == 10
    assert cached["extends-first"] == expected_cached["extends-first"] == 32
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks == NUM_BLOCKS


def moves_between(engines, name: str, single: tuple, pairs: list, seed: int):
    """For each (source, target) layout pair: a 21-token prompt prefilled on source, its KV moved to target
    and decoded there (test_mechanics.moved), and the same prompt decoded alone on the `single` layout.
    Yields (the pair's name, the moved tokens, the colocated tokens, the payload)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    colocated = engines.get(name, single)
    generator = torch.Generator().manual_seed(seed)
    for source, target in pairs:
        prompt = torch.randint(0, 320, (21,), generator=generator).tolist()
        colocated.add_request("colocated", prompt, params)
        expected = _decode(colocated, "colocated")
        request = f"{source}->{target}"
        tokens, payload = moved(engines.get(name, source), engines.get(name, target), request, prompt, params)
        yield request, tokens, expected, payload


def _decode(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_work():
        tokens += [out.token.token_id for out in engine.step() if out.request_id == request_id]
    return tokens


def test_kv_moves_between_every_pair_of_layouts(engines):
    """Prefill on one layout, export (canonical: every layer, every KV head), import on another,
    decode: the tokens of a colocated run, for all 16 pairs."""
    pairs = [(source, target) for source in LAYOUTS for target in LAYOUTS]
    for request, tokens, expected, payload in moves_between(engines, "llama-gqa", (1, 1), pairs, seed=11):
        assert payload.layout.num_kv_heads == 2 and payload.layout.num_layers == 4
        assert tokens == expected, request
    for layout in LAYOUTS:
        pool = engines.get("llama-gqa", layout).block_manager
        assert pool.num_free_blocks == pool.num_blocks


def test_replicated_kv_heads_export_once_and_import_into_every_replica(engines):
    """One KV head, tp=2: both TP ranks hold it. An export reads it once; an import writes both copies
    (a rank left with a stale copy would attend to garbage and change the tokens)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    single, parallel = engines.get("qwen3-mqa", (1, 1)), engines.get("qwen3-mqa", (2, 2))
    assert [len(slices) for slices in parallel.kv_map.read] == [1] * 4
    assert [len(slices) for slices in parallel.kv_map.write] == [2] * 4
    for number, (source, target) in enumerate([(single, parallel), (parallel, single)]):
        prompt = [11 + number, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188]
        single.add_request("colocated", prompt, params)
        expected = _decode(single, "colocated")
        assert moved(source, target, f"moved-{number}", prompt, params)[0] == expected


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited; only its parent's reaping is left


def test_a_killed_rank_fails_the_engine_within_seconds_and_leaves_no_process(engines):
    engine = engines.get("llama-gqa", (2, 2))
    pids = [proc.pid for proc in engine.executor.processes.procs.values()]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"long-{i}", PROMPT[: 10 + i], params)
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)  # rank 2: stage 1's first TP rank
    killed_at = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 2 \(pid \d+\) was killed by signal 9 \(SIGKILL\)"):
        while time.monotonic() - killed_at < 30:
            engine.step()
    assert time.monotonic() - killed_at < 10
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(RankFailedError):  # and it stays failed
        engine.step()
    with pytest.raises(RankFailedError):
        engine.check_ranks()


RANK0_SCRIPT = """
import sys, time
from engine.engine import EngineConfig, LLMEngine
engine = LLMEngine(sys.argv[1], EngineConfig(kv_cache_bytes=1 << 20, block_size=8, show_progress=False,
                                             tensor_parallel_size=2))
print(*[p.pid for p in engine.executor.processes.procs.values()], flush=True)
time.sleep(600)
"""


def test_workers_exit_when_rank_zero_is_killed(engines, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_SCRIPT)
    rank0 = subprocess.Popen([sys.executable, str(script), str(engines.checkpoint("llama-gqa"))],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        workers = [int(pid) for pid in rank0.stdout.readline().split()]
        assert workers and not any(_gone(pid) for pid in workers)
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in workers)
    finally:
        rank0.kill()
        rank0.wait()


def test_generate_command_takes_the_layout(tiny_model_dir, capsys):
    from deploy.cli import main

    command = ["generate", "--model", str(tiny_model_dir), "--prompt", "the quick brown fox", "--max-tokens", "6"]
    assert main(command) == 0
    single = capsys.readouterr().out
    assert main([*command, "--pipeline-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single
    assert main([*command, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads; use one of [1, 2, 4]" in \
        capsys.readouterr().err
