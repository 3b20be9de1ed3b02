from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_STATUS_UNSPECIFIED: _ClassVar[RecordStatus]
    RECORD_STATUS_ACCEPTED: _ClassVar[RecordStatus]
    RECORD_STATUS_DUPLICATE: _ClassVar[RecordStatus]
    RECORD_STATUS_CONFLICT: _ClassVar[RecordStatus]
    RECORD_STATUS_INVALID: _ClassVar[RecordStatus]

class InvoiceStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INVOICE_STATUS_UNSPECIFIED: _ClassVar[InvoiceStatus]
    INVOICE_STATUS_DRAFT: _ClassVar[InvoiceStatus]
    INVOICE_STATUS_FINALIZED: _ClassVar[InvoiceStatus]
    INVOICE_STATUS_VOID: _ClassVar[InvoiceStatus]
RECORD_STATUS_UNSPECIFIED: RecordStatus
RECORD_STATUS_ACCEPTED: RecordStatus
RECORD_STATUS_DUPLICATE: RecordStatus
RECORD_STATUS_CONFLICT: RecordStatus
RECORD_STATUS_INVALID: RecordStatus
INVOICE_STATUS_UNSPECIFIED: InvoiceStatus
INVOICE_STATUS_DRAFT: InvoiceStatus
INVOICE_STATUS_FINALIZED: InvoiceStatus
INVOICE_STATUS_VOID: InvoiceStatus

class UsageRecord(_message.Message):
    __slots__ = ("call_id", "tenant", "labels", "model", "device_kind", "device_id", "unit", "num_units", "unit_us", "prompt_tokens", "completion_tokens", "received_at_us", "dispatched_at_us", "first_token_at_us", "finished_at_us", "deadline_at_us", "deadline_met", "outcome", "request_id", "service_class", "request_kind", "door", "cached_prompt_tokens", "weight_dtype")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    NUM_UNITS_FIELD_NUMBER: _ClassVar[int]
    UNIT_US_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_AT_US_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_US_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_AT_US_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MET_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KIND_FIELD_NUMBER: _ClassVar[int]
    DOOR_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tenant: str
    labels: _containers.ScalarMap[str, str]
    model: str
    device_kind: str
    device_id: str
    unit: str
    num_units: int
    unit_us: int
    prompt_tokens: int
    completion_tokens: int
    received_at_us: int
    dispatched_at_us: int
    first_token_at_us: int
    finished_at_us: int
    deadline_at_us: int
    deadline_met: bool
    outcome: str
    request_id: str
    service_class: str
    request_kind: str
    door: str
    cached_prompt_tokens: int
    weight_dtype: str
    def __init__(self, call_id: _Optional[str] = ..., tenant: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., model: _Optional[str] = ..., device_kind: _Optional[str] = ..., device_id: _Optional[str] = ..., unit: _Optional[str] = ..., num_units: _Optional[int] = ..., unit_us: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., received_at_us: _Optional[int] = ..., dispatched_at_us: _Optional[int] = ..., first_token_at_us: _Optional[int] = ..., finished_at_us: _Optional[int] = ..., deadline_at_us: _Optional[int] = ..., deadline_met: _Optional[bool] = ..., outcome: _Optional[str] = ..., request_id: _Optional[str] = ..., service_class: _Optional[str] = ..., request_kind: _Optional[str] = ..., door: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., weight_dtype: _Optional[str] = ...) -> None: ...

class IdleRecord(_message.Message):
    __slots__ = ("record_id", "device_id", "unit", "num_units", "minute_start_us", "idle_unit_us", "wall_unit_us")
    RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    NUM_UNITS_FIELD_NUMBER: _ClassVar[int]
    MINUTE_START_US_FIELD_NUMBER: _ClassVar[int]
    IDLE_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    WALL_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    record_id: str
    device_id: str
    unit: str
    num_units: int
    minute_start_us: int
    idle_unit_us: int
    wall_unit_us: int
    def __init__(self, record_id: _Optional[str] = ..., device_id: _Optional[str] = ..., unit: _Optional[str] = ..., num_units: _Optional[int] = ..., minute_start_us: _Optional[int] = ..., idle_unit_us: _Optional[int] = ..., wall_unit_us: _Optional[int] = ...) -> None: ...

class RecordUsageRequest(_message.Message):
    __slots__ = ("records", "idle")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[UsageRecord]
    idle: _containers.RepeatedCompositeFieldContainer[IdleRecord]
    def __init__(self, records: _Optional[_Iterable[_Union[UsageRecord, _Mapping]]] = ..., idle: _Optional[_Iterable[_Union[IdleRecord, _Mapping]]] = ...) -> None: ...

class RecordResult(_message.Message):
    __slots__ = ("id", "status", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: RecordStatus
    message: str
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[RecordStatus, str]] = ..., message: _Optional[str] = ...) -> None: ...

class RecordUsageResponse(_message.Message):
    __slots__ = ("records", "idle")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RecordResult]
    idle: _containers.RepeatedCompositeFieldContainer[RecordResult]
    def __init__(self, records: _Optional[_Iterable[_Union[RecordResult, _Mapping]]] = ..., idle: _Optional[_Iterable[_Union[RecordResult, _Mapping]]] = ...) -> None: ...

class QueryUsageRequest(_message.Message):
    __slots__ = ("tenant", "start_us", "end_us", "labels", "model", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    START_US_FIELD_NUMBER: _ClassVar[int]
    END_US_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    start_us: int
    end_us: int
    labels: _containers.ScalarMap[str, str]
    model: str
    page_size: int
    page_token: str
    def __init__(self, tenant: _Optional[str] = ..., start_us: _Optional[int] = ..., end_us: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class QueryUsageResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[UsageRecord]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[UsageRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class InvoiceLine(_message.Message):
    __slots__ = ("kind", "model", "unit", "quantity_unit_us", "requests", "price_micros", "amount_micros", "service_class", "request_kinds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    QUANTITY_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICROS_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICROS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_KINDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model: str
    unit: str
    quantity_unit_us: int
    requests: int
    price_micros: int
    amount_micros: int
    service_class: str
    request_kinds: _containers.RepeatedCompositeFieldContainer[RequestKindUsage]
    def __init__(self, kind: _Optional[str] = ..., model: _Optional[str] = ..., unit: _Optional[str] = ..., quantity_unit_us: _Optional[int] = ..., requests: _Optional[int] = ..., price_micros: _Optional[int] = ..., amount_micros: _Optional[int] = ..., service_class: _Optional[str] = ..., request_kinds: _Optional[_Iterable[_Union[RequestKindUsage, _Mapping]]] = ...) -> None: ...

class RequestKindUsage(_message.Message):
    __slots__ = ("request_kind", "requests", "quantity_unit_us", "amount_micros")
    REQUEST_KIND_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUANTITY_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICROS_FIELD_NUMBER: _ClassVar[int]
    request_kind: str
    requests: int
    quantity_unit_us: int
    amount_micros: int
    def __init__(self, request_kind: _Optional[str] = ..., requests: _Optional[int] = ..., quantity_unit_us: _Optional[int] = ..., amount_micros: _Optional[int] = ...) -> None: ...

class CreditNote(_message.Message):
    __slots__ = ("id", "amount_micros", "reason", "created_at_us")
    ID_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_MICROS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    id: int
    amount_micros: int
    reason: str
    created_at_us: int
    def __init__(self, id: _Optional[int] = ..., amount_micros: _Optional[int] = ..., reason: _Optional[str] = ..., created_at_us: _Optional[int] = ...) -> None: ...

class Invoice(_message.Message):
    __slots__ = ("id", "tenant", "period", "status", "currency", "total_micros", "lines", "credit_notes", "balance_micros", "created_at_us", "finalized_at_us")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MICROS_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    CREDIT_NOTES_FIELD_NUMBER: _ClassVar[int]
    BALANCE_MICROS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    FINALIZED_AT_US_FIELD_NUMBER: _ClassVar[int]
    id: int
    tenant: str
    period: str
    status: InvoiceStatus
    currency: str
    total_micros: int
    lines: _containers.RepeatedCompositeFieldContainer[InvoiceLine]
    credit_notes: _containers.RepeatedCompositeFieldContainer[CreditNote]
    balance_micros: int
    created_at_us: int
    finalized_at_us: int
    def __init__(self, id: _Optional[int] = ..., tenant: _Optional[str] = ..., period: _Optional[str] = ..., status: _Optional[_Union[InvoiceStatus, str]] = ..., currency: _Optional[str] = ..., total_micros: _Optional[int] = ..., lines: _Optional[_Iterable[_Union[InvoiceLine, _Mapping]]] = ..., credit_notes: _Optional[_Iterable[_Union[CreditNote, _Mapping]]] = ..., balance_micros: _Optional[int] = ..., created_at_us: _Optional[int] = ..., finalized_at_us: _Optional[int] = ...) -> None: ...

class CreateInvoiceRequest(_message.Message):
    __slots__ = ("tenant", "period")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    period: str
    def __init__(self, tenant: _Optional[str] = ..., period: _Optional[str] = ...) -> None: ...

class FinalizeInvoiceRequest(_message.Message):
    __slots__ = ("invoice_id",)
    INVOICE_ID_FIELD_NUMBER: _ClassVar[int]
    invoice_id: int
    def __init__(self, invoice_id: _Optional[int] = ...) -> None: ...

class GetInvoiceRequest(_message.Message):
    __slots__ = ("invoice_id",)
    INVOICE_ID_FIELD_NUMBER: _ClassVar[int]
    invoice_id: int
    def __init__(self, invoice_id: _Optional[int] = ...) -> None: ...

class ListInvoicesRequest(_message.Message):
    __slots__ = ("tenant", "period")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    period: str
    def __init__(self, tenant: _Optional[str] = ..., period: _Optional[str] = ...) -> None: ...

class ListInvoicesResponse(_message.Message):
    __slots__ = ("invoices",)
    INVOICES_FIELD_NUMBER: _ClassVar[int]
    invoices: _containers.RepeatedCompositeFieldContainer[Invoice]
    def __init__(self, invoices: _Optional[_Iterable[_Union[Invoice, _Mapping]]] = ...) -> None: ...

class GetChargebackReportRequest(_message.Message):
    __slots__ = ("period", "group_by", "tenant")
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    period: str
    group_by: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    def __init__(self, period: _Optional[str] = ..., group_by: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ...) -> None: ...

class ChargebackRow(_message.Message):
    __slots__ = ("group", "unit_us", "unit", "requests", "prompt_tokens", "completion_tokens", "cost_micros", "deadline_met", "admitted", "cached_prompt_tokens")
    class GroupEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_FIELD_NUMBER: _ClassVar[int]
    UNIT_US_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_MICROS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MET_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    group: _containers.ScalarMap[str, str]
    unit_us: int
    unit: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int
    deadline_met: int
    admitted: int
    cached_prompt_tokens: int
    def __init__(self, group: _Optional[_Mapping[str, str]] = ..., unit_us: _Optional[int] = ..., unit: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cost_micros: _Optional[int] = ..., deadline_met: _Optional[int] = ..., admitted: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class DeviceUtilisation(_message.Message):
    __slots__ = ("device_id", "unit", "wall_unit_us", "idle_unit_us", "billed_unit_us")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    WALL_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    IDLE_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    BILLED_UNIT_US_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    unit: str
    wall_unit_us: int
    idle_unit_us: int
    billed_unit_us: int
    def __init__(self, device_id: _Optional[str] = ..., unit: _Optional[str] = ..., wall_unit_us: _Optional[int] = ..., idle_unit_us: _Optional[int] = ..., billed_unit_us: _Optional[int] = ...) -> None: ...

class ChargebackReport(_message.Message):
    __slots__ = ("period", "group_by", "currency", "rows", "devices")
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    GROUP_BY_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    period: str
    group_by: _containers.RepeatedScalarFieldContainer[str]
    currency: str
    rows: _containers.RepeatedCompositeFieldContainer[ChargebackRow]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceUtilisation]
    def __init__(self, period: _Optional[str] = ..., group_by: _Optional[_Iterable[str]] = ..., currency: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[ChargebackRow, _Mapping]]] = ..., devices: _Optional[_Iterable[_Union[DeviceUtilisation, _Mapping]]] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Principal(_message.Message):
    __slots__ = ("tenant", "role")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    role: str
    def __init__(self, tenant: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class GetServingPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceClass(_message.Message):
    __slots__ = ("name", "min_budget_ms", "max_budget_ms", "priority", "credit_ppm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CREDIT_PPM_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_budget_ms: int
    max_budget_ms: int
    priority: int
    credit_ppm: int
    def __init__(self, name: _Optional[str] = ..., min_budget_ms: _Optional[int] = ..., max_budget_ms: _Optional[int] = ..., priority: _Optional[int] = ..., credit_ppm: _Optional[int] = ...) -> None: ...

class ClassPrice(_message.Message):
    __slots__ = ("model", "unit", "service_class", "price_micros", "currency")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    PRICE_MICROS_FIELD_NUMBER: _ClassVar[int]
    CURRENCY_FIELD_NUMBER: _ClassVar[int]
    model: str
    unit: str
    service_class: str
    price_micros: int
    currency: str
    def __init__(self, model: _Optional[str] = ..., unit: _Optional[str] = ..., service_class: _Optional[str] = ..., price_micros: _Optional[int] = ..., currency: _Optional[str] = ...) -> None: ...

class TenantQuota(_message.Message):
    __slots__ = ("tenant", "weight", "device_us_per_month", "spend_micros_per_month", "calls_per_s", "used_device_us", "spent_micros", "resets_at_us")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_US_PER_MONTH_FIELD_NUMBER: _ClassVar[int]
    SPEND_MICROS_PER_MONTH_FIELD_NUMBER: _ClassVar[int]
    CALLS_PER_S_FIELD_NUMBER: _ClassVar[int]
    USED_DEVICE_US_FIELD_NUMBER: _ClassVar[int]
    SPENT_MICROS_FIELD_NUMBER: _ClassVar[int]
    RESETS_AT_US_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    device_us_per_month: int
    spend_micros_per_month: int
    calls_per_s: int
    used_device_us: int
    spent_micros: int
    resets_at_us: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ..., device_us_per_month: _Optional[int] = ..., spend_micros_per_month: _Optional[int] = ..., calls_per_s: _Optional[int] = ..., used_device_us: _Optional[int] = ..., spent_micros: _Optional[int] = ..., resets_at_us: _Optional[int] = ...) -> None: ...

class ServingPolicy(_message.Message):
    __slots__ = ("classes", "prices", "tenants", "read_at_us")
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    PRICES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    READ_AT_US_FIELD_NUMBER: _ClassVar[int]
    classes: _containers.RepeatedCompositeFieldContainer[ServiceClass]
    prices: _containers.RepeatedCompositeFieldContainer[ClassPrice]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantQuota]
    read_at_us: int
    def __init__(self, classes: _Optional[_Iterable[_Union[ServiceClass, _Mapping]]] = ..., prices: _Optional[_Iterable[_Union[ClassPrice, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantQuota, _Mapping]]] = ..., read_at_us: _Optional[int] = ...) -> None: ...
