"""Usage and idle records: the immutable facts the ledger stores.

All quantities are integers: µs since the epoch for times, SM·µs (GPU) or
core·µs (CPU) for device time.  Every record validates itself on
construction and raises :class:`billing.errors.InvalidRecord` naming the field.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import MappingProxyType

from billing.errors import InvalidArgument, InvalidRecord
from billing.period import US_PER_DAY, US_PER_MINUTE

MAX_INT64 = 2**63 - 1
MAX_INT32 = 2**31 - 1
# Bounds of one record, enforced here and by CHECKs in the database (migration 0003), so that what a month
# sums can be summed exactly (billing/aggregate.py splits each SUM; its comment has the arithmetic):
#  - times are µs since the epoch before 2200-01-01 (< 2^53: exact even as a JSON double); a deadline is only
#    compared, never summed, so it may be anything positive (a gRPC deadline can be thousands of years away);
#  - a device has at most 4,096 units: SMs of one GPU (132 on an H100, 148 on a B200) or cores of one host
#    (768 hardware threads on today's largest two-socket servers);
#  - a record's device time is at most one month of wall time on all its units, num_units × 31 days, so
#    unit_us ≤ 4,096 × 2.68e12 ≈ 1.1e16 < 2^54, and an idle record's wall time at most a minute of its units;
#  - tokens fit the protocol's int32.
# A month's total then overflows a signed 64-bit integer only past 9.2e18 unit·µs of one tenant, model and unit:
# 3.4 million units busy the whole month (or 840 records each claiming 4,096 units for 31 days). Should it
# happen anyway, the invoice or report is refused naming the period (AmountOutOfRange), never an overflow.
MAX_TIME_US = 7_258_118_400_000_000  # 2200-01-01T00:00:00Z
MAX_NUM_UNITS = 4_096
MAX_RECORD_WALL_US = 31 * US_PER_DAY
MAX_TOKENS = MAX_INT32
MAX_ID_CHARS = 128
MAX_LABELS = 16
MAX_LABEL_KEY_CHARS = 63
MAX_LABEL_VALUE_CHARS = 128
CONVENTIONAL_LABELS = ("cost_center", "team")

_LABEL_KEY = re.compile(r"[a-z][a-z0-9_.\-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TENANT = re.compile(r"[a-z0-9][a-z0-9._\-]{0,62}")
# Classes of service (migration 0005): a call runs in one; records made before classes ran in `standard`.
DEFAULT_CLASS = "standard"  # every budget, priority 0, a miss credited in full: the rule before classes
MAX_CLASS_NAME_CHARS = 32
_CLASS_NAME = re.compile(r"[a-z0-9_\-]{1,32}")
# The dtype a replica held its decoder layers' linear weights in (issue 34): "int8" when quantized, else the
# checkpoint's ("bfloat16", "float32", ...). Not an enum: a new quantization needs no migration to be recorded.
MAX_WEIGHT_DTYPE_CHARS = 16
_WEIGHT_DTYPE = re.compile(r"[a-z][a-z0-9_]{0,15}")


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Unit(StrEnum):
    """The device-time unit: SM·µs on a GPU, core·µs on a CPU."""

    SM_US = "sm_us"
    CORE_US = "core_us"


UNIT_OF_KIND = {DeviceKind.CUDA: Unit.SM_US, DeviceKind.CPU: Unit.CORE_US}
# A CPU's device_id is cpu:<host>; a GPU's is its NVML UUID (GPU-…, or MIG-… for a MIG slice).
DEVICE_ID_PREFIXES = {DeviceKind.CUDA: ("GPU-", "MIG-"), DeviceKind.CPU: ("cpu:",)}


class Outcome(StrEnum):
    """How an admitted call ended. Only two outcomes constrain deadline_met (see UsageRecord._check_deadline, and
    migration 0004, which makes the database enforce the same rules)."""

    OK = "ok"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ERROR = "error"


class RequestKind(StrEnum):
    """What kind of Generate call a record bills (issue 31), so invoices and chargeback can group by it. Device
    time stays the measured truth whatever the kind: the kind only labels it. A sender before kinds sends ''
    (plain), and a plain record digests as it did before (canonical_digest)."""

    PLAIN = "plain"  # a prompt or token ids, free text
    CHAT = "chat"  # messages rendered through the model's chat template
    CONSTRAINED = "constrained"  # a prompt with a response format (JSON, JSON Schema, regex, grammar)
    CHAT_CONSTRAINED = "chat_constrained"  # both


class Door(StrEnum):
    """Which of the replica's doors a call came through (issue 32): the same admission, engine and meter behind
    both, so a record's device time and price never depend on it: chargeback can group by it, invoices are the same
    whatever the door. A sender before doors sends '' (grpc), and a grpc record digests as it did before
    (canonical_digest)."""

    GRPC = "grpc"  # the Inference service's Generate
    HTTP = "http"  # the OpenAI- and Anthropic-compatible HTTP API (services/http/)


def check_text(name: str, value: object, max_chars: int = MAX_ID_CHARS) -> None:
    if not isinstance(value, str):
        raise InvalidRecord(f"{name} must be a string, got {type(value).__name__}", field=name)
    if not 1 <= len(value) <= max_chars:
        raise InvalidRecord(f"{name} must be 1..{max_chars} characters, got {len(value)}", field=name)
    if _CONTROL.search(value):
        raise InvalidRecord(f"{name} must not contain control characters", field=name)


def check_tenant_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not _TENANT.fullmatch(value):
        raise InvalidRecord(f"{name} must match [a-z0-9][a-z0-9._-]{{0,62}}, got {value!r}", field=name)


def check_class_name(name: str, value: object, error: type[InvalidArgument] = InvalidRecord) -> None:
    """A class of service's name: 1..32 characters of [a-z0-9_-]."""
    if not isinstance(value, str) or not _CLASS_NAME.fullmatch(value):
        raise error(f"{name} must be 1..32 characters of [a-z0-9_-], got {value!r}", field=name)


def check_weight_dtype(value: object) -> None:
    """'' (unknown) or 1..16 characters of [a-z0-9_], a letter first: "int8", "bfloat16", "float32"."""
    if not isinstance(value, str) or (value and not _WEIGHT_DTYPE.fullmatch(value)):
        raise InvalidRecord(
            f"weight_dtype must be '' or 1..{MAX_WEIGHT_DTYPE_CHARS} characters of [a-z0-9_], a letter first, "
            f"got {value!r}",
            field="weight_dtype",
        )


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int = MAX_INT64, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecord(f"{name} must be an integer, got {type(value).__name__}", field=name)
    if not minimum <= value <= maximum:
        bound = "2^63-1" if maximum == MAX_INT64 else f"{maximum}{why}"
        raise InvalidRecord(f"{name} must be in [{minimum}, {bound}], got {value}", field=name)


def check_enum(name: str, value: object, enum: type[StrEnum]) -> None:
    if value not in {member.value for member in enum}:
        allowed = ", ".join(member.value for member in enum)
        raise InvalidRecord(f"{name} must be one of {allowed}, got {value!r}", field=name)


def freeze_labels(labels: object) -> Mapping[str, str]:
    if not isinstance(labels, Mapping):
        raise InvalidRecord("labels must be a mapping of str to str", field="labels")
    if len(labels) > MAX_LABELS:
        raise InvalidRecord(f"labels: at most {MAX_LABELS} labels, got {len(labels)}", field="labels")
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key) or len(key) > MAX_LABEL_KEY_CHARS:
            raise InvalidRecord(
                f"labels: key {key!r} must match [a-z][a-z0-9_.-]* and be at most {MAX_LABEL_KEY_CHARS} characters",
                field=f"labels.{key}",
            )
        check_text(f"labels.{key}", value, MAX_LABEL_VALUE_CHARS)
    return MappingProxyType(dict(sorted(labels.items())))


# The zq.usage.v1 storage format: the keys a usage record is digested over (payload_digest), queued under in a
# replica's outbox and kept under in the ledger's usage_conflicts.rejected_payload. Frozen: a record digested or
# queued before a rename must digest and decode the same after it, or its replay would be judged a CONFLICT
# instead of a DUPLICATE, and an outbox written by an older replica could not ship. The fields have been renamed
# since (issue 30: `call_id` is the replica's id of the call, `request_id` the caller's); their v1 keys stay.
V1_USAGE_KEYS = MappingProxyType({"call_id": "request_id", "request_id": "client_request_id"})
_FIELD_OF_V1_KEY = MappingProxyType({key: name for name, key in V1_USAGE_KEYS.items()})


def canonical_digest(kind: str, payload: Mapping[str, object]) -> str:
    """sha256 over a canonical JSON encoding of a record's payload in its frozen storage format."""
    payload = dict(payload)
    # fields added after v1 count only when set: a record written before them keeps its digest
    if payload.get("client_request_id") == "":
        del payload["client_request_id"]
    if payload.get("service_class") == DEFAULT_CLASS:  # before classes every call ran in `standard`
        del payload["service_class"]
    if payload.get("request_kind") == RequestKind.PLAIN:  # before kinds every call was plain (issue 31)
        del payload["request_kind"]
    if payload.get("door") == Door.GRPC:  # before doors every call came through gRPC (issue 32)
        del payload["door"]
    if payload.get("cached_prompt_tokens") == 0:  # before the prefix cache no prompt token was served (issue 33)
        del payload["cached_prompt_tokens"]
    if payload.get("weight_dtype") == "":  # unknown: a sender before weight dtypes (issue 34)
        del payload["weight_dtype"]
    encoded = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(f"{kind}\n{encoded}".encode()).hexdigest()


# The rules that cross columns (unit and device_id by the device's kind, below; deadline_met by the times and the
# outcome, UsageRecord._check_deadline) are CHECKs in the database too: migration 0004, billing/models.py.
def _check_device(kind: object, device_id: object, unit: object, num_units: object) -> None:
    check_enum("device_kind", kind, DeviceKind)
    check_text("device_id", device_id)
    check_enum("unit", unit, Unit)
    if UNIT_OF_KIND[DeviceKind(kind)] != unit:
        raise InvalidRecord(
            f"unit must be {UNIT_OF_KIND[DeviceKind(kind)].value} on a {kind} device, got {unit!r}", field="unit"
        )
    expected_prefix = DEVICE_ID_PREFIXES[DeviceKind(kind)]
    if not device_id.startswith(expected_prefix):  # type: ignore[union-attr]
        raise InvalidRecord(
            f"device_id of a {kind} device must start with {' or '.join(expected_prefix)}, got {device_id!r}",
            field="device_id",
        )
    check_int("num_units", num_units, minimum=1, maximum=MAX_NUM_UNITS)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One admitted call's device time, tokens, timing and outcome. `call_id` is the call's own id, made by the
    replica that admitted it (unique); `request_id` is the caller's, which the caller may reuse: a call made
    again under the same request_id is billed again, as its own record."""

    call_id: str
    tenant: str
    labels: Mapping[str, str] = field(hash=False)
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
    first_token_at_us: int | None
    finished_at_us: int
    deadline_at_us: int
    deadline_met: bool
    outcome: Outcome  # given as the enum or its value; stored as the enum
    request_id: str = ""  # '' on records made before the caller's id was kept
    service_class: str = DEFAULT_CLASS  # '' (a sender before classes) is `standard`
    request_kind: RequestKind = RequestKind.PLAIN  # the enum or its value, stored as the enum; '' (before kinds): plain
    door: Door = Door.GRPC  # the enum or its value, stored as the enum; '' (a sender before doors): grpc
    # the leading prompt tokens the prefix cache served, whose prefill this call skipped (issue 33): they label the
    # measured device time, never price it; 0 when nothing hit (and on records made before the cache)
    cached_prompt_tokens: int = 0
    # the replica's decoder weights (issue 34): "int8" when quantized, else the checkpoint's dtype; they label the
    # device time for audit and price nothing (a price is per model name); '' when unknown: a sender before it
    weight_dtype: str = ""

    def __post_init__(self) -> None:
        check_text("call_id", self.call_id)
        if self.service_class == "":
            object.__setattr__(self, "service_class", DEFAULT_CLASS)
        check_class_name("service_class", self.service_class)
        check_tenant_name("tenant", self.tenant)
        object.__setattr__(self, "labels", freeze_labels(self.labels))
        check_text("model", self.model)
        if self.request_id:
            check_text("request_id", self.request_id)
        _check_device(self.device_kind, self.device_id, self.unit, self.num_units)
        check_int("unit_us", self.unit_us, maximum=self.num_units * MAX_RECORD_WALL_US, why=" (num_units × 31 days)")
        for name in ("prompt_tokens", "completion_tokens"):
            check_int(name, getattr(self, name), maximum=MAX_TOKENS)
        check_int("cached_prompt_tokens", self.cached_prompt_tokens, maximum=self.prompt_tokens, why=" (prompt_tokens)")
        check_weight_dtype(self.weight_dtype)
        self._check_times()
        check_enum("outcome", self.outcome, Outcome)
        object.__setattr__(self, "outcome", Outcome(self.outcome))
        if self.request_kind == "":
            object.__setattr__(self, "request_kind", RequestKind.PLAIN)
        check_enum("request_kind", self.request_kind, RequestKind)
        object.__setattr__(self, "request_kind", RequestKind(self.request_kind))
        if self.door == "":
            object.__setattr__(self, "door", Door.GRPC)
        check_enum("door", self.door, Door)
        object.__setattr__(self, "door", Door(self.door))
        if not isinstance(self.deadline_met, bool):
            raise InvalidRecord("deadline_met must be a bool", field="deadline_met")
        self._check_deadline()

    def _check_times(self) -> None:
        for name in ("received_at_us", "dispatched_at_us", "finished_at_us"):
            check_int(name, getattr(self, name), minimum=1, maximum=MAX_TIME_US - 1, why=" (before 2200)")
        check_int("deadline_at_us", self.deadline_at_us, minimum=1)
        if self.first_token_at_us is not None:
            check_int(
                "first_token_at_us", self.first_token_at_us, minimum=1, maximum=MAX_TIME_US - 1, why=" (before 2200)"
            )
        order = [("received_at_us", self.received_at_us), ("dispatched_at_us", self.dispatched_at_us)]
        if self.first_token_at_us is not None:
            order.append(("first_token_at_us", self.first_token_at_us))
        order.append(("finished_at_us", self.finished_at_us))
        for (before, before_us), (after, after_us) in itertools.pairwise(order):
            if after_us < before_us:
                raise InvalidRecord(
                    f"{after} ({after_us}) must not be earlier than {before} ({before_us})", field=after
                )

    def _check_deadline(self) -> None:
        on_time = self.finished_at_us <= self.deadline_at_us
        if self.deadline_met and not on_time:
            raise InvalidRecord("deadline_met is true but finished_at_us is after deadline_at_us", field="deadline_met")
        if self.outcome == Outcome.DEADLINE_EXCEEDED and self.deadline_met:
            raise InvalidRecord("deadline_met must be false when outcome is deadline_exceeded", field="deadline_met")
        if self.outcome == Outcome.OK and self.deadline_met != on_time:
            raise InvalidRecord(
                "deadline_met must equal finished_at_us <= deadline_at_us when outcome is ok", field="deadline_met"
            )

    @property
    def cost_center(self) -> str | None:
        return self.labels.get("cost_center")

    @property
    def team(self) -> str | None:
        return self.labels.get("team")

    def payload_digest(self) -> str:
        return canonical_digest("zq.usage.v1", self.to_v1_payload())

    def to_payload(self) -> dict[str, object]:
        payload = {f.name: getattr(self, f.name) for f in fields(self)}
        payload["labels"] = dict(self.labels)
        payload["outcome"] = self.outcome.value
        payload["request_kind"] = self.request_kind.value
        payload["door"] = self.door.value
        return payload

    def to_v1_payload(self) -> dict[str, object]:
        """The payload under its frozen zq.usage.v1 keys (V1_USAGE_KEYS): what is digested and stored."""
        return {V1_USAGE_KEYS.get(name, name): value for name, value in self.to_payload().items()}

    @classmethod
    def from_v1_payload(cls, payload: Mapping[str, object]) -> UsageRecord:
        return cls(**{_FIELD_OF_V1_KEY.get(key, key): value for key, value in payload.items()})  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class IdleRecord:
    """Device time with no request running during one UTC minute."""

    record_id: str
    device_id: str
    unit: str
    num_units: int
    minute_start_us: int
    idle_unit_us: int
    wall_unit_us: int

    def __post_init__(self) -> None:
        check_text("record_id", self.record_id, 2 * MAX_ID_CHARS)
        check_enum("unit", self.unit, Unit)
        kind = DeviceKind.CUDA if self.unit == Unit.SM_US else DeviceKind.CPU
        _check_device(kind, self.device_id, self.unit, self.num_units)
        check_int("minute_start_us", self.minute_start_us, minimum=0, maximum=MAX_TIME_US - 1, why=" (before 2200)")
        if self.minute_start_us % US_PER_MINUTE:
            raise InvalidRecord("minute_start_us must be aligned to a UTC minute", field="minute_start_us")
        check_int("idle_unit_us", self.idle_unit_us)
        check_int("wall_unit_us", self.wall_unit_us, minimum=1)
        if self.idle_unit_us > self.wall_unit_us:
            raise InvalidRecord("idle_unit_us must not exceed wall_unit_us", field="idle_unit_us")
        if self.wall_unit_us > US_PER_MINUTE * self.num_units:
            raise InvalidRecord("wall_unit_us must not exceed one minute × num_units", field="wall_unit_us")

    @property
    def busy_unit_us(self) -> int:
        return self.wall_unit_us - self.idle_unit_us

    def payload_digest(self) -> str:
        return canonical_digest("zq.idle.v1", self.to_payload())

    def to_payload(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
