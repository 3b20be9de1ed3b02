"""An HTTP call's body and headers as the gRPC door's own GenerateRequest, so that one validation
(generate_request.to_spec) and one admission decide both doors. Here only what is HTTP's: which header gives the
budget, the key, the labels and the class; which API field is which Generate field (and back, for the names a
refusal gives); and which fields this replica cannot honour, refused by name."""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from zeroqueue.inference.v1 import inference_pb2 as pb

from billing.models import MAX_CLASS_BUDGET_MS
from services import errors
from services.errors import FieldViolation, clip
from services.inference.call import BudgetSource

from .bodies import ChatCompletionBody, CompletionBody, MessagesBody, ResponseFormat

DEFAULT_MAX_TOKENS = 256  # a chat call that names no max_tokens (OpenAI's says "as many as fit": not a budget)
INT32_MAX = (1 << 31) - 1
MAX_LABELS_HEADER_CHARS = 4096
_MS = re.compile(r"[0-9]{1,9}")
_TIERS_ANY = frozenset({"auto", "default", "standard_only"})  # the APIs' own service tiers: no class named
_ROLES = {
    "system": pb.CHAT_ROLE_SYSTEM,
    "developer": pb.CHAT_ROLE_SYSTEM,
    "user": pb.CHAT_ROLE_USER,
    "assistant": pb.CHAT_ROLE_ASSISTANT,
    "tool": pb.CHAT_ROLE_TOOL,
}


Headers = Mapping[str, str]  # a request's headers by lower-case name (door.py reads each header once)


class Api(enum.StrEnum):
    CHAT = "chat.completions"  # OpenAI
    COMPLETIONS = "completions"  # OpenAI
    MESSAGES = "messages"  # Anthropic

    @property
    def anthropic(self) -> bool:
        return self is Api.MESSAGES


@dataclass
class Call:
    """One HTTP call, ready for the servicer's `admit`."""

    api: Api
    request: pb.GenerateRequest
    metadata: tuple[tuple[str, str], ...]  # what gRPC metadata would carry: the key, the attempt
    budget_s: float | None  # None: the server's default
    source: BudgetSource
    stream: bool
    include_usage: bool = False  # OpenAI streams: a last chunk with the usage
    renames: dict[str, str] = field(default_factory=dict)  # a Generate field's name -> the API's, for refusals
    message_offset: int = 0  # Anthropic: messages[i] of the API is messages[i + offset] of Generate

    def api_field(self, name: str) -> str:
        """A Generate field's name as this call's API names it (the longest renamed prefix wins)."""
        if self.message_offset and (m := re.match(r"messages\[(\d+)\](.*)", name)):
            i = int(m[1]) - self.message_offset
            return "system" if i < 0 else f"messages[{i}]{m[2]}"
        for prefix in sorted(self.renames, key=len, reverse=True):
            if name == prefix or name.startswith((prefix + ".", prefix + "[")):
                return self.renames[prefix] + name[len(prefix) :]
        return name


class _Found:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, name: str, description: str) -> None:
        self.items.append(FieldViolation(name, description))


def budget_of(headers: Headers, v: _Found) -> tuple[float | None, BudgetSource]:
    """The call's budget: an explicit X-Budget-Ms, else the official SDKs' own timeout (X-Stainless-Timeout, or the
    OpenAI SDK's X-Stainless-Read-Timeout; seconds), else Envoy's x-envoy-expected-rq-timeout-ms, else the server's
    default. A header the caller set is checked; an SDK's that is not a positive number is not a budget."""
    for name, source in (("x-budget-ms", BudgetSource.BUDGET_HEADER), ("x-envoy-expected-rq-timeout-ms", None)):
        value = headers.get(name)
        if value is None:
            continue
        if not (_MS.fullmatch(value) and 1 <= int(value) <= MAX_CLASS_BUDGET_MS):  # ASCII digits only: '¹²'.isdigit()
            v.add(name, f"must be a whole number of ms from 1 to {MAX_CLASS_BUDGET_MS}, got {clip(value)!r}")
            return None, BudgetSource.SERVER_DEFAULT
        if source is BudgetSource.BUDGET_HEADER:
            return int(value) / 1000, source
        envoy = int(value) / 1000
        break
    else:
        envoy = None
    for name in ("x-stainless-timeout", "x-stainless-read-timeout"):
        try:
            seconds = float(headers.get(name, "nan")[:32])
        except ValueError:
            continue
        if math.isfinite(seconds) and 0 < seconds <= MAX_CLASS_BUDGET_MS / 1000:
            return seconds, BudgetSource.SDK_TIMEOUT
    return (envoy, BudgetSource.ENVOY_TIMEOUT) if envoy is not None else (None, BudgetSource.SERVER_DEFAULT)


def key_metadata(headers: Headers) -> list[tuple[str, str]]:
    """The API key as gRPC metadata: `Authorization: Bearer` (OpenAI), else Anthropic's `x-api-key`."""
    if (auth := headers.get("authorization")) is not None:
        return [("authorization", auth)]
    if (key := headers.get("x-api-key")) is not None:
        return [("authorization", f"Bearer {key}")]
    return []


def _header_labels(headers: Headers, v: _Found) -> dict[str, str]:
    """X-Labels: `cost_center=cc-12, team=search` (the ledger's label rules are generate_request.py's)."""
    text = headers.get("x-labels")
    if text is None:
        return {}
    if len(text) > MAX_LABELS_HEADER_CHARS:
        v.add("x-labels", f"at most {MAX_LABELS_HEADER_CHARS} characters, got {len(text)}")
        return {}
    labels = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            v.add("x-labels", f"must be key=value pairs separated by commas, got {clip(item.strip())!r}")
            return {}
        labels[key.strip()] = value.strip()
    return labels


def _class(headers: Headers, tier: str | None, v: _Found, renames: dict[str, str]) -> str:
    named = headers.get("x-service-class")
    if tier is not None and tier not in _TIERS_ANY:
        if named is not None and named != tier:
            v.add("service_tier", f"names class {clip(tier)!r}, X-Service-Class {clip(named)!r}: name one")
        renames["service_class"] = "service_tier"
        return tier
    renames["service_class"] = "x-service-class"
    return named or ""


def _refuse_unsupported(body, v: _Found) -> None:
    """Fields this replica cannot honour: refused by name, never dropped."""
    if getattr(body, "n", None) not in (None, 1):
        v.add("n", "this replica makes one choice per call (n = 1)")
    if getattr(body, "best_of", None) not in (None, 1):
        v.add("best_of", "this replica makes one choice per call (best_of = 1)")
    if getattr(body, "tools", None):
        v.add("tools", "this replica runs no tools; describe the output with response_format instead")
    if getattr(body, "logit_bias", None):
        v.add("logit_bias", "not supported on this replica")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name, None) not in (None, 0, 0.0):
            v.add(name, "not supported on this replica (0 only)")
    if getattr(body, "echo", None):
        v.add("echo", "not supported on this replica")
    if getattr(body, "suffix", None):
        v.add("suffix", "not supported on this replica")
    if getattr(body, "min_p", None) not in (None, 0, 0.0):
        v.add("min_p", "not supported on this replica (0 only)")
    if getattr(body, "repetition_penalty", None) not in (None, 1, 1.0):
        v.add("repetition_penalty", "not supported on this replica (1 only)")
    for name in _GUIDED:
        if getattr(body, name, None) is not None:
            v.add(name, "describe the output with response_format (json_object or json_schema) instead")


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _int32(name: str, value: int | None, v: _Found, low: int = 0) -> int:
    if value is None:
        return 0
    if not low <= value <= INT32_MAX:
        v.add(name, f"must be {low} to {INT32_MAX}, got {value}")
        return 0
    return value


def _text(content) -> str:
    """A message's content: a text, or its text parts joined by newlines."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _common(body, request: pb.GenerateRequest, v: _Found) -> None:
    if body.temperature is not None:
        request.temperature = body.temperature
    if body.top_p is not None:
        request.top_p = body.top_p
    request.top_k = _int32("top_k", body.top_k, v, -INT32_MAX)
    seed = getattr(body, "seed", None)
    if seed is not None:
        if 0 <= seed < 1 << 64:
            request.seed = seed
        else:
            v.add("seed", f"must be 0 to 2^64-1, got {clip(str(seed))}")


def _chat(body: ChatCompletionBody, request: pb.GenerateRequest, v: _Found, renames: dict[str, str]) -> None:
    for i, m in enumerate(body.messages):
        if m.tool_calls:
            v.add(f"messages[{i}].tool_calls", "this replica runs no tools")
        request.messages.add(role=_ROLES[m.role], content=_text(m.content), name=m.name or "")
    given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    renames["max_tokens"] = given
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else _int32(given, max_tokens, v, -INT32_MAX)
    request.logprobs = bool(body.logprobs)
    request.top_logprobs = _int32("top_logprobs", body.top_logprobs, v)
    _response_format(body.response_format, request, v, renames)
    if body.metadata:
        request.labels.update(body.metadata)
        renames["labels"] = "metadata"


def _response_format(fmt: ResponseFormat | None, request: pb.GenerateRequest, v: _Found, renames: dict) -> None:
    """OpenAI's `response_format` (chat and completions): `json_object`, or `json_schema` with its schema."""
    if fmt is not None and fmt.type == "json_object":
        request.response_format.json_object.SetInParent()
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            v.add("response_format.json_schema.schema", "a json_schema response_format needs its schema")
        else:
            request.response_format.json_schema = json.dumps(fmt.json_schema.schema_, separators=(",", ":"))
            renames["response_format.json_schema"] = "response_format.json_schema.schema"


def _completion(body: CompletionBody, request: pb.GenerateRequest, v: _Found, renames: dict[str, str]) -> None:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt:
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t <= INT32_MAX), None)
        if bad is not None:
            v.add(f"prompt[{bad}]", f"token id {clip(str(prompt[bad]))} is outside the vocabulary")
        else:
            request.prompt_token_ids.extend(prompt)
    renames["prompt_token_ids"] = "prompt"
    request.max_tokens = _int32("max_tokens", body.max_tokens, v, -INT32_MAX) if body.max_tokens is not None else 16
    if body.logprobs is not None:
        request.logprobs = True
        request.top_logprobs = _int32("logprobs", body.logprobs, v)
        renames["top_logprobs"] = "logprobs"
    _response_format(body.response_format, request, v, renames)
    if body.metadata:
        request.labels.update(body.metadata)
        renames["labels"] = "metadata"


def _messages(body: MessagesBody, request: pb.GenerateRequest, v: _Found, renames: dict[str, str]) -> int:
    offset = 0
    if body.system is not None:
        request.messages.add(role=pb.CHAT_ROLE_SYSTEM, content=_text(body.system))
        offset = 1
    for m in body.messages:
        request.messages.add(role=_ROLES[m.role], content=_text(m.content))
    request.max_tokens = _int32("max_tokens", body.max_tokens, v, -INT32_MAX)
    request.stop.extend(body.stop_sequences or ())
    renames["stop"] = "stop_sequences"
    configured = body.output_config.format if body.output_config is not None else None
    if configured is not None and body.output_format is not None:
        v.add("output_format", "set output_config.format or output_format, not both")
    elif (fmt := configured or body.output_format) is not None:
        request.response_format.json_schema = json.dumps(fmt.schema_, separators=(",", ":"))
        named = "output_config.format.schema" if configured is not None else "output_format.schema"
        renames["response_format.json_schema"] = named
    if body.metadata is not None and body.metadata.user_id is not None:
        request.labels["user_id"] = body.metadata.user_id
        renames["labels"] = "metadata"
    return offset


def call_of(api: Api, body, headers: Headers) -> Call:
    """The Call an HTTP request makes; errors.InvalidArgument naming each field or header that is wrong."""
    v, renames = _Found(), {"request_id": "x-request-id"}
    budget_s, source = budget_of(headers, v)
    request = pb.GenerateRequest(model=body.model or "", request_id=headers.get("x-request-id", ""))
    _refuse_unsupported(body, v)
    _common(body, request, v)
    offset = 0
    if api is Api.CHAT:
        _chat(body, request, v, renames)
    elif api is Api.COMPLETIONS:
        _completion(body, request, v, renames)
    else:
        offset = _messages(body, request, v, renames)
    if api is not Api.MESSAGES and body.stop is not None:
        request.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if labels := _header_labels(headers, v):
        request.labels.update(labels)
        renames.setdefault("labels", "x-labels")
    request.service_class = _class(headers, body.service_tier, v, renames)
    if v.items:
        raise errors.InvalidArgument(v.items)
    metadata = key_metadata(headers)
    if (attempt := headers.get("x-stainless-retry-count")) is not None:
        metadata.append(("x-stainless-retry-count", attempt))
    include_usage = api is not Api.MESSAGES and body.stream_options is not None and body.stream_options.include_usage
    return Call(api, request, tuple(metadata), budget_s, source, body.stream, include_usage, renames, offset)
