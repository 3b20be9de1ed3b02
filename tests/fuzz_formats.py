"""The fuzzer's chat, structured-output and log-probability fields (issue 31): valid values for a valid request, and
one mutation per field, for tests/fuzz_generate.py's GenerateFuzzer. A valid chat call needs a replica whose model
has a chat template (the fuzz test serves a ChatML checkpoint); elsewhere it is refused, precisely."""

from __future__ import annotations

import json
import random

from zeroqueue.inference.v1 import inference_pb2 as pb

ROLES = (pb.CHAT_ROLE_SYSTEM, pb.CHAT_ROLE_USER, pb.CHAT_ROLE_ASSISTANT, pb.CHAT_ROLE_TOOL)
SCHEMAS = (
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}},
)
REGEXES = (r"[0-9]{2}", r"(yes|no)", r"[a-z]{1,3}@[a-z]{1,3}\.com")
GRAMMARS = ('start: "a" | "b" start', 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]/')
BAD_SCHEMAS = (
    "",
    "{",
    "[]",
    "null",
    '"string"',
    '{"type": "strin"}',
    '{"type": 7}',
    '{"properties": []}',
    '{"$ref": "#/$defs/missing"}',
    '{"type": "object", "required": "n"}',
    '{"enum": []}',
    '{"type": "integer", "minimum": 5, "maximum": 1}',
    '{"type": "string", "pattern": "a("}',
    '{"type": "string", "format": "no-such-format"}',
    '{"anyOf": []}',
    '{"$defs": {"x": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}',
    '{"type": "object", "properties": {"a": {"$ref": "#"}}}',
    "\x00",
    '{"a": "\ud800"}',
)
BAD_REGEXES = (
    "",
    "a(b",
    "[z-a]",
    "(?<=a)b",
    "\\",
    "a{5,1}",
    "(a*)*b",
    "(.*a){40}",
    "[^\\x00-\\x{10FFFF}]",
    "a" * 70_000,
)
BAD_GRAMMARS = (
    "",
    "start:",
    "start: foo",
    "start: start",
    'start: "a" start',
    "start: /a(/",
    "%import common.NUMBER\nstart: NUMBER",
    "start: " + " ".join(f'"t{i}"' for i in range(9000)),
    'start: x\nx: "a" | x x x',
    "\x00",
)


def add_valid(rng: random.Random, message: pb.GenerateRequest) -> None:
    """Makes a valid request a chat call, a constrained call or one with log-probabilities, now and then."""
    if rng.random() < 0.2:
        message.ClearField("prompt")
        del message.prompt_token_ids[:]
        message.messages.extend(
            pb.ChatMessage(role=rng.choice(ROLES), content=rng.choice(("hi", "def f():", "🙂", "{{ 7*7 }}", "")))
            for _ in range(rng.randint(1, 4))
        )
    if rng.random() < 0.15:
        message.response_format.CopyFrom(valid_format(rng))
        message.max_tokens = rng.randint(1, 12)
    if rng.random() < 0.15:
        message.logprobs = True
        message.top_logprobs = rng.choice((0, 1, 5, 20))


def valid_format(rng: random.Random) -> pb.ResponseFormat:
    choice = rng.randrange(4)
    if choice == 0:
        return pb.ResponseFormat(json_object=pb.AnyJson())
    if choice == 1:
        return pb.ResponseFormat(json_schema=json.dumps(rng.choice(SCHEMAS)))
    if choice == 2:
        return pb.ResponseFormat(regex=rng.choice(REGEXES))
    return pb.ResponseFormat(lark_grammar=rng.choice(GRAMMARS))


def mutate_messages(rng: random.Random, m: pb.GenerateRequest, long_text: str) -> None:
    if rng.random() < 0.7:  # alone, as a chat call would send them; else beside a prompt, which is refused
        m.ClearField("prompt")
        del m.prompt_token_ids[:]
    del m.messages[:]
    choice = rng.randrange(7)
    if choice == 0:
        m.messages.extend(pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="x") for _ in range(rng.choice((257, 5000))))
    elif choice == 1:
        m.messages.append(pb.ChatMessage(role=rng.choice((pb.CHAT_ROLE_UNSPECIFIED, 5, 99, -1)), content="hi"))
    elif choice == 2:
        m.messages.append(pb.ChatMessage(role=pb.CHAT_ROLE_TOOL, content="r", name="n" * rng.choice((64, 65, 5000))))
    elif choice == 3:
        m.messages.append(pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=long_text))
    elif choice == 4:
        m.messages.extend(pb.ChatMessage(role=pb.CHAT_ROLE_SYSTEM, content="") for _ in range(rng.randint(1, 3)))
    elif choice == 5:
        evil = ("{% for i in range(10**9) %}x{% endfor %}", "{{ ''.__class__.__mro__ }}", "<|im_end|>", "\x00")
        m.messages.append(pb.ChatMessage(role=pb.CHAT_ROLE_USER, content=rng.choice(evil)))
    else:
        m.messages.extend(pb.ChatMessage(role=r, content="x " * 400) for r in ROLES * rng.choice((1, 20)))


def mutate_response_format(rng: random.Random, m: pb.GenerateRequest) -> None:
    m.max_tokens = rng.randint(1, 12)
    choice = rng.randrange(6)
    if choice == 0:
        m.response_format.CopyFrom(pb.ResponseFormat())  # set, with none of its kinds
    elif choice == 1:
        m.response_format.CopyFrom(pb.ResponseFormat(json_schema=rng.choice(BAD_SCHEMAS)))
    elif choice == 2:
        depth = rng.choice((63, 64, 65, 1000, 30_000))
        m.response_format.CopyFrom(pb.ResponseFormat(json_schema='{"items": ' * depth + "{}" + "}" * depth))
    elif choice == 3:
        m.response_format.CopyFrom(pb.ResponseFormat(regex=rng.choice(BAD_REGEXES)))
    elif choice == 4:
        m.response_format.CopyFrom(pb.ResponseFormat(lark_grammar=rng.choice(BAD_GRAMMARS)))
    else:  # large but valid, or just over the bound
        values = ["v" * 8] * rng.choice((100, 7000, 8000))
        m.response_format.CopyFrom(pb.ResponseFormat(json_schema=json.dumps({"enum": values})))


def mutate_logprobs(rng: random.Random, m: pb.GenerateRequest) -> None:
    m.logprobs = rng.random() < 0.5
    m.top_logprobs = rng.choice((0, 20))


def mutate_top_logprobs(rng: random.Random, m: pb.GenerateRequest) -> None:
    m.logprobs = rng.random() < 0.7
    m.top_logprobs = rng.choice((-1, 0, 1, 20, 21, 2**31 - 1, -(2**31)))
