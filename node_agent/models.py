"""The models an agent hosts: one engine per checkpoint, plus the assets routers ask for.

Loading weights blocks for seconds, so `load_model` runs it on a worker thread; everything after
that goes through the AsyncEngine's own thread.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.engine import EngineConfig, LLMEngine
from engine.kv_transfer import KVLayout
from engine.config import read_json
from engine.errors import EngineError
from engine.tokenizer import chat_template_file, processor_chat_template
from node_agent.config import AgentConfig
from node_agent.errors import ModelLoadError
from node_agent.proto import agent_pb2


@dataclass(slots=True)
class HostedModel:
    name: str
    engine: AsyncEngine
    info: agent_pb2.ModelInfo
    vocab_size: int
    block_size: int
    kv_layout: KVLayout          # this engine's layout (num_tokens 1); peers' payloads must match it

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def served(model: HostedModel, role: str) -> dict:
    """The model as the site registers it: with its own KV figures, so routers price this site's decode
    steps and KV transfers by its dtype and pair it only with sites whose KV it can take."""
    return {"model": model.name, "role": role, "kv_bytes_per_token": int(model.info.kv_bytes_per_token),
            "kv_format": model.kv_layout.kv_format}


def engine_config(config: AgentConfig, model: str | None = None) -> EngineConfig:
    """The engine settings of `model` (its own parallel sizes, AgentConfig.layout_of); without a model,
    the agent-wide ones."""
    layout = config.layout_of(model)
    return EngineConfig(device=config.device, dtype=config.dtype, block_size=config.block_size,
                        kv_cache_bytes=config.kv_cache_bytes, max_num_batched_tokens=config.max_num_batched_tokens,
                        max_num_seqs=config.max_num_seqs, kv_handle_ttl_s=config.kv_lease_ttl_s,
                        kv_chunk_bytes=config.kv_chunk_bytes, tensor_parallel_size=layout.tp,
                        pipeline_parallel_size=layout.pp, expert_parallel_size=layout.ep, show_progress=False,
                        weight_mode=config.weight_mode, speculative=config.speculative_config())


def _model_info(name: str, engine: LLMEngine) -> agent_pb2.ModelInfo:
    model_dir = Path(engine.model_dir)
    tokenizer_config = read_json(model_dir / "tokenizer_config.json", required=False) or {}
    # the template file comes first, as the engine's tokenizer reads it; named templates stay in
    # tokenizer_config.json, which routers read whole
    template = (chat_template_file(model_dir) or tokenizer_config.get("chat_template")
                or processor_chat_template(model_dir))
    if isinstance(template, dict):  # named template files travel in tokenizer_config.json's list form
        tokenizer_config["chat_template"] = [{"name": name, "template": text} for name, text in template.items()]
    generation = read_json(model_dir / "generation_config.json", required=False) or {}
    layout = engine.kv_layout(1)
    return agent_pb2.ModelInfo(
        model=name,
        tokenizer_json=(model_dir / "tokenizer.json").read_text(encoding="utf-8"),
        tokenizer_config_json=json.dumps(tokenizer_config),
        chat_template=template if isinstance(template, str) else "",
        generation_config_json=json.dumps(generation),
        context_length=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        block_size=engine.config.block_size,
        # the canonical layout's (every layer, every KV head): the same at every site serving this model,
        # whatever its tensor/pipeline layout, so routers size KV transfers per model
        kv_bytes_per_token=layout.bytes_per_token_per_layer * layout.num_layers,
        eos_token_ids=sorted(engine.eos_token_ids),
    )


def _load_sync(name: str, checkpoint_dir: str, config: EngineConfig) -> HostedModel:
    engine = LLMEngine(checkpoint_dir, config)
    info = _model_info(name, engine)
    return HostedModel(name, AsyncEngine(engine), info, engine.model_config.vocab_size, engine.config.block_size,
                       engine.kv_layout(1))


async def load_model(name: str, checkpoint_dir: str, config: AgentConfig) -> HostedModel:
    """The model loaded; ModelLoadError, naming the model and its directory, for what the engine refuses
    (its errors, and the ValueErrors of the settings it checks as it starts)."""
    try:
        return await asyncio.to_thread(_load_sync, name, checkpoint_dir, engine_config(config, name))
    except (EngineError, ValueError) as exc:
        raise ModelLoadError(f"model {name} ({checkpoint_dir}): {exc}") from exc
