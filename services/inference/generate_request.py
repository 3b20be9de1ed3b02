"""The Generate request at the boundary: protobuf in, a validated `GenerateSpec` out (servicer.py calls it). Sizes
are bounded before anything costs; every violation is collected and refused at once, naming its field, through
services/errors.py."""

from __future__ import annotations

import math
import re
import secrets
import uuid
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol

import grpc
from tokenizers import Tokenizer
from zeroqueue.inference.v1 import inference_pb2 as pb

from billing.errors import InvalidRecord
from billing.records import MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS, Door, RequestKind, freeze_labels
from services import errors
from services.errors import FieldViolation, clip

from .call import GenerateSpec
from .card import ModelCard
from .chat import ChatMessage, TemplateError
from .grammar import Constraint, ConstraintKind, GrammarError, GrammarLimits
from .sched.request import SamplingParams

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_ATTEMPT = re.compile(r"[0-9]{1,6}")
MAX_CLASS_CHARS = 32  # a class of service's name, as the ledger holds it
_CLASS = re.compile(r"[a-z0-9_\-]{1,32}")
_ATTEMPT_HEADERS = ("x-retry-attempt", "grpc-previous-rpc-attempts", "x-stainless-retry-count")
_TOKEN_ID_BYTES = 8  # a token id on the wire: a varint of at most 5 bytes, and a tag when not packed
_SMALL_FIELDS_BYTES = 64 << 10  # every other field of a valid request together (stop strings, labels, ids: ~12 KiB)
_MESSAGE_BYTES = 96  # a chat message's own bytes beside its content: tags, lengths, its role, a name
_ROLES = {
    pb.CHAT_ROLE_SYSTEM: "system",
    pb.CHAT_ROLE_USER: "user",
    pb.CHAT_ROLE_ASSISTANT: "assistant",
    pb.CHAT_ROLE_TOOL: "tool",
}
_FORMATS = {  # the response_format oneof's field -> its constraint's kind
    "json_object": ConstraintKind.JSON_OBJECT,
    "json_schema": ConstraintKind.JSON_SCHEMA,
    "regex": ConstraintKind.REGEX,
    "lark_grammar": ConstraintKind.LARK_GRAMMAR,
}
_KINDS = {  # (chat, constrained) -> the kind the usage record bills
    (False, False): RequestKind.PLAIN,
    (True, False): RequestKind.CHAT,
    (False, True): RequestKind.CONSTRAINED,
    (True, True): RequestKind.CHAT_CONSTRAINED,
}


class Preparer(Protocol):
    """What turns a valid request's parts into what the engine runs (the servicer, with the model's tokenizer, chat
    template and grammar tokenizer): each is off the event loop when large."""

    @property
    def has_chat_template(self) -> bool: ...

    @property
    def chat_stop_token_ids(self) -> frozenset[int]:
        """The tokens that end the template's assistant turn: they end a chat call (and are not streamed)."""
        ...

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]: ...

    async def render(self, messages: list[ChatMessage]) -> str:
        """The conversation as the template renders it, with the generation prompt; TemplateError if it refuses."""
        ...

    async def constraint(self, kind: ConstraintKind, source: str) -> Constraint:
        """The response_format's constraint; GrammarError when its text is not what its kind says."""
        ...


@dataclass(frozen=True)
class RequestLimits:
    """What one Generate request may hold. Sizes are checked before anything costs: the request's bytes before
    it is parsed (`max_request_bytes`), then the prompt's bytes and token count before it is tokenized or copied."""

    max_prompt_bytes: int = 1 << 20  # whatever the context
    max_bytes_per_token: int = 32  # a text prompt over context × this many bytes cannot fit the context
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    max_messages: int = 256
    max_name_chars: int = 64  # a chat message's name
    max_format_bytes: int = GrammarLimits.max_source_bytes  # a response_format's schema, regex or grammar
    max_top_logprobs: int = 20
    inline_tokenize_chars: int = 1024  # longer prompts are tokenized on a worker thread (~1 ms/KiB)
    tokenize_threads: int = 2
    min_temperature: float = 1e-4  # a temperature in (0, this) samples as greedy, its limit

    def prompt_bytes(self, context_length: int) -> int:
        return min(self.max_prompt_bytes, context_length * self.max_bytes_per_token)

    def max_request_bytes(self, context_length: int) -> int:
        """No valid GenerateRequest is larger: a full prompt, a conversation or a context of token ids, a
        response_format, and the small fields."""
        conversation = self.prompt_bytes(context_length) + self.max_messages * (_MESSAGE_BYTES + self.max_name_chars)
        prompt = max(conversation, context_length * _TOKEN_ID_BYTES)
        return prompt + self.max_format_bytes + _SMALL_FIELDS_BYTES


class _Violations:
    def __init__(self) -> None:
        self.items: list[FieldViolation] = []
        self.out_of_range = False

    def add(self, field: str, description: str, out_of_range: bool = False) -> None:
        self.items.append(FieldViolation(field, description))
        self.out_of_range = self.out_of_range or out_of_range

    def raise_if_any(self) -> None:
        if self.items:
            # OUT_OF_RANGE only when every problem is a size that exceeds a limit the caller could fit
            code = grpc.StatusCode.OUT_OF_RANGE if self.out_of_range and len(self.items) == 1 else None
            raise errors.InvalidArgument(self.items, code)


def _retry_attempt(metadata: tuple, v: _Violations) -> int:
    """Retry number from our SDK's x-retry-attempt, or from gRPC's own retry policy: at most 6 digits (a
    longer number is no retry count, and Python refuses to convert one of 4,300 digits)."""
    attempt = 0
    for key, value in metadata or ():
        if key not in _ATTEMPT_HEADERS:
            continue
        if isinstance(value, str) and _ATTEMPT.fullmatch(value):
            attempt = max(attempt, int(value))
        else:
            shown = clip(value if isinstance(value, str) else repr(value))
            v.add(key, f"must be a retry count of 1 to 6 digits 0-9, got {shown!r} ({len(value)} characters)")
    return attempt


def _service_class(msg: pb.GenerateRequest, v: _Violations) -> str:
    """The class the request names, if any: its size first, then its characters. Whether the replica offers it
    and whether it accepts the call's budget is the servicer's to say (policy/gate.py), once the budget
    is known."""
    name = msg.service_class
    if len(name) > MAX_CLASS_CHARS:
        v.add("service_class", f"at most {MAX_CLASS_CHARS} characters, got {len(name)}")
        return ""
    if name and not _CLASS.fullmatch(name):
        v.add("service_class", f"a class's name is characters from a-z 0-9 _ -, got {clip(name)!r}")
        return ""
    return name


def _sampling(msg: pb.GenerateRequest, v: _Violations, limits: RequestLimits) -> SamplingParams:
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        v.add("temperature", f"must be a finite number >= 0, got {temperature}")
    elif temperature < limits.min_temperature:
        # the limit of sampling as the temperature goes to 0 is greedy; dividing logits by a denormal is inf
        temperature = 0.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        v.add("top_p", f"must be in (0, 1], got {top_p}")
    if msg.top_k < 0:
        v.add("top_k", f"must be >= 0 (0 disables top-k), got {msg.top_k}")
    stop = msg.stop
    if len(stop) > limits.max_stop_strings:
        v.add("stop", f"at most {limits.max_stop_strings} stop strings, got {len(stop)}")
        stop = ()
    for i, s in enumerate(stop):
        if not s or len(s) > limits.max_stop_chars:
            v.add(f"stop[{i}]", f"must be 1 to {limits.max_stop_chars} characters, got {len(s)}")
    if not 0 <= msg.top_logprobs <= limits.max_top_logprobs:
        v.add("top_logprobs", f"must be 0 to {limits.max_top_logprobs}, got {msg.top_logprobs}")
    elif msg.top_logprobs and not msg.logprobs:
        v.add("top_logprobs", "needs logprobs: true")
    seed = msg.seed if msg.HasField("seed") else secrets.randbits(63)
    return SamplingParams(
        max_tokens=max(msg.max_tokens, 1),
        temperature=temperature,
        top_p=top_p,
        top_k=max(msg.top_k, 0),
        seed=seed,
        stop=tuple(stop),
        logprobs=msg.logprobs,
        top_logprobs=max(msg.top_logprobs, 0) if msg.logprobs else 0,
    )


def _labels(msg: pb.GenerateRequest, v: _Violations) -> MappingProxyType:
    """The ledger's own label rules, checked at arrival so a usage record can never be refused later: sizes
    first, then each label on its own, so that every bad one is named (and echoed short)."""
    if len(msg.labels) > MAX_LABELS:
        v.add("labels", f"at most {MAX_LABELS} labels, got {len(msg.labels)}")
        return MappingProxyType({})
    labels, bad = dict(msg.labels), False
    for key, value in sorted(labels.items()):
        field = f"labels.{clip(key)}"
        if len(key) > MAX_LABEL_KEY_CHARS:
            v.add(field, f"a key is at most {MAX_LABEL_KEY_CHARS} characters, got {len(key)}")
        elif len(value) > MAX_LABEL_VALUE_CHARS:
            v.add(field, f"a value is at most {MAX_LABEL_VALUE_CHARS} characters, got {len(value)}")
        else:
            try:
                freeze_labels({key: value})
                continue
            except InvalidRecord as exc:
                v.add(field, clip(exc.message, 256))
        bad = True
    return MappingProxyType({}) if bad else freeze_labels(labels)


def _messages(
    msg: pb.GenerateRequest, card: ModelCard, v: _Violations, limits: RequestLimits, has_template: bool
) -> list[ChatMessage] | None:
    """The conversation to render; None when it is wrong. Sizes first: the number of messages, then their bytes
    together against the prompt's bound, then each message's role and name."""
    if not has_template:
        v.add("messages", f"model {card.name!r} has no chat template (ListModels: has_chat_template); send a prompt")
        return None
    if len(msg.messages) > limits.max_messages:
        v.add("messages", f"at most {limits.max_messages} messages, got {len(msg.messages)}", out_of_range=True)
        return None
    cap = limits.prompt_bytes(card.context_length)
    size = sum(len(m.content.encode()) for m in msg.messages)
    if size > cap:
        v.add("messages", f"{size} bytes of content; at most {cap} for a context of {card.context_length} tokens", True)
        return None
    messages, ok = [], True
    for i, m in enumerate(msg.messages):
        role = _ROLES.get(m.role)
        if role is None:
            v.add(f"messages[{i}].role", f"must be one of {', '.join(_ROLES.values())} (got {m.role})")
            ok = False
        if len(m.name) > limits.max_name_chars:
            v.add(f"messages[{i}].name", f"at most {limits.max_name_chars} characters, got {len(m.name)}")
            ok = False
        elif ok:
            messages.append(ChatMessage(role, m.content, m.name))
    return messages if ok else None


def _response_format(msg: pb.GenerateRequest, v: _Violations, limits: RequestLimits) -> tuple[str, str] | None:
    """(the response_format's field, its text), or None when there is none or it is wrong (its size first)."""
    if not msg.HasField("response_format"):
        return None
    field = msg.response_format.WhichOneof("format")
    if field is None:
        v.add("response_format", f"set one of {', '.join(_FORMATS)}")
        return None
    source = "" if field == "json_object" else getattr(msg.response_format, field)
    size = len(source.encode())
    if size > limits.max_format_bytes:
        v.add(f"response_format.{field}", f"{size} bytes; at most {limits.max_format_bytes}", out_of_range=True)
        return None
    return field, source


def _prompt(
    msg: pb.GenerateRequest, card: ModelCard, v: _Violations, limits: RequestLimits
) -> tuple[int, ...] | str | None:
    """The prompt's token ids, or its text to tokenize; None when it is wrong. Sizes come first: the number of
    ids before they are copied or scanned, the text's bytes before it is tokenized."""
    context, num_ids, text = card.context_length, len(msg.prompt_token_ids), msg.prompt
    if text and num_ids:
        v.add("prompt_token_ids", "set prompt or prompt_token_ids, not both")
        return None
    if num_ids:
        if num_ids >= context:
            v.add(
                "prompt_token_ids",
                f"{num_ids} tokens; the context holds {context}, so at most {context - 1}",
                out_of_range=True,
            )
            return None
        tokens = tuple(msg.prompt_token_ids)
        if min(tokens) < 0 or max(tokens) >= card.vocab_size:
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < card.vocab_size)
            v.add(
                f"prompt_token_ids[{bad}]", f"token id {tokens[bad]} is outside the vocabulary [0, {card.vocab_size})"
            )
            return None
        return tokens
    if not text:
        v.add("prompt", "must not be empty (set prompt, prompt_token_ids or messages)")
        return None
    cap = limits.prompt_bytes(context)
    size = len(text.encode())  # at most the request's size, which is bounded before parsing
    if size > cap:
        v.add(
            "prompt",
            f"{size} bytes; at most {cap} for a context of {context} tokens (a text of longer tokens "
            f"fits as prompt_token_ids)",
            out_of_range=True,
        )
        return None
    return text


def _check_length(tokens: tuple[int, ...], field: str, max_tokens: int, context: int, v: _Violations) -> None:
    if not tokens:
        v.add(field, "must not be empty (set prompt or prompt_token_ids)")
    elif len(tokens) >= context:
        v.add(field, f"{len(tokens)} tokens; the context holds {context}, so at most {context - 1}", out_of_range=True)
    elif len(tokens) + max_tokens > context:
        v.add(
            "max_tokens",
            f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the context length {context}",
            out_of_range=True,
        )


async def to_spec(
    msg: pb.GenerateRequest,
    card: ModelCard,
    limits: RequestLimits,
    metadata: tuple,
    prepare: Preparer,
    door: Door = Door.GRPC,
) -> GenerateSpec:
    """Validates a GenerateRequest. Every field first, by cheap checks that bound sizes before anything costs,
    all problems found reported together, each naming its field; only a request with none is prepared (its
    constraint made, its conversation rendered, its prompt tokenized: each off the loop when large), and then
    its length checked against the context."""
    v = _Violations()
    if msg.model and msg.model != card.name:
        v.add("model", f"unknown model {clip(msg.model)!r}; this server serves {card.name!r}")
    if msg.request_id and not _REQUEST_ID.match(msg.request_id):
        v.add("request_id", "1 to 128 characters from A-Z a-z 0-9 . _ : -")
    chat, prompt = None, None
    if msg.messages and (msg.prompt or msg.prompt_token_ids):
        v.add("messages", "set one of prompt, prompt_token_ids and messages")
    elif msg.messages:
        chat = _messages(msg, card, v, limits, prepare.has_chat_template)
    else:
        prompt = _prompt(msg, card, v, limits)
    response_format = _response_format(msg, v, limits)
    if msg.max_tokens <= 0:
        v.add("max_tokens", f"must be >= 1, got {msg.max_tokens}")
    elif msg.max_tokens >= card.context_length:
        v.add(
            "max_tokens",
            f"{msg.max_tokens} does not fit the context length {card.context_length} beside a prompt",
            out_of_range=True,
        )
    sampling = _sampling(msg, v, limits)
    labels = _labels(msg, v)
    attempt = _retry_attempt(metadata, v)
    service_class = _service_class(msg, v)
    v.raise_if_any()
    constraint = await _constraint(response_format, prepare, v) if response_format else None
    if chat is not None:
        field, tokens = "messages", await _render(chat, prepare, v)
    else:
        field = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        tokens = await prepare.tokenize(prompt) if isinstance(prompt, str) else prompt
    _check_length(tokens, field, msg.max_tokens, card.context_length, v)
    v.raise_if_any()
    if constraint is not None:
        sampling = replace(sampling, constraint=constraint)
    if chat is not None:
        sampling = replace(sampling, stop_token_ids=sampling.stop_token_ids | prepare.chat_stop_token_ids)
    return GenerateSpec(
        msg.request_id or uuid.uuid4().hex,
        tokens,
        sampling,
        labels,
        attempt,
        service_class,
        _KINDS[chat is not None, constraint is not None],
        door,
    )


async def _constraint(response_format: tuple[str, str], prepare: Preparer, v: _Violations) -> Constraint | None:
    field, source = response_format
    try:
        return await prepare.constraint(_FORMATS[field], source)
    except GrammarError as exc:
        v.add(f"response_format.{field}", clip(str(exc), 300))
        return None


async def _render(chat: list[ChatMessage], prepare: Preparer, v: _Violations) -> tuple[int, ...]:
    """The conversation's tokens: rendered by the template, tokenized without the tokenizer's own special tokens
    (a template writes those it wants, as transformers' apply_chat_template leaves them out)."""
    try:
        text = await prepare.render(chat)
    except TemplateError as exc:
        v.add("messages", str(exc))
        return ()
    return await prepare.tokenize(text, add_special_tokens=False)


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
    # encode_batch lets go of the GIL while it runs (encode does not): the event loop goes on meanwhile
    return tuple(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
