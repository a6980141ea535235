"""Tokenizer and chat template of a checkpoint: `tokenizer.json` via `tokenizers`, templates via jinja2.

No torch here: routers use this module to tokenize and detokenize with assets an agent sends them.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from engine.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplate, TemplateError
from engine.config import read_json
from engine.errors import CheckpointError

__all__ = ["ChatTokenizer", "IncrementalDetokenizer", "TemplateError", "chat_template_file"]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _special_tokens(config: dict, config_file: str) -> dict[str, str]:
    """The named special tokens' text (`eos_token`, ...): stored as strings or as {"content": ...} objects."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if value is None:
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str):
            raise CheckpointError(f'{config_file}: {name} must be the token\'s text or an object with its "content", '
                                  f"got {_short(value)}")
        tokens[name] = text
    return tokens


def _config_template(config: dict, config_file: str) -> str | dict[str, str] | None:
    """tokenizer_config.json's chat_template: one template, or named ones as [{"name": ..., "template": ...}]."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list):
        raise CheckpointError(f"{config_file}: chat_template must be a template (a string) or a list of named "
                              f"templates, got {_short(template)}")
    for i, entry in enumerate(template):
        if not (isinstance(entry, dict) and all(isinstance(entry.get(key), str) for key in ("name", "template"))):
            raise CheckpointError(f'{config_file}: chat_template[{i}] must be an object with a string "name" and a '
                                  f'string "template", got {_short(entry)}')
    return {entry["name"]: entry["template"] for entry in template}


def _parse_tokenizer(tokenizer_json: str, where: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad input
        raise CheckpointError(f"{where} is not a valid tokenizer ({exc})") from exc


def chat_template_file(model_dir: Path) -> str | None:
    """chat_template.jinja's text, where newer checkpoints keep the template (it comes before
    tokenizer_config.json's); None without one."""
    path = Path(model_dir) / "chat_template.jinja"
    return _read_text(path) if path.is_file() else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc


class ChatTokenizer:
    """A checkpoint's tokenizer and chat template; model_dir (from_dir) is the directory errors name the files in."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None, chat_template: str | None = None,
                 model_dir: Path | None = None):
        where = model_dir or Path()
        self.tokenizer = _parse_tokenizer(tokenizer_json, str(where / "tokenizer.json"))
        config_file = str(where / "tokenizer_config.json")
        self.config = tokenizer_config or {}
        self.special_tokens = _special_tokens(self.config, config_file)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        source = chat_template or _config_template(self.config, config_file)
        self.template = ChatTemplate(source, self.special_tokens) if source else None
        if self.template is not None:
            self._check_rendered_tokens(config_file)

    @property
    def chat_template(self) -> str | None:
        return self.template.source if self.template is not None else None

    def _check_rendered_tokens(self, config_file: str) -> None:
        """A special token the chat template renders must be a token of the tokenizer: otherwise every prompt
        spells it out as ordinary text (transformers appends it to the vocabulary instead, an id the model
        has no embedding for). A special token no template reads is left alone: the engine stops on
        config.json's and generation_config.json's eos_token_id, never on these names."""
        for name in sorted(self.template.variables & self.special_tokens.keys()):
            text = self.special_tokens[name]
            if self.tokenizer.token_to_id(text) is None:
                raise CheckpointError(f"{config_file}: {name} {text!r} is not a token of tokenizer.json, and the chat "
                                      f"template renders it into every prompt; name a token the tokenizer has")

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
        return cls(_read_text(path), config, chat_template_file(model_dir), model_dir)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters; `flush`
    at the end of the stream releases what is held back, so the deltas join to a full decode."""

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
        return self._emit(text)

    def flush(self) -> str:
        """The text still held back once no token will follow: a character left incomplete by the last
        tokens decodes to U+FFFD, as a full decode of every token gives it."""
        return self._emit(self.tokenizer.decode(self.token_ids, self.skip_special_tokens))

    def _emit(self, text: str) -> str:
        # Decoding more tokens never changes text already complete, so the new text is the suffix.
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
