"""The API key cache while the registry hangs: a key seen before is served on its last answer instead of
waiting out the registry client's timeout, and the registry's next answer (a revocation) still counts."""

from __future__ import annotations

import asyncio

import pytest

from router.api_keys import STALE_GRACE_S, ApiKeyCache
from router.errors import ApiError

RECORD = {"id": 7, "name": "team", "allowed_regions": [], "requests_per_minute": None, "tokens_per_minute": None}


class Registry:
    """A lookup that answers at once, or hangs until `answer` is given."""

    def __init__(self) -> None:
        self.hanging: asyncio.Future | None = None
        self.num_lookups = 0
        self.num_asked_while_hanging = 0

    async def lookup(self, _secret: str) -> dict | None:
        self.num_lookups += 1
        if self.hanging is not None:
            self.num_asked_while_hanging += 1
            return await self.hanging
        return RECORD

    def hang(self) -> None:
        self.hanging = asyncio.get_running_loop().create_future()
        self.num_asked_while_hanging = 0

    async def answer(self, record: dict | None) -> None:
        """The hanging lookup's answer, once it is asked, and the cache's lookup done with it."""
        while not self.num_asked_while_hanging:
            await asyncio.sleep(0)
        hanging, self.hanging = self.hanging, None
        hanging.set_result(record)
        for _ in range(10):
            await asyncio.sleep(0)


async def expired_key(now: list[float]) -> tuple[Registry, ApiKeyCache]:
    """A cache whose one key was looked up, then expired, with a registry that has stopped answering."""
    registry = Registry()
    cache = ApiKeyCache(registry.lookup, ttl_s=30.0, clock=lambda: now[0])
    assert (await cache.authenticate("ef-key")).id == 7
    now[0] += 31.0
    registry.hang()
    return registry, cache


async def test_a_known_key_is_served_on_its_last_answer_while_the_registry_hangs():
    now = [0.0]
    registry, cache = await expired_key(now)
    for _ in range(3):   # served at once, not after the client's timeout; one lookup goes on meanwhile
        assert (await asyncio.wait_for(cache.authenticate("ef-key"), 2.0)).id == 7
    assert registry.num_lookups == 2
    await registry.answer(None)   # the registry comes back: the key was revoked meanwhile
    with pytest.raises(ApiError) as refused:
        await cache.authenticate("ef-key")
    assert refused.value.status == 401


async def test_a_healthy_registry_still_refuses_a_revoked_key_at_once():
    registry, cache = await expired_key([0.0])
    attempt = asyncio.ensure_future(cache.authenticate("ef-key"))
    await registry.answer(None)   # answered within the wait: the stale answer is not used
    with pytest.raises(ApiError) as refused:
        await attempt
    assert refused.value.status == 401


async def test_after_the_grace_the_registry_is_asked_again():
    now = [0.0]
    registry, cache = await expired_key(now)
    await cache.authenticate("ef-key")
    await registry.answer(RECORD)
    now[0] += 30.0 + STALE_GRACE_S
    await cache.authenticate("ef-key")
    assert registry.num_lookups == 3
