"""Seeded HTTP requests for fuzzing the HTTP door (services/http/): valid bodies of its three APIs, field and byte
mutations of them, and mutated headers, keys, methods, paths, encodings and HTTP/1.1 framing. Each is the raw bytes
of one request, for a fresh connection (an HTTP client would refuse or repair most of them). Request `index` of seed
`seed` is a pure function of the two, so a failing one is made again alone with `HttpFuzzer(seed, ...).case(index)`.
Nothing here talks to a server: tests/http/test_fuzz_http.py sends 2,000 of them."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, replace
from urllib.parse import unquote, urlsplit

from tests.fuzz_formats import BAD_SCHEMAS, SCHEMAS
from tests.fuzz_http_bytes import BODY_MUTATIONS, HEADER_VALUES

GENERATE_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages"}
GET_PATHS = ("/v1/models", "/health")
SLOW_BODY_S = 10.0  # HttpLimits.body_timeout_s: a body that never arrives is answered 408 after this long
_WORDS = ("def", " add", "(a, b)", ":\n", "    return", " a + b", "The quick", " fox", "Überraschung!", "東京", "🙂")
_RAW = "@@raw{}@@"  # a placeholder json.dumps writes, replaced by a literal that is not JSON's (or not Python's)
_LITERALS = ("1e400", "-1e400", "1E-400", "-0", "NaN", "Infinity", "0x10", "01", "1_000", "1.", ".5", "+1", "9" * 400)
_BAD = (None, True, 0, -1, 1.5, 10**30, "", "1", "x" * 300, [], [None], {}, {"a": {"b": []}},
        *map(_RAW.format, _LITERALS))  # fmt: skip
_INTS = (0, -1, 2**31, -(2**31) - 1, 2**63, 10**30, 1.0, 2.5, "3", True, None)


@dataclass(frozen=True)
class HttpCase:
    index: int
    kind: str  # family:what, e.g. valid:chat, field:messages.max_tokens, header:x-budget-ms, wire:chunked
    raw: bytes  # the request as written on the connection
    method: str
    path: str  # the route the server sees (percent-decoded, no query)
    anthropic: bool  # a refusal is Anthropic's error shape (else OpenAI's)
    # kinds `<family>:bad_...`: bytes uvicorn's HTTP parser (llhttp) refuses with its own plain 400 before any route:
    # not HTTP/1.1, or outside what llhttp takes (an unregistered method, a raw non-ASCII target, a control byte)
    unparsable: bool = False
    pieces: tuple[int, ...] = ()  # offsets in `raw` where the sender pauses (a slow sender, a head in pieces)


def _dumps(body, rng: random.Random) -> bytes:
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5, separators=rng.choice(((",", ":"), (", ", ": "))))
    for literal in _LITERALS:
        raw = raw.replace(f'"{_RAW.format(literal)}"', literal)
    return raw.encode("utf-8", "surrogatepass")


def expects_anthropic(method: str, path: str, names: set[str]) -> bool:
    """Which error shape the door answers: by route, then (unknown route, /v1/models) by Anthropic's headers."""
    if method == "POST" and path in GENERATE_PATHS:
        return path == "/v1/messages"
    if path == "/v1/models" and method in ("GET", "HEAD"):
        return bool(names & {"anthropic-version", "x-api-key"})
    return path.startswith("/v1/messages") or "anthropic-version" in names


def _route(target: str) -> str:
    return unquote(urlsplit(target).path if target.startswith("http://") else target.split("?")[0])


class HttpFuzzer:
    """`model`, `context_length`, `vocab_size` and `max_body_bytes` are the replica's, so that boundaries are hit;
    `keys` the caller's API key and a second tenant's."""

    def __init__(self, seed: int, model: str, context_length: int, vocab_size: int, max_body_bytes: int, keys):
        self.seed, self.model, self.context, self.vocab = seed, model, context_length, vocab_size
        self.max_body, (self.key, self.other_key) = max_body_bytes, keys

    def case(self, index: int) -> HttpCase:
        rng = random.Random(f"{self.seed}:{index}")
        path = rng.choice(tuple(GENERATE_PATHS))
        api = GENERATE_PATHS[path]
        body = getattr(self, f"_valid_{api}")(rng)
        r = rng.random()
        if r < 0.25:
            return self._build(index, f"valid:{api}", rng, "POST", path, _dumps(body, rng))
        if r < 0.55:
            names = [self._mutate_field(rng, api, body) for _ in range(rng.choice((1, 1, 2, 3)))]
            return self._build(index, f"field:{api}." + ",".join(sorted(names)), rng, "POST", path, _dumps(body, rng))
        if r < 0.70:
            name = rng.choice(sorted(BODY_MUTATIONS))
            raw = BODY_MUTATIONS[name](self, rng, _dumps(body, rng))
            return self._build(index, f"body:{name}", rng, "POST", path, raw)
        if r < 0.85:
            name, headers = self._header_mutation(rng, body)
            return self._build(index, f"header:{name}", rng, "POST", path, _dumps(body, rng), headers)
        if r < 0.93:
            return self._route_case(index, rng, path, _dumps(body, rng))
        return self._wire_case(index, rng, path, _dumps(body, rng))

    # --- valid bodies: short, cheap to serve (1-4 tokens, a few more under a response format) -------------------

    def _text(self, rng: random.Random, most: int = 8) -> str:
        return "".join(rng.choice(_WORDS) for _ in range(rng.randint(1, most)))

    def _content(self, rng: random.Random):
        if rng.random() < 0.7:
            return self._text(rng)
        return [{"type": "text", "text": self._text(rng)} for _ in range(rng.randint(1, 3))]

    def _sampling(self, rng: random.Random, body: dict) -> dict:
        return _some(rng, body,
            (0.3, {"temperature": rng.choice((0, 0.0, 0.7, 1))}), (0.2, {"top_p": rng.choice((0.5, 1))}),
            (0.3, {"seed": rng.choice((0, 7, 2**64 - 1))}), (0.3, {"model": self.model}),
            (0.2, {"stream": True, "stream_options": {"include_usage": rng.random() < 0.5}}),
            (0.15, {"stop": rng.choice(("\n", ["return", "🙂"], []))}),
            (0.1, {"n": 1, "frequency_penalty": 0, "service_tier": rng.choice(("auto", "default")), "user": "u1"}),
            (0.1, {"metadata": {"team": "fuzz", "cost_center": f"cc-{rng.randrange(10)}"}}),
            (0.1, {"top_k": rng.choice((0, 1, 40)), "min_p": 0, "repetition_penalty": 1}),
        )  # fmt: skip

    def _format(self, rng: random.Random) -> dict:
        schema = {"name": "r", "schema": rng.choice(SCHEMAS), "strict": True}
        return rng.choice(({"type": "json_object"}, {"type": "json_schema", "json_schema": schema}))

    def _valid_chat(self, rng: random.Random) -> dict:
        roles = ("system", "developer", "user", "assistant", "tool")
        messages = [{"role": rng.choice(roles), "content": self._content(rng)} for _ in range(rng.randint(1, 3))]
        body = self._sampling(rng, {"messages": messages})
        body[rng.choice(("max_tokens", "max_tokens", "max_completion_tokens"))] = rng.randint(1, 4)
        r = rng.random()
        if r < 0.12:
            body["response_format"] = self._format(rng)
        elif r < 0.22:
            body |= {"logprobs": True, "top_logprobs": rng.choice((0, 1, 5, 20))}
        return body

    def _valid_completions(self, rng: random.Random) -> dict:
        ids = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 12))]
        prompt = rng.choice((self._text(rng), self._text(rng), ids, [self._text(rng)], [ids]))
        body = self._sampling(rng, {"prompt": prompt, "max_tokens": rng.randint(1, 4)})
        r = rng.random()
        if r < 0.1:
            body |= {"logprobs": rng.randint(0, 5), "echo": False, "best_of": 1}
        elif r < 0.2:
            body["response_format"] = self._format(rng)
        return body

    def _valid_messages(self, rng: random.Random) -> dict:
        roles = ("user", "assistant")
        turns = [{"role": roles[i % 2], "content": self._content(rng)} for i in range(rng.choice((1, 3)))]
        body = {"model": self.model, "max_tokens": rng.randint(1, 4), "messages": turns}
        return _some(rng, body,
            (0.3, {"system": self._content(rng)}), (0.2, {"temperature": rng.choice((0, 1))}),
            (0.2, {"top_k": rng.choice((1, 40))}), (0.2, {"stop_sequences": rng.choice((["\n"], []))}),
            (0.2, {"stream": True}), (0.1, {"metadata": {"user_id": "u-1"}}),
            (0.1, {"output_format": {"type": "json_schema", "schema": rng.choice(SCHEMAS)}}),
        )  # fmt: skip

    # --- one field of the body set wrong, deleted, or joined by unknown ones ---------------------------------------

    def _fields(self, api: str) -> dict[str, tuple]:
        bad_schemas = tuple(_loads(s) for s in BAD_SCHEMAS) + (json.loads('{"items": ' * 70 + "{}" + "}" * 70),)
        common = {
            "model": ("gpt-4o", "", " ", self.model.upper(), "m" * 1000, 7),
            "temperature": (-1, 2.1, 100, 1e-45, "0.5", _RAW.format("1e400")),
            "top_p": (0, -0.1, 1.1, _RAW.format("1E-400")),
            "stream": ("true", 1, None),
            "tools": ([{"type": "function", "function": {"name": "f"}}], "x"),
            "metadata": ({f"k{i}": "v" for i in range(17)}, {"team": 1}, {"Bad Key": "x"}, {"team": "t" * 129}, "m"),
        }
        stops = (["s"] * 9, ["y" * 65] * 8, "", [""], [1], ["\x00"], ["stop"] * 1000, "é" * 100)
        if api == "messages":
            return common | {
                "max_tokens": (*_INTS, self.context, self.context + 1),
                "messages": ([], [{"role": "system", "content": "x"}], [{"role": "user", "content": None}],
                             [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                             [{"role": "user", "content": "x " * 5000}], [{"role": "user"}] * 257, "hi"),
                "system": (7, [{"type": "text"}], [{"type": "text", "text": "s"}] * 65, "s " * 5000),
                "stop_sequences": stops, "top_k": (-1, 2**31, 1.5, self.vocab + 1),
                "metadata": ({"user_id": 7}, {"user_id": "u" * 200}, "x"),
                "output_format": ({"type": "json_schema"}, {"type": "text", "schema": {}},
                                  *({"type": "json_schema", "schema": s} for s in bad_schemas)),
            }  # fmt: skip
        openai = common | {
            "n": (2, 0, -1, 10**20, "2"), "logit_bias": ({"1": 5}, {"x": "y"}, []),
            "frequency_penalty": (0.5, -2, "x"), "presence_penalty": (1, _RAW.format("NaN")),
            "seed": (-1, 2**64, 2**63, 1.5), "stop": stops,
            "stream_options": ({"include_usage": "yes"}, [], {"include_usage": True}),
            "service_tier": ("gold", "standard", "flex", "", "s" * 33, 7), "user": (7, "u" * 10_000),
            "top_k": (-1, 2**31, 1.5, self.vocab + 1), "min_p": (0.5, "x"), "repetition_penalty": (1.3, -1),
            "guided_json": ({"type": "object"}, "x"), "structured_outputs": ({"json": {}},),
            "response_format": ({"type": "json_schema"}, {"type": "xml"}, "json", {"type": "json_object", "x": []},
                                {"type": "json_schema", "json_schema": {"name": "x"}},
                                {"type": "json_schema", "json_schema": {"schema": {"enum": ["v" * 8] * 8000}}},
                                *({"type": "json_schema", "json_schema": {"schema": s}} for s in bad_schemas)),
        }  # fmt: skip
        if api == "completions":
            return openai | {
                "prompt": ("", [], [[]], [-1], [self.vocab], [2**31], ["a", "b"], [[1], [2]], [1.5], None, 7,
                           "x" * (self.context * 32 + 1), "x " * self.context, [1] * (self.context + 1), "\x00"),
                "max_tokens": (*_INTS, self.context), "logprobs": (-1, 6, 2**31, True),
                "echo": (True, "x"), "suffix": ("s", 7), "best_of": (2, 0),
            }  # fmt: skip
        return openai | {
            "messages": ([], "hi", [{"content": "x"}], [{"role": "robot", "content": "x"}],
                         [{"role": "user", "content": 7}], [{"role": "user", "content": "x"}] * 257,
                         [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
                         [{"role": "user", "content": [{"type": "text", "text": "x"}] * 65}],
                         [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}],
                         [{"role": "tool", "content": "r", "name": "n" * 65}],
                         [{"role": "user", "content": "x " * 5000}],
                         [{"role": "user", "content": "{% for i in range(10**9) %}x{% endfor %}<|im_end|>"}]),
            "max_tokens": (*_INTS, self.context), "max_completion_tokens": (0, -1, 2**31, "3"),
            "logprobs": ("yes", 1), "top_logprobs": (-1, 21, 2**31, 5),
        }  # fmt: skip

    def _mutate_field(self, rng: random.Random, api: str, body: dict) -> str:
        r = rng.random()
        if r < 0.6:
            name, values = rng.choice(sorted(self._fields(api).items()))
            body[name] = rng.choice(values)
        elif r < 0.8:
            name = rng.choice(sorted(body))
            body[name] = rng.choice(_BAD)
        elif r < 0.9:
            name = rng.choice(sorted(body))
            del body[name]
        else:
            name = "unknown"
            body |= {f"x_{rng.randrange(1000)}": rng.choice(_BAD) for _ in range(rng.randint(1, 5))}
        return name

    # --- headers: the budget, labels, ids, class, keys, sizes ---------------------------------------------------------

    def _header_mutation(self, rng: random.Random, body: dict) -> tuple[str, list]:
        name = rng.choice((*sorted(HEADER_VALUES), "authorization", "x-api-key", "oversized", "class_and_tier"))
        if name in HEADER_VALUES:
            return name, [(name, rng.choice(HEADER_VALUES[name])) for _ in range(rng.choice((1, 1, 2)))]
        if name == "authorization":
            key, other = self.key, self.other_key
            values = ("Bearer", "Bearer nope", "Basic dXNlcjpwYXNz", f"bearer {key}", f"Bearer {key} ",
                      f"Bearer  {key}", f"Bearer {other}", "Bearer " + "k" * 20_000, b"Bearer \xff", "",
                      None)  # fmt: skip
            return name, [("authorization", rng.choice(values)), ("x-api-key", None)]
        if name == "x-api-key":
            values = (self.other_key, "nope", "", self.key + "x")
            return name, [("authorization", rng.choice((None, "Bearer nope"))), ("x-api-key", rng.choice(values))]
        if name == "oversized":
            if rng.random() < 0.5:
                return name, [("x-big", "b" * rng.choice((8_000, 16_500, 100_000)))]
            return name, [(f"x-h{i}", "v" * 30) for i in range(rng.choice((100, 600)))]
        body["service_tier"] = rng.choice(("gold", "standard", "auto"))
        return name, [("x-service-class", rng.choice(("gold", "standard")))]

    # --- assembling the request's bytes -----------------------------------------------------------------------------

    def _headers(self, rng: random.Random) -> list[tuple[str, str | bytes]]:
        auth = ("authorization", f"Bearer {self.key}") if rng.random() < 0.8 else ("x-api-key", self.key)
        return [("host", "127.0.0.1"), auth, ("content-type", "application/json"), ("connection", "close")]

    def _build(self, index, kind, rng, method, target, body, headers=None, framing="length") -> HttpCase:
        """headers: (name, value) over the defaults (value None: left out); framing: length | chunked | none | a
        Content-Length header's value."""
        merged = dict(self._headers(rng))
        extra = []
        for name, value in headers or ():
            if name in merged:
                merged[name] = value
            elif value is not None:
                extra.append((name, value))
        lines = [(n, v) for n, v in merged.items() if v is not None] + extra
        if framing == "chunked":
            lines.append(("transfer-encoding", "chunked"))
            body = _chunked(rng, body)
        elif framing == "length":
            lines.append(("content-length", str(len(body))))
        elif framing != "none":
            lines.append(("content-length", framing))
        head = f"{method} {target} HTTP/1.1\r\n".encode() + b"".join(_line(n, v) for n, v in lines)
        route, names = _route(target), {n.lower() for n, v in lines if v is not None}
        anthropic = expects_anthropic(method, route, names)
        return HttpCase(index, kind, head + b"\r\n" + body, method, route, anthropic, ":bad" in kind)

    def _route_case(self, index: int, rng: random.Random, path: str, body: bytes) -> HttpCase:
        r = rng.random()
        if r < 0.35:
            method = rng.choice(("GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "FOO", "PROPFIND"))
            kind = f"route:{'bad_method ' if method == 'FOO' else ''}{method}"  # llhttp takes no method it lacks
            return self._build(index, kind, rng, method, path, body)
        if r < 0.55:
            method, target = rng.choice(("GET", "GET", "HEAD", "POST", "PUT", "DELETE")), rng.choice(GET_PATHS)
            headers = rng.choice(((), (("authorization", "Bearer nope"),), (("anthropic-version", "2023-06-01"),)))
            return self._build(index, f"route:{method} {target}", rng, method, target, body, headers)
        target = rng.choice(
            (
                "/v1/chat", "/v2/completions", path + "/", path.upper(), "/", "//v1/completions", "/v1/models/x",
                "/v1/../v1/completions", "/v1/%2e%2e/completions", "/%2e%2e/%2e%2e/etc/passwd", "/v1/messages/../x",
                "/v1/chat%2Fcompletions", "/v1/%6Dessages", path + ";jsessionid=1", path + "?x=1&stream=true",
                path + "?" + "a" * 8000, "/" + "a" * 10_000, "/health?verbose=1", "http://example.com" + path,
                "/v1/messages\u00e9".encode().decode("latin-1"), "/v1/chat/completions%00",
            )
        )  # fmt: skip
        kind = "route:bad_target" if not target.isascii() else "route:path"
        return self._build(index, kind, rng, "POST", target, body)

    def _wire_case(self, index: int, rng: random.Random, path: str, body: bytes) -> HttpCase:
        cut = rng.randint(1, 8)
        cases = {  # what: (headers, framing, body), or the whole request's bytes
            "chunked": ((), "chunked", body),
            "gzip_label": ((("content-encoding", rng.choice(("gzip", "br", "deflate, gzip"))),), "length", body),
            "gzip_body": ((("content-encoding", "gzip"),), "length", gzip.compress(body, mtime=0)),
            "expect_continue": ((("expect", "100-continue"),), "length", body),
            "no_length": ((), "none", b""),
            "keep_alive": ((("connection", "keep-alive"),), "length", body),
            "head_trickle": ((("x-big", "b" * rng.choice((20_000, 40_000))),), "length", body),  # 431, in pieces
            "body_trickle": ((), "length", body),
            "bad_length_short": ((), str(len(body) - cut), body),  # JSON cut short, then a stray "request"
            "bad_length_text": ((), rng.choice(("abc", "-1", "1e3", " 7", "0x10")), body),
            "bad_length_twice": ((("content-length", str(len(body) + 1)),), "length", body),
            "bad_length_and_chunked": ((("content-length", str(len(body))),), "chunked", body),
            "bad_chunked": ((("transfer-encoding", "chunked"),), "none", b"zz\r\n" + body + b"\r\n0\r\n\r\n"),
            "bad_header_line": ((("x-fold", "a\r\n b"), ("bad name", "x"), ("x-nul", b"a\x00b"), ("x-del", "\x7f")),
                                "length", body),
            "bad_lowercase": b"post " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
            "bad_garbage": rng.randbytes(rng.choice((1, 16, 300))) + b"\r\n\r\n",
            "bad_http2": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        }  # fmt: skip
        if rng.random() < 0.03:  # rare: each holds its connection for the whole body timeout
            cases = {"length_over": ((), str(len(body) + 100), body), "chunked_unfinished": ((), "none", b"")}
        what = rng.choice(sorted(cases))
        if isinstance(cases[what], bytes):  # not HTTP/1.1 at all
            return HttpCase(index, f"wire:{what}", cases[what], "POST", path, path == "/v1/messages", unparsable=True)
        headers, framing, raw_body = cases[what]
        if what == "chunked_unfinished":
            headers, raw_body = (("transfer-encoding", "chunked"),), b"5\r\nhello\r\n"
        case = self._build(index, f"wire:{what}", rng, "POST", path, raw_body, headers, framing)
        head, end = case.raw.find(b"\r\n\r\n") + 4, len(case.raw)
        pieces = {"head_trickle": range(512, head, 2048), "body_trickle": range(head, end, max(1, (end - head) // 4))}
        return replace(case, pieces=tuple(pieces.get(what, ())))


def _some(rng: random.Random, body: dict, *options: tuple[float, dict]) -> dict:
    """The body with each option's fields added, with that option's probability."""
    for p, fields in options:
        if rng.random() < p:
            body |= fields
    return body


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _line(name: str, value: str | bytes) -> bytes:
    return name.encode("latin-1") + b": " + (value if isinstance(value, bytes) else value.encode()) + b"\r\n"


def _chunked(rng: random.Random, body: bytes) -> bytes:
    out, at = [], 0
    while at < len(body):
        n = min(rng.randint(1, max(1, len(body) // 3)), len(body) - at)
        ext = b";x=y" if rng.random() < 0.2 else b""
        out.append(f"{n:x}".encode() + ext + b"\r\n" + body[at : at + n] + b"\r\n")
        at += n
    return b"".join(out) + b"0\r\n\r\n"
