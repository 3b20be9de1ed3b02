"""Chat: a conversation of messages rendered into one prompt by the checkpoint's own chat template, the way Hugging
Face tokenizers define templates (transformers' `apply_chat_template(..., tokenize=False)`), without transformers,
torch or protobuf.

A template is Jinja2 source that ships with the checkpoint (`chat_template.jinja`, or `chat_template` in
tokenizer_config.json). It is compiled once, in a sandbox with the environment transformers gives it, and rendered
per call from any thread. Everything a render can do wrong, and everything a template refuses, is one
`TemplateError` whose message a client may read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .device.checkpoint import CheckpointError, read_json

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer_config.json; wins over its `chat_template`, as in transformers
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# the named special tokens transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES), where the config has them
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_MAX_CHARS = 1 << 20  # as RequestLimits.max_prompt_bytes; a caller passes its context's own, smaller bound
MAX_ERROR_CHARS = 256  # what a TemplateError repeats of the template's own message
_MAX_POWER_BITS = 1 << 16  # an integer a template computes with `**`: no template needs a larger one
# an assistant message's content that no template rewrites, to find what a template writes after a turn
_PROBE = "Zq7ProbeTurn5Content"

# the render's bound on the chars it writes, read by the `*` and `**` checks inside the template (per thread)
_MAX_CHARS: ContextVar[int] = ContextVar("chat_max_chars", default=DEFAULT_MAX_CHARS)


class TemplateError(Exception):
    """The chat template refused the messages (its `raise_exception`), failed on them, or wrote too much. The message
    says which, in words a client may read (the caller names the field `messages`)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of ROLES
    content: str
    name: str = ""  # e.g. a tool's name; a template sees `name` only when it is not empty

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role[:32]!r}")

    def as_dict(self) -> dict[str, str]:
        """The message as a template sees it: transformers leaves out the keys a caller did not set."""
        if self.name:
            return {"role": self.role, "content": self.content, "name": self.name}
        return {"role": self.role, "content": self.content}


class ChatTemplate:
    """One checkpoint's chat template, compiled. `special_tokens` are the named special tokens (SPECIAL_TOKEN_NAMES
    to their text) the template is given, as transformers gives them from the tokenizer's config."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        unknown = set(self.special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(f"not special token names: {sorted(unknown)}")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: line {exc.lineno}: {exc.message}") from None
        self._end_of_turn = self._find_end_of_turn()

    @classmethod
    def from_dir(cls, model_dir: Path) -> ChatTemplate | None:
        """The template of a checkpoint directory, read as transformers reads it; None when it has none.
        CheckpointError names the file when a template is there but cannot be used."""
        config_path = Path(model_dir) / TOKENIZER_CONFIG_FILE
        config = read_json(config_path, required=False)
        template_path = Path(model_dir) / TEMPLATE_FILE
        if template_path.is_file():
            try:
                source = template_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(template_path, f"cannot read the chat template ({exc})") from None
        else:
            template_path = config_path
            source = _default_template(config_path, config.get("chat_template"))
            if source is None:
                return None
        try:
            return cls(source, _special_tokens(config))
        except ValueError as exc:
            raise CheckpointError(template_path, str(exc)) from None

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def render(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, max_chars: int = DEFAULT_MAX_CHARS
    ) -> str:
        """The prompt for `messages`, with the opening of the assistant's next turn when `add_generation_prompt`.
        TemplateError when the template refuses or fails, or writes more than `max_chars` characters (it stops
        there: a template that repeats content costs no more than the bound). No messages is an error, as in
        transformers."""
        if not messages:
            raise TemplateError("there are no messages to render")
        variables: dict[str, Any] = {
            "messages": [message.as_dict() for message in messages],
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        bound = _MAX_CHARS.set(max_chars)
        pieces: list[str] = []
        num_chars = 0
        try:
            for piece in self._template.generate(variables):
                num_chars += len(piece)
                if num_chars > max_chars:
                    raise TemplateError(_too_long(max_chars))
                pieces.append(piece)
        except TemplateError:
            raise
        except _Refused as exc:
            raise TemplateError(_clip(f"the chat template refused the messages: {exc.message}")) from None
        except Exception as exc:  # whatever the template's code raised: the sandbox's refusals, type errors, ...
            raise TemplateError(_clip(f"the chat template failed: {type(exc).__name__}: {exc}")) from None
        finally:
            _MAX_CHARS.reset(bound)
        return "".join(pieces)

    def end_of_turn(self) -> str:
        """What the template writes right after an assistant message's content, up to the end or the next
        whitespace: "<|im_end|>" for ChatML, "<|eot_id|>" for Llama 3; "" when it writes nothing there."""
        return self._end_of_turn

    def _find_end_of_turn(self) -> str:
        probe = [ChatMessage("user", "Hi"), ChatMessage("assistant", _PROBE)]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except TemplateError:  # a template that needs more than a user and an assistant turn tells us nothing
            return ""
        _, found, after = text.rpartition(_PROBE)
        words = after.split(maxsplit=1)
        return words[0] if found and words else ""


def stop_token_ids(template: ChatTemplate, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end an assistant's turn: the template's end of turn when it is exactly one added (special)
    token of `tokenizer`, and the tokenizer config's eos token when the tokenizer knows it."""
    added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    ids = set()
    if template.end_of_turn() in added:
        ids.add(added[template.end_of_turn()])
    eos = template.eos_token
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is not None:
        ids.add(eos_id)
    return frozenset(ids)


def _default_template(config_path: Path, value: Any) -> str | None:
    """tokenizer_config.json's `chat_template`: one template, or named ones of which transformers takes "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        value = {item.get("name"): item.get("template") for item in value}
    if not isinstance(value, dict):
        raise CheckpointError(config_path, "chat_template must be a string or a list of {name, template}")
    if "default" not in value:
        raise CheckpointError(config_path, f"no chat template named 'default' among {sorted(map(str, value))}")
    if not isinstance(value["default"], str):
        raise CheckpointError(config_path, "the 'default' chat template is not a string")
    return value["default"]


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens of a tokenizer config; each is its text, or an AddedToken's dict with "content"."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _too_long(max_chars: int) -> str:
    return f"the chat template wrote more than {max_chars} characters for these messages"


# The environment transformers renders templates in (transformers/utils/chat_template_utils.py): the immutable
# sandbox with trim_blocks, lstrip_blocks and loop controls; its `tojson`, `raise_exception`, `strftime_now`,
# `dict` and `namespace`; a `{% generation %}` block that renders its body.


class _Refused(jinja2.TemplateError):
    """What `raise_exception` raises: the template's own refusal, told apart from its failures."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks an assistant's tokens for training masks; rendering keeps
    its body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` whose attributes may not start with "_", so a template cannot reach Python's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named `self`: `namespace(self=...)` must work, as in Jinja
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name[:32]!r}")


class _Dicts:
    """`dict(...)` and `dict.fromkeys(...)` without handing the template the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` bounded: a repeated string or list may not outgrow the render's bound, so a
    template cannot build a huge value in one expression before the length check sees it."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        max_chars = _MAX_CHARS.get()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > max_chars:
                    raise TemplateError(_too_long(max_chars))
        elif isinstance(left, int) and isinstance(right, int) and right * abs(left).bit_length() > _MAX_POWER_BITS:
            raise TemplateError(_clip(f"the chat template raised {left} to too large a power ({right})"))
        return super().call_binop(context, operator, left, right)


def _environment() -> jinja2.Environment:
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dicts()
    env.globals["namespace"] = _Namespace
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False) -> str:
    # transformers' filter: plain json.dumps, no HTML escaping (Jinja's own escapes <, >, & and ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise _Refused(str(message))


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)
