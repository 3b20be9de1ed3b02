"""The grammar engines behind one interface for bench/grammar_engines.py: compile a case, walk a document with
masks, refuse an invalid one; and what each package is and supports. The mask applies are the sampler's."""

from __future__ import annotations

import importlib.metadata as md
import json
import logging
import os
import subprocess
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: the other core is someone else's

import numpy as np  # noqa: E402
import torch  # noqa: E402
from grammar_cases import EOS, byte_decoder  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

_BITS = torch.arange(32, dtype=torch.int32)
log = logging.getLogger("grammar_engines")


class Refused(Exception):
    """The engine's mask (or its matcher) refused the document's next token, or its end."""


def walk_once(engine, compiled, ids: list[int], bitmask: torch.Tensor) -> tuple[float, float]:
    """One call's whole document on a fresh matcher, every mask checked: ms to the first mask, and ms in all
    (masks and advances; the checks are not timed)."""
    matcher, first, total = engine.matcher(compiled), None, 0.0
    for pos, token in enumerate([*ids, EOS]):
        t0 = time.perf_counter()
        engine.fill([matcher], bitmask)
        first, total = first or ms_since(t0), total + ms_since(t0)
        if not (int(bitmask[0, token >> 5]) >> (token & 31)) & 1:
            raise Refused(f"the mask refused token {token} at {pos} of {len(ids)} (EOS: {EOS})")
        if token != EOS:
            t0 = time.perf_counter()
            try:
                engine.advance([matcher], [token])
            except Exception as exc:  # a token the mask allowed and the matcher refused
                raise Refused(f"{type(exc).__name__}: {exc}") from exc
            total += ms_since(t0)
    return first, total


def refuses(engine, compiled, ids: list[int], vocab: int) -> bool:
    try:
        walk_once(engine, compiled, ids, torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32))
    except Refused:
        return True
    return False


class Unsupported(Exception):
    """The engine has no way to express this kind of grammar."""


class Llguidance:
    """Matchers are built lazily (the lexer up front, masks on demand): `compile` is the LLMatcher's construction,
    and the first walk carries the rest. Options as services/inference/grammar.py sets them."""

    name = package = "llguidance"
    json_options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.executor = llguidance, llguidance.LLExecutor(num_threads=1)

    def setup(self, tok: Tokenizer) -> None:
        self.tokenizer = self.llg.LLTokenizer(tok.to_str(), eos_token=EOS)

    def compile(self, kind: str, source):
        m = self.llg.LLMatcher
        if kind in ("json_schema", "any_json"):
            grammar = m.grammar_from_json_schema(source, defaults=self.json_options)
        else:
            grammar = m.grammar_from_regex(source) if kind == "regex" else m.grammar_from_lark(source)
        matcher = m(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for row, matcher in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        if not all([matcher.consume_token(token) for matcher, token in zip(matchers, tokens)]):
            raise RuntimeError("llguidance refused a token of the document")


class LlguidanceExecutor(Llguidance):
    """llguidance's batch calls. With one thread each call is a hand-off to the executor's worker: dearer than the
    plain loop above at small batches, about even or cheaper at 32, so the loop is the llguidance column."""

    name = "llguidance-executor"

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, list(zip(matchers, range(len(matchers)))), bitmask)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        if not all(self.executor.consume_token_par(list(zip(matchers, tokens)))):
            raise RuntimeError("llguidance refused a token of the document")


class Xgrammar:
    """Compiles eagerly (every reusable mask precomputed); the compiler's cache is off so each compile is real."""

    name = package = "xgrammar"

    def __init__(self) -> None:
        import xgrammar

        self.xgr, self.batch = xgrammar, xgrammar.BatchGrammarMatcher(max_threads=1)

    def setup(self, tok: Tokenizer) -> None:
        # from the vocabulary itself, not TokenizerInfo.from_huggingface: the same information without transformers
        encoded = [s for s, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
        info = self.xgr.TokenizerInfo(encoded, self.xgr.VocabType.BYTE_LEVEL, stop_token_ids=[EOS])
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, source):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(source), any_whitespace=False, separators=(", ", ": "))
        if kind == "any_json":
            return c.compile_builtin_json_grammar()  # strict mode would read {"type": "object"} as only {}
        return c.compile_regex(source) if kind == "regex" else c.compile_lark(source)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        # a loop: with one thread, faster than BatchGrammarMatcher.batch_accept_token (its batch fill is faster)
        if not all([matcher.accept_token(token) for matcher, token in zip(matchers, tokens)]):
            raise RuntimeError("xgrammar refused a token of the document")


class OutlinesCore:
    """A regex compiled to a token-level DFA (Index); JSON Schema goes through a regex, so recursion is cut at a
    fixed depth. No batch call: one Guide per row, in a loop."""

    name, package = "outlines-core", "outlines_core"

    def __init__(self) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema

    def setup(self, tok: Tokenizer) -> None:
        decode, by_bytes = byte_decoder(), {}
        for text, token in tok.get_vocab().items():
            if token != EOS:  # the Vocabulary takes EOS apart; listed, it would match its own text
                by_bytes.setdefault(bytes(decode[ch] for ch in text), []).append(token)
        self.vocab = self.oc.Vocabulary(EOS, by_bytes)

    def compile(self, kind: str, source):
        if kind == "cfg":
            raise Unsupported("no CFG in outlines-core (the outlines package parses CFGs in Python, with lark)")
        regex = source if kind == "regex" else self.to_regex(json.dumps(source))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        words, base = bitmask.shape[1], bitmask.data_ptr()
        for row, guide in enumerate(matchers):
            guide.write_mask_into(base + 4 * words * row, words, 4)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        for guide, token in zip(matchers, tokens):
            guide.advance(token, return_tokens=False)  # raises on a refused token


ENGINES = {"xgrammar": Xgrammar, "llguidance": Llguidance, "outlines-core": OutlinesCore}
ENGINES["llguidance-executor"] = LlguidanceExecutor


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def apply_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed logits to -inf as device/sampler.py does it, the same for every engine: bit j of word w allows
    token 32 w + j; the words' bits, inverted, unpacked by numpy into bools without a copy (1: banned)."""
    banned = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
    logits.masked_fill_(torch.from_numpy(banned).view(torch.bool)[:, : logits.shape[1]], float("-inf"))


def apply_mask_shifts(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The same with torch shifts, as the sampler did it before it unpacked with numpy (for the apply table)."""
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(allowed == 0, float("-inf"))


def check_allowed(bitmask: torch.Tensor, tokens: list[int]) -> None:
    """Every row's mask allows the token its document goes on with (EOS at the end): the engines agree."""
    ids = torch.tensor(tokens)
    bits = (bitmask[torch.arange(len(tokens)), ids >> 5] >> (ids & 31)) & 1
    if not bool(bits.all()):
        raise RuntimeError(f"a mask refused its document's token (rows {bits.eq(0).nonzero().flatten().tolist()})")


# What each engine can express, from its docs and API; the table adds whether this run's case compiled and walked
FEATURES = {
    "xgrammar": {
        "any_json": "built-in JSON grammar",
        "json_schema": "yes",
        "regex": "yes",
        "cfg": "EBNF (GBNF-like); Lark via compile_lark",
    },
    "llguidance": {
        "any_json": 'JSON Schema {"type": "object"}',
        "json_schema": "yes (unsupported keywords refused)",
        "regex": "yes (Rust regex syntax)",
        "cfg": "Lark (its dialect, regex and JSON inside); GBNF converts",
    },
    "outlines-core": {
        "any_json": "a regex of bounded depth",
        "json_schema": "through a regex (bounded recursion)",
        "regex": "yes (a token-level DFA)",
        "cfg": "no",
    },
}

FEATURES["llguidance-executor"] = FEATURES["llguidance"]


def package_info(engine) -> dict:
    """Version, what pip must install with it (extras left out), and its installed size."""
    dist = md.distribution(engine.package)
    needs = [
        r.split(";")[0].strip() + (f" ({r.split(';')[1].strip()})" if ";" in r else "")
        for r in dist.requires or []
        if "extra ==" not in r
    ]
    size = sum(f.size or 0 for f in dist.files or [])
    # a fresh interpreter: what importing it costs, and which heavy packages it brings in with it
    code = f"import sys, time; t = time.perf_counter(); import {engine.package}; print(time.perf_counter() - t); "
    code += "print(*[m for m in ('torch', 'transformers', 'triton') if m in sys.modules])"
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    return {
        "version": dist.version,
        "requires": needs,
        "installed_mb": round(size / 2**20, 1),
        "import_ms": round(float(lines[0]) * 1e3),
        "imports": lines[1].split(),
    }
