"""Seeded sampling through the router and a real engine (an in-process agent), as a client sees it:
a prompt's seeded text must not depend on the other prompts sent in the same request."""

from __future__ import annotations

from test_router_structured import DEMO, serving

PROMPTS = ["Hello there", "The river runs", "kv"]


async def test_a_seeded_prompt_gets_the_same_choices_alone_or_batched(cluster, make_router, tiny_model_dir):
    async with serving(cluster, make_router, tiny_model_dir, DEMO) as (client, _engine):
        sampling = dict(model=DEMO, max_tokens=8, temperature=1.0, seed=42, n=2)
        alone = [[c.text for c in (await client.completions.create(prompt=p, **sampling)).choices]
                 for p in PROMPTS]
        batch = await client.completions.create(prompt=PROMPTS, **sampling)
        texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
        assert texts == [text for choices in alone for text in choices]
        assert all(a != b for a, b in alone)  # a prompt's n choices still draw differently
        reordered = await client.completions.create(prompt=PROMPTS[::-1], **sampling)
        texts = [c.text for c in sorted(reordered.choices, key=lambda c: c.index)]
        assert texts == [text for choices in alone[::-1] for text in choices]
