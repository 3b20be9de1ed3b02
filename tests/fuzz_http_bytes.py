"""What tests/fuzz_http.py writes into a request where a valid one has something else: header values past every
rule the door checks, and mutations of a valid body's bytes (not JSON, not UTF-8, not an object, too deep, too
large, odd but valid). `f` in a body mutation is the fuzzer (its `max_body`)."""

from __future__ import annotations

import random

HEADER_VALUES = {
    "x-budget-ms": ("0", "-1", "1", "5", "50", "250", "1.5", " 100", "abc", "", "9" * 5000, "600000", "600001",
                    "999999999", "1e3", "+5", "\uff11\uff10\uff10".encode(), b"\xb2", b"\xb9\xb2", b"\xff"),
    "x-envoy-expected-rq-timeout-ms": ("0", "-5", "20", "15000", "abc", b"\xb3", "1" * 30),
    "x-stainless-timeout": ("nan", "inf", "-inf", "0", "-1", "1e-9", "0.001", "1e308", "1_0", "0x10", " 5 ", "601",
                            "5" * 40, "0.05"),
    "x-stainless-read-timeout": ("nan", "0", "2", "1e-300", b"\xb2"),
    "x-labels": ("a", "=", "a=", "=b", "a=b=c", ",,,", "team=fuzz, cost_center=cc-1", "k=v," * 20, "Bad Key=x",
                 "team=" + "t" * 129, "k=v" * 2000, b"team=\xe9", "team=fuzz,team=other"),
    "x-request-id": ("", "a" * 128, "a" * 129, "has spaces!", b"\xe9", "../../etc/passwd", "fuzz-reused"),
    "x-service-class": ("gold", "standard", "Standard", "", "s" * 33, b"\xff"),
    "x-stainless-retry-count": ("1", "-1", "abc", "9" * 20, ""),
    "content-type": ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
                     "application/json; charset=utf-16", b"\xff", "application/json" * 500, None),
    "anthropic-version": ("2023-06-01", "", "x"),
    "accept-encoding": ("gzip", "br;q=1, *;q=0"),
}  # fmt: skip
_BAD_UTF8 = (b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe6\x9d", b"\xf4\x90\x80\x80", b"\x80")


def _not_utf8(rng: random.Random, raw: bytes) -> bytes:
    quotes = [i for i, c in enumerate(raw) if c == ord('"')]
    i = rng.choice(quotes) + 1 if quotes else 0
    return raw[:i] + rng.choice(_BAD_UTF8 + (b"\x01", b"\n", b"\\x41", b"\\ud800", b"\\u12")) + raw[i:]


def _nested(rng: random.Random, depth: int) -> bytes:
    """A value `depth` brackets deep (the body around it adds one), or its brackets left open."""
    opening, closing = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    return opening * depth + b"1" + (closing * depth if rng.random() < 0.8 else b"")


def _field(raw: bytes, value: bytes, name: bytes = b"x_fuzz") -> bytes:
    """The body with one more member, last (a body is a JSON object: it ends with its closing brace)."""
    return raw[:-1] + b',"' + name + b'":' + value + b"}"


# the body's bytes: not JSON, not UTF-8, not an object, too deep, too large, odd but valid (f: the fuzzer)
BODY_MUTATIONS = {
    "empty": lambda f, rng, raw: rng.choice((b"", b" ", b"\r\n", b"null", b"true", b"7", b'"text"', b"{}", b"[]")),
    "top_level_array": lambda f, rng, raw: b"[" + raw + rng.choice((b"", b"," + raw)) + b"]",
    "truncated": lambda f, rng, raw: raw[: rng.randrange(len(raw))],
    "trailing": lambda f, rng, raw: raw + rng.choice((b"}", b" x", b"\x00", b"{}", b"\n\n", b"," + raw)),
    "not_utf8": lambda f, rng, raw: _not_utf8(rng, raw),
    "flipped": lambda f, rng, raw: bytes(c ^ 1 << rng.randrange(8) if rng.random() < 3 / len(raw) else c for c in raw),
    "other_encoding": lambda f, rng, raw: raw.decode().encode(
        rng.choice(("utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1")), "replace"),
    "duplicate_keys": lambda f, rng, raw: _field(
        raw, rng.choice((b"2", b'"x"', b"-1", b"null", b"true")), rng.choice((b"max_tokens", b"prompt", b"model"))),
    "deep": lambda f, rng, raw: _field(raw, _nested(rng, rng.choice((62, 63, 64, 65, 200, 100_000)))),
    "brackets_in_strings": lambda f, rng, raw: _field(raw, b'"' + rng.choice((b"[{", b'\\"[')) * 50_000 + b'"'),
    "oversized": lambda f, rng, raw: b" " * (f.max_body - len(raw) + rng.choice((0, 1, 999, 10**5))) + raw,
    "json5": lambda f, rng, raw: rng.choice(
        (raw.replace(b'"', b"'"), raw[:-1] + b",}", b"/* c */" + raw, raw.replace(b":", b" :\t", 1))),
    "escapes": lambda f, rng, raw: _field(
        raw, b'"' + rng.choice((b"\\u0000", b"\\ud83d\\ude42", b"\\ud800", b"\\/")) * rng.choice((1, 10_000)) + b'"'),
    "many_keys": lambda f, rng, raw: raw[:-1] + b"," + b",".join(b'"k%d":0' % i for i in range(20_000)) + b"}",
}  # fmt: skip
