"""Tokenizer files for the stored published chat templates (tests/engine/chat_templates/, see SOURCES.md).

`write_template_tokenizer(dir, name)` writes tokenizer.json (a small byte-level BPE trained on the
demo corpus, carrying the template's control tokens as special tokens), tokenizer_config.json
(the model's bos/eos) and chat_template.jinja: a directory both transformers' AutoTokenizer and
`ChatTokenizer.from_dir` load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.demo import CORPUS

TEMPLATES_DIR = Path(__file__).parent / "chat_templates"
CONTROL_TOKEN = re.compile(r"<\|[^|<>\s'\"]+\|>|</?[a-z_]+(?::[a-z_]+)?>|\[/?[A-Z_]+\]|<｜[^>]*?｜>")

# template file -> (bos_token, eos_token) of the model's tokenizer_config
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    "deepseek-ai-DeepSeek-V3.1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>"),
    "microsoft-phi-4": (None, "<|im_end|>"),
    "Kimi-K2-Thinking": ("[BOS]", "<|im_end|>"),
    "HuggingFaceTB-SmolLM3-3B": (None, "<|im_end|>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|begin_of_text|>", "<|im_end|>"),
    "ibm-granite-granite-3.3-2B-Instruct": (None, "<|end_of_text|>"),
    "openai-gpt-oss-120b": (None, "<|return|>"),
    "zai-org-GLM-4.5": (None, "<|endoftext|>"),
    "zai-org-GLM-4.6": (None, "<|endoftext|>"),
    "Qwen-Qwen3-Coder-30B-A3B-Instruct": (None, "<|im_end|>"),
    "ByteDance-Seed-Seed-OSS-36B-Instruct": ("<seed:bos>", "<seed:eos>"),
}



def template_text(name: str) -> str:
    return (TEMPLATES_DIR / f"{name}.jinja").read_text()


def train_tokenizer(special_tokens: list[str], vocab_size: int = 600, extra_text: str = "") -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for line in (CORPUS + extra_text).splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines * 5, trainer=trainer)
    return tokenizer


def write_template_tokenizer(directory: Path, name: str, **config) -> Path:
    """The tokenizer files of template `name`; `config` adds tokenizer_config.json keys."""
    bos, eos = TEMPLATES[name]
    template = template_text(name)
    control = sorted(set(CONTROL_TOKEN.findall(template)) | {t for t in (bos, eos) if t})
    directory.mkdir(parents=True, exist_ok=True)
    train_tokenizer(control).save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": 4096, **config}
    if bos:
        config["bos_token"] = bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(template)
    return directory
