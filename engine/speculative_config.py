"""The `speculative` setting of an engine (engine.speculative), free of torch: agent configs read it."""

from __future__ import annotations

from dataclasses import dataclass

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
