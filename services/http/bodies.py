"""The request bodies of the three APIs the HTTP door serves, as their official references define them, validated
by pydantic (shapes and types; every count and length bounded here, before anything is tokenized). What a field
means for the call (ranges, the context, a schema's grammar) is generate_request.py's to say, for both doors.

Unknown fields are ignored, as the official servers ignore them: a newer SDK's optional field must not fail a call.
A known field this replica cannot honour (n > 1, tools, logit_bias, penalties, echo, suffix) is refused by name
(calls.py), never silently dropped."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from services import errors

MAX_MESSAGES = 256  # RequestLimits.max_messages: checked here first, before a message is validated
MAX_PARTS = 64  # content parts in one message
MAX_STOP = 8  # RequestLimits.max_stop_strings
MAX_TOKEN_IDS = 1 << 17  # a prompt of token ids (the context bounds it again)
MAX_METADATA = 16  # the ledger's MAX_LABELS

Number = float  # JSON's numbers, ints included
Text = StrictStr


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None  # refused when not empty: this replica runs no tools


class JsonSchemaFormat(_Body):
    name: Text = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _OpenAI(_Body):
    """The fields OpenAI's chat completions and completions share."""

    model: Text | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    metadata: Annotated[dict[str, Text], Field(max_length=MAX_METADATA)] | None = None
    service_tier: Text | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None  # completions too, as vLLM's and SGLang's servers take it
    # sampling fields of the open servers (vLLM, SGLang, llama.cpp), not OpenAI's: top_k is honoured, the others
    # are refused by name (calls.py), never dropped
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class ChatCompletionBody(_OpenAI):
    """POST /v1/chat/completions"""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None


TokenIds = Annotated[list[StrictInt], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
OneText = Annotated[list[Text], Field(min_length=1, max_length=1)]
OneTokenIds = Annotated[list[TokenIds], Field(min_length=1, max_length=1)]


class CompletionBody(_OpenAI):
    """POST /v1/completions: a prompt is a text or token ids, or a list of one of either (a batch of one)."""

    prompt: Text | TokenIds | OneText | OneTokenIds
    max_tokens: StrictInt | None = 16  # OpenAI's own default for completions
    logprobs: StrictInt | None = None  # completions: the number of top log-probabilities (0-5), or None
    echo: StrictBool | None = None
    suffix: Text | None = None
    best_of: StrictInt | None = None


class AnthropicTextBlock(_Body):
    type: Literal["text"]
    text: Text


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[AnthropicTextBlock], Field(max_length=MAX_PARTS)]


class AnthropicMetadata(_Body):
    user_id: Text | None = None


class OutputFormat(_Body):
    """Anthropic's structured outputs: `{"type": "json_schema", "schema": {...}}`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """Anthropic's `output_config`: its `format` is the structured output (`effort` means nothing here)."""

    format: OutputFormat | None = None
    effort: Text | None = None


class MessagesBody(_Body):
    """POST /v1/messages (Anthropic)"""

    model: Text
    max_tokens: StrictInt
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Text | Annotated[list[AnthropicTextBlock], Field(max_length=MAX_PARTS)] | None = None
    stop_sequences: Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: AnthropicMetadata | None = None
    service_tier: Text | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    tools: list[Any] | None = None


BODIES = (ChatCompletionBody, CompletionBody, MessagesBody)
_FIELDS = frozenset(
    name
    for body in (*BODIES, ChatMessage, TextPart, ResponseFormat, JsonSchemaFormat, StreamOptions, AnthropicMessage)
    for f_name, f in body.model_fields.items()
    for name in (f_name, f.alias)
    if name
)


def violations(error: ValidationError) -> list[errors.FieldViolation]:
    """pydantic's errors, one per field path as the API names it (`messages[2].role`): a union's branches that
    each failed say what each expected, in one line."""
    found: dict[str, list[str]] = {}
    for e in error.errors(include_url=False, include_input=False):
        path = ""
        for part in e["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in _FIELDS:
                path += f".{part}" if path else part
        found.setdefault(path or "body", []).append(e["msg"])
    return [errors.FieldViolation(path, " or ".join(dict.fromkeys(msgs))) for path, msgs in found.items()]
