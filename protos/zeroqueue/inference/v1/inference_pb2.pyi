from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHAT_ROLE_UNSPECIFIED: _ClassVar[ChatRole]
    CHAT_ROLE_SYSTEM: _ClassVar[ChatRole]
    CHAT_ROLE_USER: _ClassVar[ChatRole]
    CHAT_ROLE_ASSISTANT: _ClassVar[ChatRole]
    CHAT_ROLE_TOOL: _ClassVar[ChatRole]

class BudgetSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUDGET_SOURCE_UNSPECIFIED: _ClassVar[BudgetSource]
    BUDGET_SOURCE_CLIENT_DEADLINE: _ClassVar[BudgetSource]
    BUDGET_SOURCE_SERVER_DEFAULT: _ClassVar[BudgetSource]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class WarmupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WARMUP_STATE_UNSPECIFIED: _ClassVar[WarmupState]
    WARMUP_STATE_WARMING_UP: _ClassVar[WarmupState]
    WARMUP_STATE_READY: _ClassVar[WarmupState]
    WARMUP_STATE_DRAINING: _ClassVar[WarmupState]
    WARMUP_STATE_FAILED: _ClassVar[WarmupState]

class DeviceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_STATE_UNSPECIFIED: _ClassVar[DeviceState]
    DEVICE_STATE_HEALTHY: _ClassVar[DeviceState]
    DEVICE_STATE_SLOW: _ClassVar[DeviceState]
    DEVICE_STATE_FAILED: _ClassVar[DeviceState]
CHAT_ROLE_UNSPECIFIED: ChatRole
CHAT_ROLE_SYSTEM: ChatRole
CHAT_ROLE_USER: ChatRole
CHAT_ROLE_ASSISTANT: ChatRole
CHAT_ROLE_TOOL: ChatRole
BUDGET_SOURCE_UNSPECIFIED: BudgetSource
BUDGET_SOURCE_CLIENT_DEADLINE: BudgetSource
BUDGET_SOURCE_SERVER_DEFAULT: BudgetSource
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
WARMUP_STATE_UNSPECIFIED: WarmupState
WARMUP_STATE_WARMING_UP: WarmupState
WARMUP_STATE_READY: WarmupState
WARMUP_STATE_DRAINING: WarmupState
WARMUP_STATE_FAILED: WarmupState
DEVICE_STATE_UNSPECIFIED: DeviceState
DEVICE_STATE_HEALTHY: DeviceState
DEVICE_STATE_SLOW: DeviceState
DEVICE_STATE_FAILED: DeviceState

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "request_id", "labels", "service_class", "messages", "response_format", "logprobs", "top_logprobs")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    labels: _containers.ScalarMap[str, str]
    service_class: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    response_format: ResponseFormat
    logprobs: bool
    top_logprobs: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., service_class: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: ChatRole
    content: str
    name: str
    def __init__(self, role: _Optional[_Union[ChatRole, str]] = ..., content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "lark_grammar")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_object: AnyJson
    json_schema: str
    regex: str
    lark_grammar: str
    def __init__(self, json_object: _Optional[_Union[AnyJson, _Mapping]] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark_grammar: _Optional[str] = ...) -> None: ...

class AnyJson(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("admission", "chunk", "final")
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    admission: Admission
    chunk: TokenChunk
    final: Final
    def __init__(self, admission: _Optional[_Union[Admission, _Mapping]] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("request_id", "received_at_us", "dispatched_at_us", "predicted_finish_at_us", "deadline_at_us", "budget_ms", "budget_source", "prompt_tokens", "call_id", "service_class", "predicted_start_at_us", "compile_us")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_AT_US_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FINISH_AT_US_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_AT_US_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_START_AT_US_FIELD_NUMBER: _ClassVar[int]
    COMPILE_US_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    received_at_us: int
    dispatched_at_us: int
    predicted_finish_at_us: int
    deadline_at_us: int
    budget_ms: int
    budget_source: BudgetSource
    prompt_tokens: int
    call_id: str
    service_class: str
    predicted_start_at_us: int
    compile_us: int
    def __init__(self, request_id: _Optional[str] = ..., received_at_us: _Optional[int] = ..., dispatched_at_us: _Optional[int] = ..., predicted_finish_at_us: _Optional[int] = ..., deadline_at_us: _Optional[int] = ..., budget_ms: _Optional[int] = ..., budget_source: _Optional[_Union[BudgetSource, str]] = ..., prompt_tokens: _Optional[int] = ..., call_id: _Optional[str] = ..., service_class: _Optional[str] = ..., predicted_start_at_us: _Optional[int] = ..., compile_us: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "emitted_at_us", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    EMITTED_AT_US_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    emitted_at_us: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., emitted_at_us: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "timings", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    timings: Timings
    usage: Usage
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("received_at_us", "first_scheduled_at_us", "first_token_at_us", "finished_at_us", "queue_us", "ttft_us", "total_us", "deadline_met")
    RECEIVED_AT_US_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_AT_US_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_US_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    TTFT_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MET_FIELD_NUMBER: _ClassVar[int]
    received_at_us: int
    first_scheduled_at_us: int
    first_token_at_us: int
    finished_at_us: int
    queue_us: int
    ttft_us: int
    total_us: int
    deadline_met: bool
    def __init__(self, received_at_us: _Optional[int] = ..., first_scheduled_at_us: _Optional[int] = ..., first_token_at_us: _Optional[int] = ..., finished_at_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., ttft_us: _Optional[int] = ..., total_us: _Optional[int] = ..., deadline_met: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "sm_us", "unit", "device_kind", "device_id", "num_compute_units", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SM_US_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTE_UNITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    sm_us: int
    unit: str
    device_kind: str
    device_id: str
    num_compute_units: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., sm_us: _Optional[int] = ..., unit: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_id: _Optional[str] = ..., num_compute_units: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "context_length", "dtype", "device_kind", "device_name", "num_compute_units", "unit", "state", "max_batch", "vocab_size", "device_state", "classes", "has_chat_template", "response_formats", "kv_blocks", "kv_block_size", "prefix_cache", "weight_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTE_UNITS_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STATE_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMATS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    context_length: int
    dtype: str
    device_kind: str
    device_name: str
    num_compute_units: int
    unit: str
    state: WarmupState
    max_batch: int
    vocab_size: int
    device_state: DeviceState
    classes: _containers.RepeatedCompositeFieldContainer[ClassOffer]
    has_chat_template: bool
    response_formats: _containers.RepeatedScalarFieldContainer[str]
    kv_blocks: int
    kv_block_size: int
    prefix_cache: bool
    weight_dtype: str
    def __init__(self, name: _Optional[str] = ..., context_length: _Optional[int] = ..., dtype: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_name: _Optional[str] = ..., num_compute_units: _Optional[int] = ..., unit: _Optional[str] = ..., state: _Optional[_Union[WarmupState, str]] = ..., max_batch: _Optional[int] = ..., vocab_size: _Optional[int] = ..., device_state: _Optional[_Union[DeviceState, str]] = ..., classes: _Optional[_Iterable[_Union[ClassOffer, _Mapping]]] = ..., has_chat_template: _Optional[bool] = ..., response_formats: _Optional[_Iterable[str]] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., weight_dtype: _Optional[str] = ...) -> None: ...

class ClassOffer(_message.Message):
    __slots__ = ("name", "min_budget_ms", "max_budget_ms", "priority", "price_micros", "currency", "credit_ppm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICROS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    CREDIT_PPM_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_budget_ms: int
    max_budget_ms: int
    priority: int
    price_micros: int
    currency: str
    credit_ppm: int
    def __init__(self, name: _Optional[str] = ..., min_budget_ms: _Optional[int] = ..., max_budget_ms: _Optional[int] = ..., priority: _Optional[int] = ..., price_micros: _Optional[int] = ..., currency: _Optional[str] = ..., credit_ppm: _Optional[int] = ...) -> None: ...
