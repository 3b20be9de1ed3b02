"""grammar.py: what a response_format becomes, how it is bounded and compiled, and the cache of compiled matchers."""

from __future__ import annotations

import json
import time

import pytest
from tokenizers import Tokenizer

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.grammar import (
    ConstraintKind,
    GrammarError,
    GrammarLimits,
    MatcherCache,
    compile_matcher,
    grammar_tokenizer,
    make_constraint,
)

LIMITS = GrammarLimits()


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    return tok, grammar_tokenizer(tok, [0])


def compiled(tokenizer, kind: ConstraintKind, source: str):
    return compile_matcher(tokenizer[1], make_constraint(kind, source, LIMITS), LIMITS)


def walk(tokenizer, matcher, text: str) -> bool:
    """Feeds `text`'s tokens to the matcher; True when every token was allowed."""
    return all(matcher.consume(t) for t in tokenizer[0].encode(text).ids)


@pytest.mark.parametrize(
    "kind, source, says",
    [
        (ConstraintKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "strin"}}}', "strin"),
        (ConstraintKind.JSON_SCHEMA, '{"a":', "not JSON"),
        (ConstraintKind.JSON_SCHEMA, "[1, 2]", "is an object"),
        (ConstraintKind.JSON_SCHEMA, "[" * 200 + "]" * 200, "nests deeper than 64"),
        (ConstraintKind.REGEX, "a(b", "unclosed group"),
        (ConstraintKind.REGEX, "", "must not be empty"),
        (ConstraintKind.LARK_GRAMMAR, "start: foo", "unknown name"),
        (ConstraintKind.LARK_GRAMMAR, "   ", "must not be empty"),
    ],
)
def test_a_malformed_constraint_is_refused_saying_what_is_wrong(tokenizer, kind, source, says):
    with pytest.raises(GrammarError, match=says):
        compiled(tokenizer, kind, source)


def test_a_constraint_over_the_size_limit_is_refused_before_it_is_parsed():
    source = json.dumps({"enum": ["x" * 100] * 1000})
    started = time.perf_counter()
    with pytest.raises(GrammarError, match="at most 65536 bytes"):
        make_constraint(ConstraintKind.JSON_SCHEMA, source, LIMITS)
    # bounded before anything costs: the refusal does not parse the text
    assert time.perf_counter() - started < 0.05


def test_a_grammar_over_the_symbol_limit_is_refused_as_too_complex(tokenizer):
    tight = GrammarLimits(max_grammar_size=50)
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(200))
    with pytest.raises(GrammarError):
        compile_matcher(tokenizer[1], make_constraint(ConstraintKind.LARK_GRAMMAR, grammar, tight), tight)
    compile_matcher(tokenizer[1], make_constraint(ConstraintKind.LARK_GRAMMAR, grammar, LIMITS), LIMITS)


def test_the_key_is_the_grammar_not_the_kind_or_spelling():
    a = make_constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}', LIMITS)
    b = make_constraint(ConstraintKind.JSON_SCHEMA, '{ "type" :"object" }', LIMITS)
    c = make_constraint(ConstraintKind.JSON_OBJECT, "", LIMITS)
    d = make_constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array"}', LIMITS)
    assert a.key == b.key == c.key != d.key


def test_a_matcher_allows_what_its_schema_allows_and_ends_when_the_value_is_whole(tokenizer):
    schema = (
        '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}'
    )
    matcher = compiled(tokenizer, ConstraintKind.JSON_SCHEMA, schema)
    assert walk(tokenizer, matcher, '{"n": 12}')
    assert matcher.is_stopped
    refused = compiled(tokenizer, ConstraintKind.JSON_SCHEMA, schema)
    assert not walk(tokenizer, refused, '{"m": 1}')
    assert refused.error


def test_a_regex_matcher_takes_a_whole_match_only(tokenizer):
    matcher = compiled(tokenizer, ConstraintKind.REGEX, "[0-9]{3}-[0-9]{2}")
    assert walk(tokenizer, matcher, "123-45") and matcher.is_stopped
    assert not walk(tokenizer, compiled(tokenizer, ConstraintKind.REGEX, "[0-9]{3}-[0-9]{2}"), "12a")


def test_copies_of_a_cached_matcher_advance_apart(tokenizer):
    cache = MatcherCache(capacity=2)
    cache.put("k", compiled(tokenizer, ConstraintKind.REGEX, "ab|ac"))
    first, second = cache.copy("k"), cache.copy("k")
    assert walk(tokenizer, first, "ab") and first.is_stopped
    assert not second.is_stopped and walk(tokenizer, second, "ac")


def test_the_cache_holds_its_capacity_dropping_the_least_recently_used(tokenizer):
    cache = MatcherCache(capacity=2)
    for key in ("a", "b"):
        cache.put(key, compiled(tokenizer, ConstraintKind.REGEX, key))
    assert cache.copy("a") is not None  # "a" is now more recent than "b"
    cache.put("c", compiled(tokenizer, ConstraintKind.REGEX, "c"))
    assert len(cache) == 2 and "b" not in cache and "a" in cache and "c" in cache
    assert cache.copy("b") is None


@pytest.mark.parametrize(
    "kind, source", [(ConstraintKind.LARK_GRAMMAR, "start: start"), (ConstraintKind.REGEX, "[^\\x00-\\x{10FFFF}]")]
)
def test_a_grammar_that_compiles_but_generates_nothing_is_refused_at_its_start(tokenizer, kind, source):
    matcher = compiled(tokenizer, kind, source)  # it compiles
    with pytest.raises(GrammarError, match="allows no output"):
        matcher.check_start()
    compiled(tokenizer, ConstraintKind.REGEX, "[0-9]+").check_start()  # one that generates passes


def test_a_tokenizer_the_grammar_engine_cannot_follow_is_found_at_start(tokenizer):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from services.inference.grammar import support_error

    assert support_error(tokenizer[0], tokenizer[1], LIMITS) == ""  # the bundled model's: served
    # a byte-level BPE that adds a prefix space: llguidance's mask allows a token its matcher then refuses
    spaced = Tokenizer(models.BPE())
    spaced.pre_tokenizer, spaced.decoder = pre_tokenizers.ByteLevel(add_prefix_space=True), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet)
    spaced.train_from_iterator(['def f(x):\n    return {"a": [1, "b"]}\n'] * 20, trainer)
    why = support_error(spaced, grammar_tokenizer(spaced, [0]), LIMITS)
    assert "cannot follow this tokenizer" in why
