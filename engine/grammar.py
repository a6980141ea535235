"""Grammar-constrained decoding: which tokens a sequence may sample next so its output follows a grammar.

A request's `GrammarSpec` is a JSON schema (`response_format`, tool arguments) or a Lark grammar
(tool-call formats that wrap JSON in the model's own markers). `GrammarCompiler` (one per engine)
turns it into a matcher that lives on the sequence: every sampled token is consumed by it, and
before each sampling step `fill_masks` writes the allowed-token bitmask of every constrained row
at once (the sampler applies it to the logits). The matcher is rebuilt from the tokens generated
so far whenever a sequence starts on an engine with some already generated (KV imported on a
decode site, a mid-stream resume): the state is a pure function of those tokens, so the output
after a move is the one an unmoved run gives.

The library is llguidance rather than xgrammar. Both compile JSON schemas and grammars to token
masks in native code, but llguidance's package depends on nothing (xgrammar's requires
`transformers`, `torch`, `triton` and pydantic, and `transformers` must never be a runtime
dependency of the engine), builds its tokenizer from a `tokenizers` tokenizer.json string alone,
compiles lazily (no per-vocabulary precomputation before the first token, so a new schema costs
milliseconds), and can compute a batch's masks on its own threads with the GIL released. Measured
cost: `benchmarks/structured_output.py`.

Where the masks are computed depends on the device. On a GPU the host is otherwise idle while the
device runs, so the library's thread pool fills the batch's rows in parallel. On a CPU the model's
own threads are the machine's cores: the pool's workers, which spin for a while after each batch
before they sleep, took CPU from the next forward pass (on 2 cores the forward of a constrained run
ran about 9% slower than the free run's, for masks that took 4% of the step). There the rows are
filled one after another on the engine's thread, which costs the same CPU and nothing after.

This module is torch-free: the router imports `check_grammar` to answer a bad schema with a 400
before any site sees it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np

from engine.errors import InvalidRequestError

GRAMMAR_KINDS = ("json_schema", "lark")
MAX_GRAMMAR_BYTES = 1 << 20
COMPILED_CACHE_SIZE = 64
# Compact JSON with the usual separators: no free whitespace for a noisy model to wander into. Schema
# keywords llguidance cannot enforce stay errors (lenient is off), so a compiled schema's output validates.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str     # json_schema | lark
    source: str   # the schema as JSON text, or the Lark grammar

    def validate(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if len(self.source.encode()) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes; send a smaller schema")


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec (InvalidRequestError when the schema is not JSON); a JSON
    schema compiles without what constrains nothing (`without_no_ops`)."""
    spec.validate()
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    source = spec.source
    try:
        source = json.dumps(without_no_ops(json.loads(spec.source)))
    except RecursionError:
        pass  # nested past Python's limit: the library refuses the schema as sent below, in its own words
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema cannot be read as JSON: {exc}") from None
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(source, overrides=_JSON_OPTIONS)
    except ValueError as exc:
        if "recursion limit" in str(exc):  # the library reads at most 128 levels of nested objects and arrays
            raise InvalidRequestError(f"the JSON schema nests objects and arrays too deeply for the grammar library "
                                      f"({exc}); flatten it, or move nested parts to `$defs`") from None
        raise InvalidRequestError(f"the JSON schema cannot be read as JSON: {exc}") from None


def check_grammar(spec: GrammarSpec) -> str | None:
    """None when the grammar compiles; else what is wrong with it, in the library's words, and for a keyword
    of a JSON schema, where in the schema it is (the library names the keyword only)."""
    try:
        grammar = to_llguidance(spec)
    except InvalidRequestError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    problem = messages[0]
    if spec.kind == "json_schema":
        if problem.startswith(_ONE_OF_REFUSED):
            # The library's own words name an option of its own that a client cannot set.
            problem = ("oneOf is enforced only where its alternatives plainly exclude each other (different types, "
                       "or objects told apart by a `const` property); use anyOf instead")
        path = _keyword_path(json.loads(spec.source), problem)
        if path is not None:
            problem += f" (at {path or '/'} in the schema)"
    return problem


_ONE_OF_REFUSED = "oneOf constraints are not supported"
# Keywords whose value is a schema, a list of schemas, or an object of schemas: where subschemas may sit.
_SUBSCHEMA_KEYWORDS = ("properties", "patternProperties", "additionalProperties", "items", "prefixItems",
                       "additionalItems", "contains", "propertyNames", "anyOf", "allOf", "oneOf", "not", "if",
                       "then", "else", "dependentSchemas", "unevaluatedItems", "unevaluatedProperties",
                       "$defs", "definitions")
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")


# Keyword values that constrain nothing (each is the keyword's default), which client generators emit
# (OpenAPI and Java ones write `uniqueItems: false` on every array) and the library refuses as unimplemented.
_NO_OP_VALUES = {"uniqueItems": (False,), "unevaluatedProperties": (True, {}), "unevaluatedItems": (True, {}),
                 "propertyNames": (True, {}), "dependentRequired": ({},), "dependentSchemas": ({},),
                 "dependencies": ({},)}


# `format` values that name a type's encoding or a library's own type, written by OpenAPI generators
# (OpenAPI 3's data type formats) and pydantic (`bytes`, `SecretStr`, `Path`, `UUID4`, IP types...). No
# JSON Schema validator asserts them, so leaving them out loses nothing a client could check; the library
# refuses them as unknown. A format JSON Schema defines stays: enforced where the library can, else a 400.
_ANNOTATION_FORMATS = frozenset({
    "int32", "int64", "float", "double", "byte", "binary", "password",
    "base64", "path", "file-path", "directory-path", "uuid1", "uuid3", "uuid4", "uuid5", "name-email",
    "multi-host-uri", "ipvanyaddress", "ipvanyinterface", "ipvanynetwork", "ipv4interface", "ipv6interface",
    "ipv4network", "ipv6network"})


def without_no_ops(schema):
    """The schema without what constrains nothing: the no-op keyword values above, and a `format` that is
    an annotation only (above). Annotation keywords (`title`, `description`, `examples`, `default`,
    `deprecated`, `readOnly`, `$comment`...) the library already ignores. Returns a copy; the client's
    schema is left as sent."""
    if not isinstance(schema, dict):
        return schema
    kept = {}
    for keyword, value in schema.items():
        if any(value == no_op and type(value) is type(no_op) for no_op in _NO_OP_VALUES.get(keyword, ())):
            continue
        if keyword == "format" and isinstance(value, str) and value in _ANNOTATION_FORMATS:
            continue
        kept[keyword] = _subschemas_without_no_ops(keyword, value)
    return kept


def _subschemas_without_no_ops(keyword: str, value):
    """`value` of `keyword` with no-ops dropped from the subschemas in it (other values, such as a `const`
    or an `enum` that happens to hold a `uniqueItems` key, are data and stay untouched)."""
    if keyword not in _SUBSCHEMA_KEYWORDS:
        return value
    if keyword in _NAMED_SUBSCHEMAS and isinstance(value, dict):
        return {name: without_no_ops(sub) for name, sub in value.items()}
    if isinstance(value, list):
        return [without_no_ops(sub) for sub in value]
    return without_no_ops(value)


def _keyword_path(schema, problem: str) -> str | None:
    """The JSON pointer of the first subschema holding the keyword (or format) the library refused, if the
    problem names one; None when it names none or the schema has no such place."""
    if problem.startswith("Unimplemented keys: "):
        try:
            keys = set(json.loads(problem[len("Unimplemented keys: "):]))
        except ValueError:
            return None
        def holds(node: dict) -> bool:
            return not keys.isdisjoint(node)
    elif problem.startswith("Unknown format: "):
        fmt = problem[len("Unknown format: "):].strip()
        def holds(node: dict) -> bool:
            return node.get("format") == fmt
    elif problem.startswith("oneOf "):
        def holds(node: dict) -> bool:
            return "oneOf" in node
    else:
        return None
    stack = [("", schema)]
    while stack:  # depth first, in the schema's own order
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        if holds(node):
            return path
        children = []
        for keyword in _SUBSCHEMA_KEYWORDS:
            value, at = node.get(keyword), f"{path}/{_pointer_token(keyword)}"
            if keyword in _NAMED_SUBSCHEMAS and isinstance(value, dict):
                children += [(f"{at}/{_pointer_token(name)}", sub) for name, sub in value.items()]
            elif isinstance(value, list):
                children += [(f"{at}/{i}", sub) for i, sub in enumerate(value)]
            else:
                children.append((at, value))
        stack.extend(reversed(children))
    return None


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def json_schema_spec(schema: dict | bool) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def lark_json(schema: dict) -> str:
    """A Lark rule body for JSON following `schema`, written as compactly as a json_schema spec's output."""
    return "%json " + json.dumps({**without_no_ops(schema), "x-guidance": _JSON_OPTIONS})


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """One engine's grammars: the model's tokenizer as llguidance sees it, compiled grammars (LRU),
    and the executor that fills a batch's masks in parallel."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 num_threads: int | None = None) -> None:
        """num_threads: the mask pool's threads (None: the library's share of the CPUs); 1 fills the rows
        on the calling thread, with no pool."""
        self.vocab_size = vocab_size
        try:
            # A model without end-of-sequence ids still needs one for the grammar: the library's guess (the
            # engine ends a constrained sequence on it, as on the model's own).
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                    eos_token=sorted(eos_token_ids) or None)
        except (ValueError, RuntimeError) as exc:
            raise InvalidRequestError(f"this model's tokenizer cannot be used for constrained output: {exc}") from exc
        self.eos_token_ids = frozenset(self.tokenizer.eos_tokens)
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        self.executor = None if num_threads == 1 else llguidance.LLExecutor(num_threads=num_threads)
        self.mask_words = (vocab_size + 31) // 32
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # the agent checks grammars off the engine thread

    def matcher(self, spec: GrammarSpec, generated_ids: list[int] = ()) -> GrammarMatcher:
        """A fresh matcher for the spec, advanced over the tokens already generated."""
        matcher = self.compile(spec).deep_copy()
        if generated_ids and not matcher.consume_tokens(list(generated_ids)):
            raise InvalidRequestError(f"the tokens already generated do not follow the request's grammar "
                                      f"({matcher.get_error()}); resume with the tokens this grammar produced")
        return GrammarMatcher(matcher)

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The spec's compiled matcher, from the cache when it was compiled before (thread-safe)."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = llguidance.LLMatcher(self.tokenizer, to_llguidance(spec), log_level=0)
        if compiled.is_error():
            raise InvalidRequestError(f"the grammar does not compile: {compiled.get_error()}")
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def fill_masks(self, matchers: list[GrammarMatcher | None]) -> np.ndarray | None:
        """Allowed-token bitmasks [rows, ceil(vocab/32)] int32 (bit t of a row: token t allowed), all
        ones for unconstrained rows; None when no row is constrained."""
        rows = [(m.matcher, row) for row, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = np.full((len(matchers), self.mask_words), -1, dtype=np.int32)
        row_bytes = self.mask_words * 4
        if self.executor is None:
            base = bitmask.ctypes.data
            for matcher, row in rows:
                matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        else:
            self.executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, row_bytes, len(matchers))
        return bitmask
