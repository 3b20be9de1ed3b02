"""Structured output's grammars: what a call's response_format becomes (a `Constraint`), how it is compiled into a
matcher for this model's vocabulary, and the bounded cache of compiled ones. The grammar engine is llguidance
(chosen by measuring: BENCHMARKS.md, "Grammar engines for structured output"). No torch: the mask is applied by the
sampler (device/sampler.py); this file only makes and copies matchers.

The server compiles a constraint once to refuse a bad one precisely and to learn what its compile costs
(`CompileCosts`); the engine compiles its own copy, off its step thread (engine/grammars.py). Both cache compiled
matchers by the constraint's key, a hash of the grammar text, and hand out copies (`Matcher.copy`, ~10 µs).
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import llguidance
import numpy as np
from tokenizers import Tokenizer


class ConstraintKind(enum.StrEnum):
    """A response_format's kind, as the proto's oneof names it."""

    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK_GRAMMAR = "lark_grammar"


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may cost before it is refused as too complex (INVALID_ARGUMENT). The fuel figures are
    llguidance's units (its docs: ~50k initial fuel/ms, ~14k step fuel/ms), so they bound time as well as size."""

    max_source_bytes: int = 64 << 10  # the schema, regex or grammar as sent
    max_json_depth: int = 64  # nesting of a JSON Schema document
    initial_lexer_fuel: int = 1_000_000  # building the lexer: ~20 ms at most
    step_lexer_fuel: int = 200_000  # one mask: ~15 ms at most (a typical one is ~20-100 µs)
    step_max_items: int = 50_000
    max_lexer_states: int = 100_000  # ~1-2 kB each: 200 MB at most
    max_grammar_size: int = 200_000  # symbols in the productions

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            verbose_errors=False,  # an error names the problem, not the parser's state
        )


class GrammarError(ValueError):
    """The constraint cannot be served: malformed, or too complex for the limits. The message is for the caller."""


@dataclass(frozen=True)
class Constraint:
    """A call's response_format, ready for the engine: `grammar` is llguidance's grammar text and `key` its hash,
    under which compiled matchers are cached. Picklable: it crosses the pipe inside the request."""

    kind: ConstraintKind
    grammar: str
    key: str

    @property
    def num_grammar_bytes(self) -> int:
        return len(self.grammar.encode())


def _depth(text: str) -> int:
    """The deepest nesting of brackets in a JSON text, strings skipped: O(n), before json.loads can recurse."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _schema_grammar(source: str, limits: GrammarLimits) -> str:
    if _depth(source) > limits.max_json_depth:
        raise GrammarError(f"the schema nests deeper than {limits.max_json_depth} levels")
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise GrammarError(f"not JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON Schema is an object (or true/false), got {type(schema).__name__}")
    # strict: a keyword llguidance cannot enforce is refused (lenient would drop it, and the output might not
    # validate); compact separators: the fewest tokens for the same value
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def make_constraint(kind: ConstraintKind, source: str, limits: GrammarLimits) -> Constraint:
    """The constraint for a response_format's `kind` and text (its size already bounded by the caller); GrammarError
    when the text is not what its kind says. Whether the grammar compiles is `compile_matcher`'s to say."""
    if len(source.encode()) > limits.max_source_bytes:
        raise GrammarError(f"at most {limits.max_source_bytes} bytes")
    if kind is ConstraintKind.JSON_OBJECT:
        grammar = _schema_grammar('{"type": "object"}', limits)
    elif kind is ConstraintKind.JSON_SCHEMA:
        grammar = _schema_grammar(source, limits)
    elif kind is ConstraintKind.REGEX:
        if not source:
            raise GrammarError("must not be empty")
        grammar = llguidance.LLMatcher.grammar_from_regex(source)
    else:
        if not source.strip():
            raise GrammarError("must not be empty")
        grammar = llguidance.LLMatcher.grammar_from_lark(source)
    return Constraint(kind, grammar, hashlib.sha256(grammar.encode()).hexdigest())


def grammar_tokenizer(tokenizer: Tokenizer, stop_token_ids: Iterable[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary (~20 ms for 4k tokens, ~1 s for 150k: build it once). A matcher
    allows these stop ids once its grammar accepts, so a call may end where its output is complete."""
    stops = sorted(set(stop_token_ids))
    return llguidance.LLTokenizer(tokenizer.to_str(), eos_token=stops or None)


class Matcher:
    """One call's place in its grammar: the tokens it allows next (as a bitmask over the tokenizer's vocabulary),
    and the tokens drawn so far. Used by one thread at a time: the engine's."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # bits in the mask: the tokenizer's vocabulary, not always the model's rows

    def fill_mask(self, address: int, num_bytes: int) -> None:
        """Writes the allowed tokens at `address`: int32 words, bit j of word w allowing token 32 w + j."""
        self._matcher.unsafe_compute_mask_ptr(address, num_bytes)

    def mask_words(self) -> np.ndarray:
        """The tokens allowed next, as fill_mask writes them (int32 [W]): for checks, not the step's hot path."""
        words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        self.fill_mask(words.ctypes.data, words.nbytes)
        return words

    def consume(self, token: int) -> bool:
        return self._matcher.consume_token(token)

    @property
    def error(self) -> str:
        """Why the matcher failed ('' while it has not): a token its grammar refuses, or its per-token limits."""
        return _first_line(self._matcher.get_error()) if self._matcher.is_error() else ""

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more: the output is whole."""
        return self._matcher.is_stopped()

    def copy(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self.vocab_size)

    def check_start(self) -> None:
        """GrammarError unless the grammar allows some first token: a grammar that compiles may still generate
        nothing (no base case to its recursion, no string its tokens can spell), which only its first mask shows."""
        if not self.mask_words().any() or self.error:
            raise GrammarError("the grammar allows no output (does every rule reach text?)")


def compile_matcher(tokenizer: llguidance.LLTokenizer, constraint: Constraint, limits: GrammarLimits) -> Matcher:
    """A fresh matcher for `constraint` (llguidance drops the GIL while it builds); GrammarError when the grammar
    is malformed or exceeds the limits. Call it off the event loop and off the engine's step thread."""
    matcher = llguidance.LLMatcher(tokenizer, constraint.grammar, log_level=0, limits=limits.parser_limits())
    if matcher.is_error():
        raise GrammarError(_first_line(matcher.get_error()))
    return Matcher(matcher, tokenizer.vocab_size)


def _first_line(error: str, max_chars: int = 300) -> str:
    """llguidance's errors run to several lines (the grammar echoed with a caret): the first says where, a line
    "error: ..." (when there is one) says what."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "the grammar cannot be compiled"
    what = next((line for line in lines[1:] if line.startswith("error:")), "")
    text = f"{lines[0]} {what}".strip()
    return text if len(text) <= max_chars else text[:max_chars] + "…"


# a document every tokenizer the engine serves must be able to spell under its grammar (the self-check below)
_PROBE = (ConstraintKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "array"}}}', '{"a": [1, "b"]}')


def support_error(tokenizer: Tokenizer, grammar: llguidance.LLTokenizer, limits: GrammarLimits) -> str:
    """Why this model's tokenizer cannot be served under grammars ('' when it can): the tokenizer's own spelling
    of a small JSON document must be allowed, token by token, by a matcher of its schema. (A byte-level BPE that
    adds a prefix space, for one, leads llguidance's masks to allow a token that its matcher then refuses: every
    constrained call would fail at its first token.)"""
    kind, schema, document = _PROBE
    matcher = compile_matcher(grammar, make_constraint(kind, schema, limits), limits)
    for token in tokenizer.encode(document, add_special_tokens=False).ids:
        allowed = (int(matcher.mask_words()[token // 32]) >> (token % 32)) & 1
        if not allowed or not matcher.consume(token):
            return f"the grammar engine cannot follow this tokenizer: {document!r} spelt by it is refused at {token}"
    if not matcher.is_stopped:
        return f"the grammar engine does not see {document!r} as whole under its schema"
    return ""


class MatcherCache:
    """Compiled matchers by constraint key, least recently used first out; `copy` hands out a fresh copy of the
    pristine one. Thread-safe: the engine's compile thread puts while its step thread copies."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._matchers: OrderedDict[str, Matcher] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, key: str) -> bool:
        return key in self._matchers

    def put(self, key: str, matcher: Matcher) -> None:
        with self._lock:
            self._matchers[key] = matcher
            self._matchers.move_to_end(key)
            while len(self._matchers) > self.capacity:
                self._matchers.popitem(last=False)

    def copy(self, key: str) -> Matcher | None:
        """A matcher at the grammar's start, or None when `key` is not cached."""
        with self._lock:
            pristine = self._matchers.get(key)
            if pristine is None:
                return None
            self._matchers.move_to_end(key)
            return pristine.copy()
