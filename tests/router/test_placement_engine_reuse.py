"""Placement's prefix-cache figures against the engine's own block manager, at the block boundaries.

A prompt of whole blocks was the gap: placement counted all but its last token as cached, while the engine
reuses whole blocks before the one holding the last token, so placement sent a prefill to a site one block
short of what its agent admits.
"""

from __future__ import annotations

import pytest

from engine.prefix_hash import prefix_hashes
from router.placement import CostModel, rank
from tests.router.test_router_placement import FRANKFURT, PARIS, request, site, snapshot

BLOCK_SIZE = 16


def engine_figures(prompt_ids: list[int]) -> tuple[int, int]:
    """(tokens the engine reuses, free blocks the agent asks of a Prefill) for a prompt another sequence holds."""
    from engine.block_manager import BlockManager
    from engine.sampling import SamplingParams
    from engine.sequence import Sequence

    manager = BlockManager(64, BLOCK_SIZE)
    holder = Sequence("holder", prompt_ids, SamplingParams(), 0, len(prompt_ids) + 1)
    manager.allocate(holder)
    holder.num_computed_tokens = len(prompt_ids)
    manager.register_full_blocks(holder)
    again = Sequence("again", prompt_ids, SamplingParams(), 0, len(prompt_ids) + 1)
    # node_agent.core._admit: the prompt and its first generated token, less the blocks held sequences share
    needed = manager.blocks_needed(len(prompt_ids) + 1) - manager.shared_prefix_blocks(prompt_ids)
    manager.allocate(again)
    return again.num_computed_tokens, needed


@pytest.mark.parametrize("prompt_len", [4 * BLOCK_SIZE - 1, 4 * BLOCK_SIZE, 4 * BLOCK_SIZE + 1])
def test_a_cached_prompt_is_placed_where_its_agent_admits_it(prompt_len):
    prompt = list(range(1, prompt_len + 1))
    reused, needed = engine_figures(prompt)
    summary = {"block_size": BLOCK_SIZE, "hashes": [f"{h:016x}" for h in prefix_hashes(prompt, BLOCK_SIZE)]}
    for free in (needed - 1, needed):
        snap = snapshot(site("pre", PARIS, role="prefill", kv_blocks_free=free, prefix_cache_summary=summary),
                        site("dec", FRANKFURT, role="decode"))
        placed = rank(snap, request(PARIS, prompt_len=prompt_len, max_tokens=1), CostModel())
        if free < needed:
            assert placed == [], (prompt_len, free)   # the agent would refuse it: KV pool is full
        else:
            assert [c.site_names for c in placed] == [("pre", "dec")]
            assert placed[0].num_cached_tokens == reused


def test_an_embedding_needs_room_for_its_whole_input_even_when_cached():
    # The agent admits an embedding on blocks for its longest input, crediting no cached prefix
    # (node_agent.core.accept_embedding): placement must not send it to a site with less free.
    prompt = list(range(1, 4 * BLOCK_SIZE + 1))
    summary = {"block_size": BLOCK_SIZE, "hashes": [f"{h:016x}" for h in prefix_hashes(prompt, BLOCK_SIZE)]}
    for free, placed in ((3, False), (4, True)):
        snap = snapshot(site("pre", PARIS, role="prefill", kv_blocks_free=free, prefix_cache_summary=summary))
        ranked = rank(snap, request(PARIS, prompt_len=len(prompt), max_tokens=1, prefill_only=True), CostModel())
        assert bool(ranked) == placed, free
