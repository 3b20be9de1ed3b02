"""The GenerateRequest a call sends, built once and resent unchanged by every retry: its prompt (text, token ids
or a conversation), sampling, the shape its output must take (response_format) and whether it wants logprobs.

Everything the server would refuse for its form alone (a role it has no name for, a response_format of no known
type, top_logprobs without logprobs) is refused here first, with a ValueError that names the argument: a call the
server could never take costs no round trip and no retry.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zeroqueue.inference.v1 import inference_pb2 as pb

ROLES = {
    "system": pb.CHAT_ROLE_SYSTEM,
    "user": pb.CHAT_ROLE_USER,
    "assistant": pb.CHAT_ROLE_ASSISTANT,
    "tool": pb.CHAT_ROLE_TOOL,
}
# a response_format's "type" -> the key that holds its text (json_object has none)
FORMAT_KEYS = {"json_object": None, "json_schema": "json_schema", "regex": "regex", "lark_grammar": "grammar"}
MAX_TOP_LOGPROBS = 20  # the server's bound (inference.proto)


@dataclass(frozen=True)
class Message:
    """One turn of a conversation. `name`: optional, e.g. the tool's name on a tool turn."""

    role: str  # system | user | assistant | tool
    content: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str) or not isinstance(self.name, str):
            raise ValueError("content and name must be strings")


def message_from(value: Message | Mapping[str, str], index: int = 0) -> Message:
    """A Message from a Message or an OpenAI-style dict {"role", "content", "name"?}; ValueError naming
    messages[index] when it is neither."""
    if isinstance(value, Message):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"messages[{index}]: a dict with role and content, or a Message; got {type(value).__name__}")
    unknown = set(value) - {"role", "content", "name"}
    if unknown or "role" not in value or "content" not in value:
        raise ValueError(f"messages[{index}]: needs role and content (and optionally name); got keys {sorted(value)}")
    try:
        return Message(value["role"], value["content"], value.get("name") or "")
    except ValueError as error:
        raise ValueError(f"messages[{index}]: {error}") from None


def _schema_text(schema: object) -> str:
    """A JSON Schema as the text the server compiles: a str as given, a dict serialised compactly in its own key
    order (which is the order a generated object's properties come in), so the same dict is the same text and finds
    the server's compiled grammar cached."""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, Mapping | bool):
        raise ValueError(f"response_format: a JSON Schema is a dict (or its JSON text), got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def response_format_pb(response_format: Mapping[str, object]) -> pb.ResponseFormat:
    """The protobuf of an OpenAI-style response_format:
    {"type": "json_object"}; {"type": "json_schema", "json_schema": {"schema": {...}, "name"?, "strict"?}} or
    {"type": "json_schema", "schema": {...}} (the schema a dict or JSON text); {"type": "regex", "regex": "..."};
    {"type": "lark_grammar", "grammar": "..."}."""
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format: a dict with a type, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in FORMAT_KEYS:
        raise ValueError(f"response_format: type must be one of {', '.join(FORMAT_KEYS)}, got {kind!r}")
    if kind == "json_object":
        _only(response_format, {"type"})
        return pb.ResponseFormat(json_object=pb.AnyJson())
    if kind == "json_schema":
        _only(response_format, {"type", "json_schema", "schema"})
        if ("json_schema" in response_format) == ("schema" in response_format):
            raise ValueError(
                'response_format: json_schema needs exactly one of "json_schema": {"schema": ...} and "schema"'
            )
        schema = response_format.get("schema")
        if "json_schema" in response_format:
            wrapper = response_format["json_schema"]
            if not isinstance(wrapper, Mapping) or "schema" not in wrapper:
                raise ValueError('response_format: "json_schema" is a dict holding the "schema"')
            schema = wrapper["schema"]
        return pb.ResponseFormat(json_schema=_schema_text(schema))
    key = FORMAT_KEYS[kind]
    _only(response_format, {"type", key})
    text = response_format.get(key)
    if not isinstance(text, str) or not text:
        raise ValueError(f"response_format: type {kind} needs a non-empty string {key!r}")
    return pb.ResponseFormat(**{kind: text})


def _only(response_format: Mapping[str, object], allowed: set[str]) -> None:
    unknown = set(response_format) - allowed
    if unknown:
        raise ValueError(
            f"response_format: type {response_format['type']} takes {sorted(allowed)}, not {sorted(unknown)}"
        )


def _prompt_fields(
    prompt: str | Sequence[int] | None, messages: Sequence[Message | Mapping[str, str]] | None
) -> dict[str, object]:
    """Exactly one of a prompt (text or token ids) and messages."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    if messages is not None:
        if isinstance(messages, str | Mapping) or not messages:
            raise ValueError("messages must be a non-empty list of messages")
        turns = [message_from(m, i) for i, m in enumerate(messages)]
        return {"messages": [pb.ChatMessage(role=ROLES[m.role], content=m.content, name=m.name) for m in turns]}
    if isinstance(prompt, str):
        return {"prompt": prompt}
    return {"prompt_token_ids": tuple(int(t) for t in prompt)}


def budget_ms(deadline_ms: float | None) -> float:
    """A call's whole budget, retries included: required, and > 0."""
    if deadline_ms is None:
        raise TypeError("generate() needs deadline_ms: the call's whole budget, retries included")
    if not deadline_ms > 0:
        raise ValueError(f"deadline_ms must be > 0, got {deadline_ms}")
    return deadline_ms


def build_request(
    prompt: str | Sequence[int] | None,
    max_tokens: int,
    *,
    messages: Sequence[Message | Mapping[str, str]] | None = None,
    response_format: Mapping[str, object] | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    model: str = "",
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    request_id: str | None = None,
    labels: Mapping[str, str] | None = None,
    service_class: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest; a prompt given as token ids goes in prompt_token_ids. The request_id is the
    caller's or a fresh one, and every attempt of the call carries the same one. `service_class`: the class of
    service to run in (ListModels lists them with their prices); "": the least privileged one the deadline fits."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs}")
    if top_logprobs and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    request = pb.GenerateRequest(
        **_prompt_fields(prompt, messages),
        model=model,
        max_tokens=max_tokens,
        top_k=top_k,
        stop=list(stop),
        request_id=request_id or uuid.uuid4().hex,
        labels=dict(labels or {}),
        service_class=service_class,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    if response_format is not None:
        request.response_format.CopyFrom(response_format_pb(response_format))
    if temperature is not None:
        request.temperature = temperature
    if top_p is not None:
        request.top_p = top_p
    if seed is not None:
        request.seed = seed
    return request
