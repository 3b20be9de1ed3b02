"""What kinds of call a pulse sends: request templates, drawn by weight for each planned call.

Without any, every call is plain: random token ids of the --shape's lengths, as pulse always sent. With
`--templates plain=2,chat=1,json=1` (the built-ins below) or `--request-file FILE` (JSON Lines, one template a line;
both may be given), each call draws its template by weight from a generator of its own (seeded by --seed), so the
same seed plans the same calls and the plain calls of a mixed run are those of a plain run at the same indices.

A request file's line, every field optional:
    {"messages": [{"role": "user", "content": "..."}], "prompt": "...", "response_format": {"type": "json_object"},
     "max_tokens": 48, "logprobs": true, "top_logprobs": 2, "temperature": 0.8, "deadline_ms": 3000, "weight": 2}
No prompt and no messages: the --shape's random token ids. No max_tokens: the --shape's. The messages and the
response_format are the SDK's (Client.generate's docstring), checked by it as the file is read.

A template's kind, what the report splits by: plain, chat (messages), constrained (a response_format) or
chat_constrained (both).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from services.client.request import Message, build_request, message_from

KINDS = ("plain", "chat", "constrained", "chat_constrained")
FIELDS = (
    "messages",
    "prompt",
    "response_format",
    "max_tokens",
    "logprobs",
    "top_logprobs",
    "temperature",
    "deadline_ms",
    "weight",
)


@dataclass(frozen=True, eq=False)
class RequestTemplate:
    """One kind of call. `prompt` "" and no `messages`: the shape's random token ids. `max_tokens` None: the shape's;
    `deadline_ms` None: the run's --deadline-ms."""

    name: str  # the built-in's name, or "<file>:<line>"
    weight: float = 1.0
    prompt: str = ""
    messages: tuple[Message, ...] = ()
    response_format: Mapping[str, object] | None = None  # as Client.generate takes it
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    temperature: float = 0.0  # pulse's calls are greedy unless a template says otherwise
    deadline_ms: float | None = None

    @property
    def kind(self) -> str:
        if self.messages:
            return "chat_constrained" if self.response_format is not None else "chat"
        return "constrained" if self.response_format is not None else "plain"

    @property
    def uses_token_ids(self) -> bool:
        """Sends the shape's random token ids as its prompt."""
        return not self.prompt and not self.messages

    def call(self, prompt_token_ids: Sequence[int]) -> dict[str, object]:
        """Client.generate's arguments for this template's prompt, format and sampling."""
        prompt: object = prompt_token_ids if self.uses_token_ids else (self.prompt or None)
        return {
            "prompt": prompt,
            "messages": list(self.messages) if self.messages else None,
            "response_format": self.response_format,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "temperature": self.temperature,
        }

    def describe(self) -> dict[str, object]:
        """For pulse.json: what was sent, less the conversation's text."""
        return {
            "name": self.name,
            "kind": self.kind,
            "weight": self.weight,
            "num_messages": len(self.messages),
            "response_format": self.response_format,
            "max_tokens": self.max_tokens,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "temperature": self.temperature,
            "deadline_ms": self.deadline_ms,
        }


# For the bundled Python-code model (its chat template renders a conversation as a Python file): what a tool asking
# it for code would send. The schema and the regex are small: a replica compiles each once (then it is cached), in
# about a millisecond, so the run measures serving them, not compiling them.
_CHAT = (
    Message("system", "Small helpers for command-line tools."),
    Message("user", "Write a function that parses --name=value arguments into a dict."),
)
_FUNCTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,23}$"},
        "args": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,11}$"}, "maxItems": 3},
        "returns": {"enum": ["None", "int", "str", "bool", "list", "dict"]},
    },
    "required": ["name", "args", "returns"],
    "additionalProperties": False,
}
BUILT_INS = {
    "plain": RequestTemplate("plain"),
    "chat": RequestTemplate("chat", messages=_CHAT),
    "json": RequestTemplate("json", response_format={"type": "json_schema", "schema": _FUNCTION_SCHEMA}),
    "regex": RequestTemplate(
        "regex", response_format={"type": "regex", "regex": r"def [a-z_]{1,16}\(([a-z_]{1,8}(, [a-z_]{1,8}){0,2})?\):"}
    ),
    "chat_json": RequestTemplate(
        "chat_json", messages=_CHAT, response_format={"type": "json_schema", "schema": _FUNCTION_SCHEMA}
    ),
}


def _weight(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"weight must be a number > 0, got {value!r}")
    return float(value)


def parse_templates(text: str) -> tuple[RequestTemplate, ...]:
    """`--templates plain=2,chat=1,json=1`: built-ins by name, each with its weight (default 1)."""
    out = []
    for part in text.split(","):
        name, sep, weight = part.strip().partition("=")
        if name not in BUILT_INS:
            raise argparse.ArgumentTypeError(f"{name!r}: no such template (built-ins: {', '.join(BUILT_INS)})")
        if any(t.name == name for t in out):
            raise argparse.ArgumentTypeError(f"{name}: given twice")
        try:
            w = _weight(float(weight) if sep else 1.0)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{name}: {error}") from None
        out.append(replace(BUILT_INS[name], weight=w))
    return tuple(out)


def template_from(doc: object, where: str) -> RequestTemplate:
    """One request file line's template; ValueError naming `where` and the field at fault."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if "prompt" in doc and "messages" in doc:
        raise ValueError(f"{where}: give prompt or messages, not both")
    try:
        messages = doc.get("messages", [])
        if not isinstance(messages, list) or ("messages" in doc and not messages):
            raise ValueError("messages must be a non-empty list")
        template = RequestTemplate(
            name=where,
            weight=_weight(doc.get("weight", 1)),
            prompt=_typed(doc, "prompt", str, ""),
            messages=tuple(message_from(m, i) for i, m in enumerate(messages)),
            response_format=doc.get("response_format"),
            max_tokens=_typed(doc, "max_tokens", int, None),
            logprobs=_typed(doc, "logprobs", bool, False),
            top_logprobs=_typed(doc, "top_logprobs", int, 0),
            temperature=float(_typed(doc, "temperature", int | float, 0.0)),
            deadline_ms=_typed(doc, "deadline_ms", int | float, None),
        )
        if "prompt" in doc and not template.prompt:
            raise ValueError("prompt must not be empty (leave it out for the shape's token ids)")
        if template.max_tokens is not None and template.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if template.deadline_ms is not None and not template.deadline_ms > 0:
            raise ValueError("deadline_ms must be > 0")
        build_request(max_tokens=1, **template.call((16,)))  # the SDK's own checks, now rather than at the first call
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return template


def _typed(doc: Mapping[str, object], field: str, kind, default):
    value = doc.get(field, default)
    if value is default:
        return value
    if (kind is not bool and isinstance(value, bool)) or not isinstance(value, kind):
        raise ValueError(f"{field} has the wrong type: {value!r}")
    return value


def read_request_file(path: str) -> tuple[RequestTemplate, ...]:
    """`--request-file FILE`: one template per non-blank line (JSON Lines); errors name the line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{path}: {error.strerror}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            out.append(template_from(json.loads(line), where))
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"{where}: not JSON: {error.msg}") from None
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    if not out:
        raise argparse.ArgumentTypeError(f"{path}: no templates in it")
    return tuple(out)


class TemplateDraw:
    """Each planned call's template, drawn by weight from a generator seeded by the run's seed alone (not the
    schedule's generator, which then draws the same arrivals and token ids as a run without templates)."""

    def __init__(self, templates: Sequence[RequestTemplate], seed: int) -> None:
        self.templates = list(templates)
        self.weights = [t.weight for t in self.templates]
        self.rng = random.Random(f"pulse-templates-{seed}")

    def next(self) -> RequestTemplate:
        return self.rng.choices(self.templates, self.weights)[0]


def kind_of(template: RequestTemplate | None) -> str:
    return "plain" if template is None else template.kind


def templates_of(args: argparse.Namespace) -> tuple[RequestTemplate, ...]:
    """The templates `zeroqueue pulse`'s --templates and --request-file name, in that order; () for plain calls."""
    return (*(getattr(args, "templates", None) or ()), *(getattr(args, "request_file", None) or ()))


def check_served(templates: Sequence[RequestTemplate], model) -> None:
    """ValueError when the model (the SDK's ModelInfo) cannot serve a template: better said once, before the run,
    than by every call of that kind refused INVALID_ARGUMENT."""
    for t in templates:
        if t.messages and not model.has_chat_template:
            raise ValueError(f"template {t.name}: model {model.name!r} has no chat template, so no messages")
        kind = t.response_format.get("type") if t.response_format is not None else None
        if kind is not None and kind not in model.response_formats:
            served = ", ".join(model.response_formats) or "none"
            raise ValueError(f"template {t.name}: model {model.name!r} serves no {kind} response_format ({served})")


def describe_mix(templates: Sequence[RequestTemplate]) -> str:
    """For a table's title: ', templates plain 2, chat 1' ('' without templates)."""
    return ", templates " + ", ".join(f"{t.name} {t.weight:g}" for t in templates) if templates else ""
