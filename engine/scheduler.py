"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step has a token budget. Running sequences go first in arrival order (a decode costs one
token, an unfinished prefill continues with as many tokens as the budget allows), then waiting
sequences are admitted first come, first served. So a long prompt is cut into chunks and never
holds decoding up for more than one budget. One exception to first come, first served: short
prompts waiting anywhere in the queue (each at most a quarter of the budget, together at most
half) are admitted first and keep their share of the step from a running prefill, so a 50-token
question is answered in the next step instead of after every chunk of the 2,000-token documents
ahead of it (the one prefilling and those queued); the long prompt still advances by at least half
a budget per step, and queued long prompts keep their order. When a running sequence needs a block
and none is free, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed (its cached prefix blocks usually make that
cheap).

With pipeline parallelism the engine schedules several batches before the first completes: it
names the sequences already in flight (`busy`), which are neither scheduled again nor preempted
(their K/V are being written), and caps each batch's sequences so the batches share the work.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # Blocks kept free when admitting, so running sequences can grow without immediate preemption.
    watermark_blocks: int = 1


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Proposed tokens after the sequence's last one (engine.speculative): their K/V are written and every
    # one of them gets logits, all in this step; those the model disagrees with are rolled back.
    draft_ids: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.waiting_prefix = None
        self.waiting.append(seq)

    def has_free_slot(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks the caller already allocated (a KV import); only when has_free_slot()."""
        assert self.has_free_slot(), "add_running past max_num_seqs"
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=lambda s: s.arrival)

    def num_blocks_waiting(self) -> int:
        """Free blocks the waiting sequences will take once admitted: each one's tokens and, if it decodes here,
        the first token it generates (a prefill-only sequence's lease keeps its prompt; an embedding generates
        none), less the leading prefix blocks running sequences or KV leases hold now (as `_admit` checks).
        The watermark is not in it: it is no one's, and the agent's admission applies it to each admission.
        Current on every call: a figure kept from the sequence's arrival went wrong as the cache changed while it
        waited (a lease on its prefix ending left its blocks to revive from the free ones; a request ahead
        computing the same prompt left it only its own tail to take). BlockManager.held_prefix_blocks keeps that
        cheap: a sequence's figure is walked again only when a block its prefix reads changed."""
        manager, walked = self.block_manager, {}
        changed = manager.take_changes()
        total = 0
        for seq in self.waiting:
            generates = seq.pooling is None and not seq.prefill_only
            total += manager.blocks_needed(seq.num_tokens + generates) - manager.held_prefix_blocks(seq, changed,
                                                                                                     walked)
        return total

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self, busy: set[Sequence] | None = None, max_seqs: int | None = None) -> list[ScheduledSeq]:
        """The next batch. busy: sequences in a batch still in flight; max_seqs: at most this many sequences."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        limit = max_seqs or self.config.max_num_seqs
        shorts = self._short_prompts()
        reserved = sum(seq.num_tokens - seq.num_computed_tokens for seq in shorts)
        index = 0
        while index < len(self.running) and budget > 0 and len(scheduled) < limit:
            seq = self.running[index]
            if busy and seq in busy:
                index += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new > 1:  # a prefill chunk leaves the short prompts their share
                num_new = min(num_new, budget - reserved)
                if num_new < 1:
                    index += 1
                    continue
            if not self._make_room(seq, seq.num_computed_tokens + num_new, busy):
                break  # seq itself was preempted; everything after it that could be already was
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            index += 1
        # The short prompts first, wherever they wait, then first come, first served.
        for seq in shorts:
            if budget < 1 or len(scheduled) >= limit or not self._admit(seq, budget, scheduled):
                break
            budget -= scheduled[-1].num_new_tokens
        while self.waiting and budget > 0 and len(scheduled) < limit and self._admit(self.waiting[0], budget, scheduled):
            budget -= scheduled[-1].num_new_tokens
        return scheduled

    def _short_prompts(self) -> list[Sequence]:
        """The waiting short prompts this step should admit, in queue order (see the module docstring)."""
        limit, room = self.config.max_num_batched_tokens // 4, self.config.max_num_batched_tokens // 2
        seats = self.config.max_num_seqs - len(self.running)
        shorts, reserved = [], 0
        for seq in self.waiting:
            if len(shorts) >= seats or reserved >= room:
                break
            pending = seq.num_tokens - seq.num_computed_tokens
            if pending <= limit and reserved + pending <= room:
                shorts.append(seq)
                reserved += pending
        return shorts

    def _admit(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq]) -> bool:
        """Move a waiting seq to running with blocks for its prompt and schedule up to budget of it."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        reserve = self.config.watermark_blocks if self.running else 0
        if not self.block_manager.can_allocate(seq, reserve):
            return False
        self.block_manager.allocate(seq)
        if not seq.admitted_once:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.admitted_once = True
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        scheduled.append(ScheduledSeq(seq, min(seq.num_tokens - seq.num_computed_tokens, budget)))
        return True

    def _make_room(self, seq: Sequence, num_tokens: int, busy: set[Sequence] | None = None) -> bool:
        """Ensure seq has blocks for num_tokens, preempting the newest others not in flight; False if
        seq itself went."""
        bm = self.block_manager
        while not bm.can_grow(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if not busy or s not in busy)
            self._preempt(victim)
            if victim is seq:
                return False
        bm.grow(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.waiting_prefix = None   # longer now: figured again
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
