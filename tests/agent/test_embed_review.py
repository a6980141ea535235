"""An Embed input that fills the model's context exactly, on a site whose context is as long as its whole KV pool:
an embedding generates no token, so it needs the blocks of its own tokens only, and is served (it used to be
refused as a full site forever: "needs 9 blocks, 8 of 8 are free"), its vector transformers'."""

from __future__ import annotations

import numpy as np
import torch

from node_agent.proto import agent_pb2

from .conftest import MODEL


def reference(model_dir, ids: list[int]) -> np.ndarray:
    """transformers' last hidden state of the last token, L2-normalized (a checkpoint without modules.json)."""
    import transformers
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).numpy()


async def test_an_input_of_exactly_the_context_is_served_on_a_site_whose_pool_is_the_context(
        start_agent, connect, tiny_model_dir):
    agent = await start_agent(kv_cache_bytes=64 << 10)   # a pool of 8 blocks: the context is its 128 tokens
    client = connect(agent)
    health, info = await client.health(), await client.model_info(MODEL)
    assert info.context_length == health.kv_blocks_total * 16 == 128
    texts = [[(7 + 13 * i + 5 * j) % 500 + 5 for j in range(info.context_length)] for i in range(2)]
    answer = await client.embed(agent_pb2.EmbedRequest(
        request_id="whole", model=MODEL, inputs=[agent_pb2.EmbedInput(token_ids=ids) for ids in texts]), timeout=60)
    assert [e.num_prompt_tokens for e in answer.embeddings] == [128, 128]
    for ids, embedding in zip(texts, answer.embeddings):
        np.testing.assert_allclose(np.frombuffer(embedding.data, dtype="<f4"), reference(tiny_model_dir, ids),
                                   atol=2e-5, rtol=1e-4)
    assert (await client.health()).kv_blocks_free == health.kv_blocks_total   # both inputs' KV freed
