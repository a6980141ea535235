"""One request inside the engine: its tokens, progress, blocks and sampling parameters."""

from __future__ import annotations

import enum
from itertools import count

from engine.sampling import SamplingParams

_arrival = count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PINNED = "pinned"      # prefill-only request done; blocks held under a KV handle
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
                 "num_hashed_blocks", "block_table", "params", "seed", "status", "prefill_only", "arrival",
                 "finish_reason", "max_total_tokens", "admitted_once", "matcher", "spec", "prediction", "pooling",
                 "waiting_prefix")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 max_total_tokens: int, prefill_only: bool = False):
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_hashed_blocks = 0
        self.block_table: list[int] = []
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.prefill_only = prefill_only
        self.arrival = next(_arrival)
        self.finish_reason: str | None = None
        self.max_total_tokens = max_total_tokens
        self.admitted_once = False
        self.matcher = None  # engine.grammar.GrammarMatcher when the output must follow a grammar
        self.spec = None     # engine.speculative.SpecState once the sequence has speculated
        self.prediction = None  # engine.ngram.PredictionLookup once its predicted output has been looked up
        self.pooling = None     # engine.pooling.PoolingState: an embedding request, pooled instead of sampled
        # While waiting: engine.block_manager.WaitingPrefix, its figure of held prefix blocks
        # (BlockManager.held_prefix_blocks); None until figured, and again whenever it joins the queue
        self.waiting_prefix = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"status={self.status.value})")
