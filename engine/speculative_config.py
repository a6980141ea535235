"""The `speculative` setting of an engine (engine.speculative), free of torch: agent configs read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import load_config

METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "ngram"               # ngram: prompt lookup; draft: a smaller model with the same tokenizer
    num_speculative_tokens: int = 3     # k: the most tokens proposed for one sequence in one step
    ngram_min: int = 2                  # n-gram lengths looked up, longest first
    ngram_max: int = 4
    draft_model: str | None = None      # method draft: the draft checkpoint's directory
    draft_kv_cache_bytes: int | None = None  # the draft's KV pool; default: as many blocks as the model's
    # A position is proposed only while the sequence's estimated chance of keeping every proposal up
    # to it is at least this: a verified row costs compute, and a rejected one buys nothing.
    accept_threshold: float = 0.4

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {k!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative n-gram lengths must satisfy 1 <= ngram_min <= ngram_max <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.ngram_min} and {self.ngram_max}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative.method 'draft' needs draft_model, the draft checkpoint's directory")
        if self.method != "draft" and self.draft_model:
            raise ValueError(f"speculative.draft_model is only used by method 'draft', not {self.method!r}")
        if self.draft_kv_cache_bytes is not None and self.draft_kv_cache_bytes <= 0:
            raise ValueError(f"speculative.draft_kv_cache_bytes must be positive, got {self.draft_kv_cache_bytes}")
        if not 0 < self.accept_threshold < 1:
            raise ValueError(f"speculative.accept_threshold must be in (0, 1), got {self.accept_threshold!r}")


# Pairs found compatible in this process, keyed by the files the check reads (_files_read). An agent checks
# its draft when its config loads, so a bad draft is a one-line configuration error, and the engine checks
# it again as it starts the draft (`edgefire generate` and library users have no other check): the second
# finds the pair here instead of parsing both tokenizer.json files again.
_compatible: set[tuple] = set()


def check_draft_model(draft_dir: str | Path, model_dir: str | Path) -> None:
    """Raise ValueError (CheckpointError for an unreadable checkpoint) when the draft at `draft_dir` cannot
    propose tokens for the model at `model_dir`: a token id must mean the same text to both, or every
    proposal is a different token than the draft meant and speculation only costs compute. A draft
    without tokenizer.json is taken at its config's word (the engine itself runs on token ids), so its
    vocabulary must be the model's size. With both tokenizers, sizes may differ where one model pads its
    embedding further than the other (a family's small and large models often do) while every token of
    the shared tokenizer has an id both hold; the draft's logits are then cut or padded to the model's.
    A pair already found compatible, its files unchanged since, is not checked again."""
    files = _files_read(draft_dir, model_dir)
    if files in _compatible:
        return
    _check_pair(draft_dir, model_dir)
    _compatible.add(files)


def _files_read(draft_dir: str | Path, model_dir: str | Path) -> tuple:
    """Each file the check reads, with its size, modification time and inode (None when absent or
    unreadable): a file edited, replaced or removed since makes another key, checked afresh."""
    files = []
    for directory in (draft_dir, model_dir):
        for name in ("config.json", "tokenizer.json"):
            path = Path(directory).resolve() / name
            try:
                stat = path.stat()
            except OSError:
                files.append((str(path), None))
                continue
            files.append((str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return tuple(files)


def _check_pair(draft_dir: str | Path, model_dir: str | Path) -> None:
    draft, target = load_config(draft_dir), load_config(model_dir)
    draft_tokenizer, model_tokenizer = Path(draft_dir) / "tokenizer.json", Path(model_dir) / "tokenizer.json"
    if not (draft_tokenizer.is_file() and model_tokenizer.is_file()):
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens, the model "
                             f"{model_dir} {target.vocab_size}, and without both tokenizer.json files nothing says "
                             f"their ids agree; a draft model must share the model's tokenizer")
        return
    draft_vocab, model_vocab = _token_ids(draft_tokenizer), _token_ids(model_tokenizer)
    if draft_vocab != model_vocab:
        differs = sorted(set(draft_vocab.items()) ^ set(model_vocab.items()), key=lambda item: (item[1], item[0]))
        text = differs[0][0]
        raise ValueError(f"the draft model {draft_dir} has another tokenizer than the model {model_dir}: token "
                         f"{text!r} is id {draft_vocab.get(text)} in the draft's tokenizer.json and "
                         f"{model_vocab.get(text)} in the model's; a draft model must share the model's tokenizer")
    num_ids = max(model_vocab.values(), default=-1) + 1
    if draft.vocab_size != target.vocab_size and min(draft.vocab_size, target.vocab_size) < num_ids:
        raise ValueError(f"the draft model {draft_dir} has a vocabulary of {draft.vocab_size} tokens, the model "
                         f"{model_dir} {target.vocab_size}, and their shared tokenizer has ids up to {num_ids - 1}; "
                         f"a draft model must hold every id of the model's tokenizer")


def _token_ids(path: Path) -> dict[str, int]:
    """Every token's text -> id of a tokenizer.json, added (special) tokens included."""
    from engine.tokenizer import read_tokenizer

    return read_tokenizer(path).get_vocab(with_added_tokens=True)
