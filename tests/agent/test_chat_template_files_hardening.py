"""Chat templates kept in files reach routers whole: the named ones too, not only chat_template.jinja."""

from __future__ import annotations

import json
import shutil

from engine.tokenizer import ChatTokenizer
from router.model_assets import build_assets
from tests.agent.conftest import MODEL

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": {"type": "object", "properties": {}}}}]


async def test_named_template_files_reach_the_router(start_agent, connect, tiny_model_dir, tmp_path):
    """A checkpoint saved with a `tool_use` template in additional_chat_templates/ (as transformers' save_pretrained
    writes it): a router given tools renders that template, as the engine's own tokenizer does."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "chat_template.jinja").write_text(config.pop("chat_template"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "additional_chat_templates").mkdir()
    (model_dir / "additional_chat_templates" / "tool_use.jinja").write_text(
        "{{ bos_token }}tools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}|"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    info = await connect(await start_agent(models={MODEL: str(model_dir)})).model_info(MODEL)
    router_side, engine_side = build_assets(info).tokenizer, ChatTokenizer.from_dir(model_dir)
    messages = [{"role": "user", "content": "hello"}]
    assert router_side.apply_chat_template(messages, tools=TOOLS).endswith("tools: get_weather |user: hello\n")
    for tools in (TOOLS, None):
        assert router_side.encode_chat(messages, tools=tools) == engine_side.encode_chat(messages, tools=tools)
