"""Chained block hashes that name a whole token prefix.

A block's hash covers its own token ids and its parent's hash, so equal hashes mean equal
prefixes up to that block. Standard library only: a router computes the same hashes from a
prompt's token ids to estimate a site's prefix-cache hit without loading the engine.
"""

from __future__ import annotations

import hashlib
import struct

ROOT_HASH = 0


def block_hash(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    digest = hashlib.blake2b(struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of token_ids, in order."""
    hashes, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def count_cached_tokens(token_ids: list[int], block_size: int, cached_hashes: set[int]) -> int:
    """Tokens of token_ids a cache holding cached_hashes would serve (longest leading run of hits)."""
    num_blocks = 0
    for h in prefix_hashes(token_ids, block_size):
        if h not in cached_hashes:
            break
        num_blocks += 1
    return num_blocks * block_size
