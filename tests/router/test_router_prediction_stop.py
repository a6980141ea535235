"""Predicted outputs with a stop string, through the router and a real agent: the router cuts the answer at
the stop string, inside a step whose proposals the site kept past it. The usage describes the answer the
client got: no proposal past the cut counts (router/generation.py), so accepted_prediction_tokens never
exceeds completion_tokens, and the counts are those of a run whose prediction ends at the cut (its site
never proposes past it)."""

from __future__ import annotations

from tests.router.test_router_prediction import MAX_TOKENS, plain_words  # noqa: F401 (a fixture)
from tests.router.test_router_structured import DEMO, QUESTION, serving

CUTS = range(2, 9)   # answers cut after this many tokens; with k = 3 most cuts fall inside a kept run


async def chat(client, bias: dict, **fields):
    return await client.chat.completions.create(model=DEMO, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0,
                                                logit_bias=bias, **fields)


def stop_at(tokens: list[str], index: int) -> tuple[str, int] | None:
    """The stop string that cuts the answer right before token `index` (its text), and where the cut falls;
    None when that text occurs earlier in the answer (the cut would fall elsewhere)."""
    text = "".join(tokens)
    offset = len("".join(tokens[:index]))
    stop = tokens[index]
    return (stop, offset) if stop.strip() and text.find(stop) == offset else None


def counts(usage) -> tuple[int, int, int]:
    details = usage.completion_tokens_details
    return usage.completion_tokens, details.accepted_prediction_tokens, details.rejected_prediction_tokens


async def test_an_answer_cut_at_a_stop_string_counts_only_the_predicted_tokens_it_holds(cluster, make_router,
                                                                                         tiny_model_dir, plain_words):
    async with serving(cluster, make_router, tiny_model_dir, DEMO) as (client, _engine):
        plain = await chat(client, plain_words, logprobs=True)
        tokens = [item.token for item in plain.choices[0].logprobs.content]
        text = plain.choices[0].message.content
        assert "".join(tokens) == text and len(tokens) == MAX_TOKENS
        prediction = {"type": "content", "content": text}
        uncut = await chat(client, plain_words, prediction=prediction)
        assert uncut.usage.completion_tokens_details.accepted_prediction_tokens > MAX_TOKENS // 2
        checked = 0
        for index in CUTS:
            if (found := stop_at(tokens, index)) is None:
                continue
            stop, offset = found
            cut = await chat(client, plain_words, prediction=prediction, stop=[stop])
            assert cut.choices[0].message.content == text[:offset] and cut.choices[0].finish_reason == "stop"
            num_tokens, accepted, rejected = counts(cut.usage)
            # The token that holds the stop string counts, as it does without a prediction.
            assert num_tokens == index + 1 and accepted <= num_tokens, (stop, counts(cut.usage))
            # The reference: the same answer from a prediction that ends with that token.
            reference = await chat(client, plain_words, stop=[stop],
                                   prediction={"type": "content", "content": text[:offset + len(stop)]})
            assert reference.choices[0].message.content == text[:offset]
            assert counts(cut.usage) == counts(reference.usage), stop
            stream = await chat(client, plain_words, prediction=prediction, stop=[stop], stream=True,
                                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert counts(chunks[-1].usage) == counts(cut.usage)
            checked += 1
        assert checked >= 3
