"""The draft-model proposer: a smaller checkpoint with the same tokenizer proposes k tokens per step.

The draft runs on the engine's device with its own KV pool and block manager. Each sequence that
speculates has a copy here whose tokens follow the sequence's kept tokens. Proposing k tokens is k
batched steps of the draft: the first computes whatever the draft has not seen yet (the whole
prompt the first time, then the one or two tokens kept since) and draws the first proposal, each
further step feeds the previous proposal and draws the next. After verification the draft's K/V of
rejected proposals is rolled back like the model's, and blocks past the kept tokens are freed.
A draft with a shorter context than the model's proposes only while its positions last: a sequence
longer than that decodes on without proposals.

A proposal is drawn from the draft's distribution q after the request's own logit processing (the
temperature, top-k/top-p/min-p, penalties and logit_bias of the request; greedy requests take its
argmax), with its own uniform from (seed, output index); q is kept for the accept test.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.block_manager import BlockManager
from engine.config import load_config
from engine.loader import load_model, stores_lm_head
from engine.memory import weight_bytes
from engine.runner import prepare_step
from engine.sampling import DRAFT_STREAM, draw_tokens, draw_uniform, probabilities, process_logits
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, SequenceStatus
from engine.shard import ModelShard
from engine.speculative_config import check_draft_model

if TYPE_CHECKING:
    from engine.engine import EngineConfig

log = logging.getLogger(__name__)


class DraftProposer:
    def __init__(self, directory: str | Path, model_dir: str | Path, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, num_target_blocks: int) -> None:
        spec = config.speculative
        check_draft_model(directory, model_dir)
        self.model_config = load_config(directory)
        # a draft may pad its vocabulary otherwise than the model on the same tokenizer (check_draft_model):
        # its logits are cut or padded to the model's ids
        self.target_vocab_size = load_config(model_dir).vocab_size
        # the draft's positions end at its own context; past it a sequence decodes without proposals
        self.max_positions = self.model_config.max_position_embeddings
        self.block_size = config.block_size
        if spec.draft_kv_cache_bytes is None:
            # as many blocks as the model's pool, and room for every sequence's proposals beyond it
            per_seq = -(-spec.num_speculative_tokens // config.block_size) + 1
            num_blocks = num_target_blocks + config.max_num_seqs * per_seq
        else:
            num_blocks = None
        if device.type == "cuda":
            self._check_fits(directory, device, dtype, num_blocks, spec.draft_kv_cache_bytes)
        model = load_model(directory, self.model_config, device, dtype, show_progress=False)
        # its sequences are the model's (at most its pool's tokens) plus the proposals past them
        model.serve_context(min(self.max_positions, num_target_blocks * config.block_size
                                + spec.num_speculative_tokens))
        shard = ModelShard(model, dataclasses.replace(config, speculative=None, enable_cuda_graphs=False,
                                                      kv_cache_bytes=spec.draft_kv_cache_bytes))
        if num_blocks is None:
            num_blocks = shard.blocks_fit()
        shard.allocate(num_blocks)
        self.shard = shard
        self.device = device
        self.block_manager = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.copies: dict[Sequence, Sequence] = {}        # the engine's sequence -> the draft's copy of it
        self._pending: dict[Sequence, tuple[int, int]] = {}  # tokens before the proposals, proposals made
        self._probs: dict[Sequence, list[torch.Tensor]] = {}
        log.info("draft model %s: %d layers, KV pool of %d blocks", directory, self.model_config.num_layers, num_blocks)

    def _check_fits(self, directory, device: torch.device, dtype: torch.dtype, num_blocks: int | None,
                    kv_bytes: int | None) -> None:
        """The model's KV pool took its share of the GPU first: the draft's weights and pool must fit in what is left."""
        mc = self.model_config
        element = torch.tensor([], dtype=dtype).element_size()
        pool = kv_bytes if num_blocks is None else \
            math.prod(mc.kv_pool_shape(mc.num_layers, num_blocks, self.block_size, mc.num_kv_heads)) * element
        need = weight_bytes(mc, dtype, mc.tie_word_embeddings and stores_lm_head(directory)) + pool
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise ValueError(f"the draft model {directory} needs {need / 2**30:.2f} GiB (weights and KV pool) and "
                             f"{free / 2**30:.2f} GiB are free after the model's pool: lower gpu_memory_utilization "
                             f"or set speculative.draft_kv_cache_bytes")

    def propose(self, requests: list[tuple[Sequence, int]]) -> list[list[int]]:
        self._sweep()
        proposals: dict[Sequence, list[int]] = {seq: [] for seq, _ in requests}
        depth: dict[Sequence, int] = {}          # the draft's copy -> its proposals to make
        owner: dict[Sequence, Sequence] = {}     # the draft's copy -> the engine's sequence
        bm = self.block_manager
        for seq, k in requests:
            # the last proposal is drawn, never fed: the draft computes positions up to num_tokens + k - 2
            k = min(k, self.max_positions - seq.num_tokens + 1)
            if k < 1:
                self.release(seq)  # it only grows: its copy's blocks are of no more use
                continue
            copy = self.copies.get(seq)
            if copy is None:
                copy = self.copies[seq] = Sequence(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.params,
                                                   seq.seed, seq.max_total_tokens)
            copy.token_ids.extend(seq.token_ids[copy.num_tokens:])
            if not bm.can_grow(copy, copy.num_tokens + k - 1):
                continue  # the draft's pool is full: no proposals for this one this step
            bm.grow(copy, copy.num_tokens + k - 1)
            depth[copy], owner[copy] = k, seq
            self._pending[seq] = (copy.num_tokens, k)
            if not seq.params.greedy:
                self._probs[seq] = []
        for step in range(max(depth.values(), default=0)):
            copies = [copy for copy, k in depth.items() if k > step]
            inputs = prepare_step([ScheduledSeq(c, c.num_tokens - c.num_computed_tokens) for c in copies],
                                  self.block_size, self.device)
            logits = _fit_vocab(self.shard.run(inputs).logits, self.target_vocab_size)
            ordered = [item.seq for item in inputs.sample_seqs]
            drafts = self._draw(logits, ordered, [owner[c] for c in ordered], step)
            for copy, draft in zip(ordered, drafts):
                copy.num_computed_tokens = copy.num_tokens
                proposals[owner[copy]].append(draft)
                if step + 1 < depth[copy]:
                    copy.token_ids.append(draft)  # fed to the next step
        return [proposals[seq] for seq, _ in requests]

    def _draw(self, logits: torch.Tensor, copies: list[Sequence], seqs: list[Sequence], step: int) -> list[int]:
        params = [seq.params for seq in seqs]
        histories = [copy.token_ids for copy in copies]
        processed = process_logits(logits, params, histories, [seq.num_prompt_tokens for seq in seqs])
        tokens = processed.argmax(dim=-1)
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            q = probabilities(processed.index_select(0, index), [params[row] for row in sampled])
            uniforms = [draw_uniform(seqs[row].seed, seqs[row].num_output_tokens + step, DRAFT_STREAM) for row in sampled]
            tokens[index] = draw_tokens(q, uniforms)
            for position, row in enumerate(sampled):
                self._probs[seqs[row]].append(q[position])
        return tokens.tolist()

    def draft_probs(self, seq: Sequence) -> torch.Tensor | None:
        """q [proposals, vocab] of a sampled sequence's proposals this step."""
        rows = self._probs.get(seq)
        return torch.stack(rows) if rows else None

    def settle(self, seq: Sequence, num_accepted: int) -> None:
        """Roll the draft's copy back to the kept tokens: its K/V of a kept proposal stays, the rest goes."""
        self._probs.pop(seq, None)
        pending = self._pending.pop(seq, None)
        copy = self.copies.get(seq)
        if pending is None or copy is None:
            return
        num_before, k = pending
        del copy.token_ids[num_before:]
        # the draft computed its copy up to the last proposal but one
        copy.num_computed_tokens = min(copy.num_computed_tokens, num_before + min(num_accepted, k - 1))
        self.block_manager.shrink(copy, copy.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        self._probs.pop(seq, None)
        self._pending.pop(seq, None)
        copy = self.copies.pop(seq, None)
        if copy is not None:
            self.block_manager.free(copy)

    def _sweep(self) -> None:
        """Free the copies of sequences preempted since (they recompute; so does their copy, later)."""
        for seq in [s for s in self.copies if s.status is not SequenceStatus.RUNNING]:
            self.release(seq)


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft's logits [rows, its vocabulary] over the model's ids: padding ids the model has beyond the
    draft's are never proposed (-inf), and the draft's own beyond the model's are dropped."""
    if logits.shape[-1] >= vocab_size:
        return logits[:, :vocab_size]
    return torch.nn.functional.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))
