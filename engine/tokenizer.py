"""Tokenizer and chat template of a checkpoint: `tokenizer.json` via `tokenizers`, templates via jinja2.

No torch here: routers use this module to tokenize and detokenize with assets an agent sends them.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer

from engine.chat_template import (CONTROL_TOKEN_END, CONTROL_TOKEN_START, SPECIAL_TOKEN_NAMES, ChatTemplate,
                                  TemplateError, control_token_pattern, mark_control_tokens, marked_token_pattern)
from engine.config import read_json
from engine.errors import CheckpointError

__all__ = ["ChatTokenizer", "IncrementalDetokenizer", "TemplateError", "chat_template_file", "processor_chat_template",
           "read_tokenizer"]
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # named templates beside chat_template.jinja


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


def _control_tokens(added_tokens, template_literals: str, config: dict, config_file: str) -> list[str]:
    """The added tokens a client's text may not produce: the special ones, plus those tokenizer_config.json lists
    as `chat_control_tokens`, or without that list those the template writes (whitespace tokens aside, such as
    Gemma's "\\n", which templates write as ordinary text)."""
    listed = config.get("chat_control_tokens")
    if listed is not None and not (isinstance(listed, list) and all(isinstance(t, str) for t in listed)):
        raise CheckpointError(f"{config_file}: chat_control_tokens must be a list of token texts, got {_short(listed)}")
    if listed is not None:
        return [token.content for token in added_tokens if token.special or token.content in listed]
    return [token.content for token in added_tokens
            if token.special or (token.content in template_literals and not token.content.isspace())]


def read_tokenizer(path: Path) -> Tokenizer:
    """tokenizer.json at `path`; CheckpointError naming the file when it is not UTF-8 or not a tokenizer."""
    return _parse_tokenizer(_read_text(path), str(path))


def _parse_tokenizer(tokenizer_json: str, where: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad input
        raise CheckpointError(f"{where} is not a valid tokenizer ({exc})") from exc


def chat_template_file(model_dir: Path) -> str | dict[str, str] | None:
    """The chat template(s) newer checkpoints keep in files, as transformers' `save_pretrained` writes them:
    chat_template.jinja (the `default`) and additional_chat_templates/NAME.jinja (named ones such as
    `tool_use`). One template is its text, several are {name: text}; None without any. As in transformers,
    these files come before tokenizer_config.json's `chat_template`."""
    model_dir = Path(model_dir)
    templates = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = _read_text(model_dir / "chat_template.jinja")
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = _read_text(path)
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


def processor_chat_template(model_dir: Path) -> str | None:
    """The chat template an image-and-text checkpoint may keep only in its processor's chat_template.json
    (`{"chat_template": "..."}`, as transformers' processors save it): the last place looked, after the
    template files and tokenizer_config.json's `chat_template`. None without the file."""
    path = Path(model_dir) / "chat_template.json"
    config = read_json(path, required=False)
    if config is None:
        return None
    template = config.get("chat_template")
    if not isinstance(template, str) or not template.strip():
        raise CheckpointError(f"{path}: `chat_template` must be the template's text (a non-empty string), "
                              f"got {type(template).__name__}")
    return template


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc


class ChatTokenizer:
    """A checkpoint's tokenizer and chat template; model_dir (from_dir) is the directory errors name the files in."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict | None = None,
                 chat_template: str | dict[str, str] | None = None, model_dir: Path | None = None):
        where = model_dir or Path()
        self.tokenizer = _parse_tokenizer(tokenizer_json, str(where / "tokenizer.json"))
        config_file = str(where / "tokenizer_config.json")
        self.config = tokenizer_config or {}
        self.special_tokens = _special_tokens(self.config, config_file)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        source = chat_template or _config_template(self.config, config_file)
        self.template = ChatTemplate(source, self.special_tokens) if source else None
        self._control_tokens: dict[str, re.Pattern] = {}  # per template: the control tokens a client may not write
        if self.template is not None:
            self._check_rendered_tokens(config_file)
            added = self.tokenizer.get_added_tokens_decoder().values()
            self._marked_tokens = marked_token_pattern([token.content for token in added])
            self._newline_ids = self.encode("\n", add_special_tokens=False)
            self._control_tokens = {name: control_token_pattern(_control_tokens(added, literal, self.config,
                                                                                config_file))
                                    for name, literal in self.template.literals.items()}

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

    def encode_chat(self, messages: list[dict], tools: list | None = None, documents: list | None = None,
                    **kwargs) -> list[int]:
        """The prompt's token ids, as transformers' `apply_chat_template(..., tokenize=True,
        sanitize_control_tokens=True)` gives them: a control token written in the messages, tools, documents or
        template variables is encoded as the plain text it is, so only the template's own control tokens are
        tokens (a user typing `<|im_end|>` cannot end their turn). The template places BOS; encoding adds none."""
        if self.template is None:
            return self.apply_chat_template(messages)  # raises: no template
        mark = functools.partial(mark_control_tokens, control_tokens=self._control_tokens[self.template.select(tools)])
        text = self.apply_chat_template(mark(messages), tools=mark(tools), documents=mark(documents), **mark(kwargs))
        return self._encode_marked(text)

    def _encode_marked(self, text: str) -> list[int]:
        """`text` rendered from marked inputs: marked tokens encoded as plain text, the rest as usual. A lone
        marker (a template's string method split a marked token) is dropped but still separates the text on
        either side, so the pieces cannot join into a control token."""
        if CONTROL_TOKEN_START not in text and CONTROL_TOKEN_END not in text:
            return self.encode(text, add_special_tokens=False)
        pieces = self._marked_tokens.split(text)  # [text, marked token or None, text, ...]
        ids = self.encode(pieces[0], add_special_tokens=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            piece_ids = self._encode_piece(piece, as_text)
            if as_text and self.token_to_id(piece) in piece_ids:
                raise TemplateError(f"the request's text holds {piece!r}, which this tokenizer encodes as its control "
                                    f"token even when read as plain text; remove it")
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        """A piece from the middle of a prompt, encoded after a newline that is then removed, so a SentencePiece
        tokenizer does not add the space it adds at the start of a text (as transformers does)."""
        encode = self._encode_plain if as_text else functools.partial(self.encode, add_special_tokens=False)
        piece_ids = encode("\n" + piece)
        if piece_ids[:len(self._newline_ids)] == self._newline_ids:
            return piece_ids[len(self._newline_ids):]
        return encode(piece)

    def _encode_plain(self, text: str) -> list[int]:
        """`text` through the tokenizer's normalizer, pre-tokenizer and model, matching no added token."""
        tokenizer = self.tokenizer
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        splits = [text]
        if tokenizer.pre_tokenizer is not None:
            splits = [split for split, _offsets in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
        return [token.id for split in splits for token in tokenizer.model.tokenize(split)]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTokenizer:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"model directory {model_dir} does not exist")
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: no tokenizer.json")
        config = read_json(model_dir / "tokenizer_config.json", required=False) or {}
        template = chat_template_file(model_dir)
        if template is None and not config.get("chat_template"):
            template = processor_chat_template(model_dir)
        return cls(_read_text(path), config, template, model_dir)


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
