"""Tokenizer and chat template of a checkpoint: `tokenizer.json` via `tokenizers`, templates via jinja2.

No torch here: routers use this module to tokenize and detokenize with assets an agent sends them.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from engine.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, TemplateError
from engine.config import read_json
from engine.errors import CheckpointError

__all__ = ["ChatTokenizer", "IncrementalDetokenizer", "TemplateError"]


def _token_text(value) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} objects
    if isinstance(value, dict):
        return value.get("content")
    return value


def _parse_tokenizer(tokenizer_json: str, where: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad input
        raise CheckpointError(f"{where} is not a valid tokenizer ({exc})") from exc


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc


def load_tokenizer_json(path: Path) -> Tokenizer:
    """A checkpoint's tokenizer.json, or CheckpointError naming the file."""
    return _parse_tokenizer(_read_text(path), str(path))


class ChatTokenizer:
    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None, chat_template: str | None = None):
        self.tokenizer = _parse_tokenizer(tokenizer_json, "tokenizer.json")
        self.config = tokenizer_config or {}
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if isinstance(text := _token_text(self.config.get(name)), str)}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        source = chat_template or self._template_from_config()
        self.template = ChatTemplate(source, self.special_tokens) if source else None

    @property
    def chat_template(self) -> str | None:
        return self.template.source if self.template is not None else None

    def _template_from_config(self) -> str | dict[str, str] | None:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates, as tokenizer_config.json stores them
            return {t["name"]: t["template"] for t in template
                    if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text, as transformers' `apply_chat_template(..., tokenize=False)` gives it; kwargs are
        `tools`, `documents` and any variable the template reads (`enable_thinking`, ...)."""
        if self.template is None:
            raise TemplateError("this model has no chat template; use the completions endpoint with a plain prompt")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        # The template already places BOS; encoding must not add a second one.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"model directory {model_dir} does not exist")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        config = read_json(model_dir / "tokenizer_config.json", required=False) or {}
        template_file = model_dir / "chat_template.jinja"
        template = _read_text(template_file) if template_file.is_file() else None
        return cls(_read_text(path), config, template)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.emitted = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty while a character is partial)."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        # Decoding more tokens never changes text already complete, so the new text is the suffix.
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
