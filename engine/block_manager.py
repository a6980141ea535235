"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, and the prefix cache.

A full block is hashed (engine.prefix_hash, parent chained in) once its tokens are computed and
registered, so a later request with the same prefix reuses it. Blocks are ref-counted; a cached
block whose last user leaves stays in the cache, evictable, and is evicted least recently used
first when the pool needs room. A hash hit also compares token ids, so a collision cannot serve
the wrong keys.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.prefix_hash import ROOT_HASH, block_hash
from engine.sequence import Sequence


@dataclass(slots=True)
class WaitingPrefix:
    """A waiting sequence's figure of held prefix blocks (BlockManager.held_prefix_blocks), and what it rests on."""

    hashes: list[int]          # its leading blocks' hashes, as far as a walk hashed them
    watched: frozenset[int]    # the same, to test the hashes changed since against
    num_held: int


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self.hash_to_block: dict[int, int] = {}
        self._changes: set[int] | None = set()   # see take_changes

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission ---------------------------------------------------------------------------

    def _cache_hits(self, seq: Sequence) -> list[int]:
        """Leading cached blocks of seq; the last token is always left to compute (its logits are needed).
        None for an embedding whose pooling reads every position's hidden state (engine.pooling)."""
        if not self.enable_prefix_caching or (seq.pooling is not None and seq.pooling.pooling.every_row):
            return []
        return self._hits(seq.token_ids)

    def _hits(self, token_ids: list[int]) -> list[int]:
        hits, parent = [], ROOT_HASH
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            parent = block_hash(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def shared_prefix_blocks(self, token_ids: list[int]) -> int:
        """How many leading blocks of a request with these tokens running sequences (or KV leases) hold in the
        prefix cache: it shares them and takes no free block for them (an evictable hit is counted free, and
        taking it uses it up, so it does not count here). The agent's admission reads this off the engine
        thread: an estimate, which the engine checks again when it allocates."""
        if not self.enable_prefix_caching:
            return 0
        return sum(1 for block_id in self._hits(token_ids) if self.blocks[block_id].ref_count > 0)

    def blocks_to_admit(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks a waiting seq takes when allocate gives it blocks for num_tokens: fresh ones, and its cached
        prefix blocks revived from the evictable LRU (counted free; reviving uses them up), but not the leading
        blocks running sequences or KV leases hold, which it shares. A waiting seq holds no blocks (preemption
        frees them all)."""
        shared = sum(1 for block_id in self._cache_hits(seq) if self.blocks[block_id].ref_count > 0)
        return self.blocks_needed(num_tokens) - shared

    def held_prefix_blocks(self, seq: Sequence, changed: set[int] | None, walked: dict[int, int]) -> int:
        """How many of a waiting seq's leading cached blocks running sequences or KV leases hold now: the blocks
        blocks_to_admit does not count (a hash collision, which its token check catches, is too rare to matter
        here). Asked every step of every waiting seq, as the cache changes under it (a lease on its prefix ends, a
        request ahead computes the same prompt), so it is cheap: the figure kept on the seq stands while none of
        the hashes it read is among those `changed` since (take_changes; None: any may have), and a walk hashes
        each block once, only as far as hits reach; `walked`, shared by one pass over the queue, has the held
        count at the end of each prefix walked in it (a chained hash names its whole prefix, so the walked ones
        lead this chain), and a queue sharing a long system prompt walks it once."""
        figure = seq.waiting_prefix
        if figure is not None and changed is not None and changed.isdisjoint(figure.watched):
            return figure.num_held
        if not self.enable_prefix_caching or (seq.pooling is not None and seq.pooling.pooling.every_row):
            return 0
        chain = figure.hashes if figure is not None else []
        low, high = 0, len(chain)
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if chain[middle] in walked else (low, middle)
        held = walked[chain[low - 1]] if low else 0
        bs, num_hashable, num_hashed = self.block_size, (len(seq.token_ids) - 1) // self.block_size, len(chain)
        for index in range(low, num_hashable):
            if index == len(chain):
                chain.append(block_hash(chain[-1] if chain else ROOT_HASH, seq.token_ids[index * bs:(index + 1) * bs]))
            block_id = self.hash_to_block.get(chain[index])
            if block_id is None:
                break
            held += self.blocks[block_id].ref_count > 0
            walked[chain[index]] = held
        watched = figure.watched if figure is not None and len(chain) == num_hashed else frozenset(chain)
        seq.waiting_prefix = WaitingPrefix(chain, watched, held)
        return held

    def take_changes(self) -> set[int] | None:
        """The hashes whose block was published, evicted, or moved between held and evictable since the last
        call (None: more than the pool's worth went by untaken: take any as changed)."""
        changes, self._changes = self._changes, set()
        return changes

    def _changed(self, block_hash: int) -> None:
        if self._changes is not None:
            self._changes.add(block_hash)
            if len(self._changes) > len(self.blocks):  # no one took them for long: stop counting
                self._changes = None

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        return self.blocks_to_admit(seq, seq.num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks; sets its computed count."""
        hits = self._cache_hits(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._allocate_fresh())
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id)
            self._changed(block.hash)
        block.ref_count += 1

    def _allocate_fresh(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            self._changed(block.hash)
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id

    # -- growth during decode ----------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._allocate_fresh())

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free seq's blocks past the first num_tokens' (they held rejected speculative tokens only).

        Such a block was grown for this step and is no one else's: never hashed, never shared."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a shrunk block was shared or published"
            block.ref_count = 0
            self.free_ids.appendleft(block.block_id)  # reused first: the block grown again next step

    # -- prefix cache registration -----------------------------------------------------------

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash and publish every block of seq whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = self.blocks[seq.block_table[seq.num_hashed_blocks - 1]].hash if seq.num_hashed_blocks else ROOT_HASH
        for index in range(seq.num_hashed_blocks, num_full):
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            parent = block_hash(parent, tokens)
            block = self.blocks[seq.block_table[index]]
            block.hash, block.token_ids = parent, tokens
            # If another block already holds this prefix, keep that one published.
            if self.hash_to_block.setdefault(parent, block.block_id) == block.block_id:
                self._changed(parent)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    # -- release -----------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        # Tail blocks go into the LRU first so a prefix's later blocks are evicted before its head.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count:
                continue
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                self.evictable[block_id] = None
                self._changed(block.hash)
            else:
                block.hash, block.token_ids = None, ()
                self.free_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    # -- summary for routers -----------------------------------------------------------------

    def cache_listing(self, limit: int | None = None) -> tuple[list[int], int]:
        """Hashes of published blocks, most recently used first (in-use blocks, then evictable newest first),
        and how many of them lead as in use (held by running sequences or KV leases): a request reusing those
        takes no free block, while reusing an evictable one takes it from the free pool. Both cut to `limit`."""
        in_use = [b.hash for b in self.blocks if b.ref_count and b.hash is not None
                  and self.hash_to_block.get(b.hash) == b.block_id]
        idle = [self.blocks[i].hash for i in reversed(self.evictable)]
        hashes = in_use + idle
        if limit is None:
            return hashes, len(in_use)
        return hashes[:limit], min(len(in_use), limit)
