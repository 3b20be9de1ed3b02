"""Sending a fuzzed Generate call (tests/fuzz_generate.py) and judging its answer: what came back, whether it is
a defect, and a tally of many. grpc only: no server code."""

from __future__ import annotations

from dataclasses import dataclass

from zeroqueue.inference.v1 import inference_pb2 as pb

from tests.fuzz_wire import GENERATE, FuzzCall

SOFT_METADATA_BYTES = 8 << 10  # gRPC's default soft limit on received metadata: a larger status may be dropped
_SAFE = " !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"  # what grpc-message leaves unescaped besides letters and digits


@dataclass(frozen=True)
class Outcome:
    index: int
    kind: str
    code: str  # a grpc.StatusCode name; OK for a stream that ended
    reason: str = ""  # the ErrorInfo's
    status_bytes: int = 0  # grpc-message percent-encoded + grpc-status-details-bin base64-encoded
    message: str = ""
    num_replies: int = 0
    final: bool = False  # the stream's last message was a Final
    # an admitted call's Admission tells its times in order: received <= dispatched <= predicted start <= finish
    admission_in_order: bool = True

    @property
    def failure(self) -> str | None:
        """Why this answer is a server bug, or None."""
        if self.code in ("INTERNAL", "UNKNOWN"):
            return f"{self.code} for something the client sent"
        if self.status_bytes >= SOFT_METADATA_BYTES:
            return f"status of {self.status_bytes} bytes"
        if self.code == "RESOURCE_EXHAUSTED" and self.reason != "OVERLOADED":
            return "RESOURCE_EXHAUSTED that is not an overload (a status or message over a limit?)"
        if self.code == "OK" and not self.final:
            return "a stream that ended without its Final"
        if not self.admission_in_order:
            return "an Admission whose times are out of order (received, dispatched, predicted start, finish)"
        if self.code not in ("OK", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED") and not self.reason:
            return "a refusal without an ErrorInfo"
        return None


def status_bytes(message: str | None, trailing) -> tuple[int, str]:
    """(size of the status in the trailers, the ErrorInfo reason) of a failed call."""
    import base64
    import urllib.parse

    from google.rpc import error_details_pb2, status_pb2

    blob = next((v for k, v in trailing or () if k == "grpc-status-details-bin"), b"")
    reason = ""
    if blob:
        for detail in status_pb2.Status.FromString(blob).details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
    size = len(urllib.parse.quote((message or "").encode(), safe=_SAFE)) + len(base64.b64encode(blob))
    return size, reason


async def send(channel, call: FuzzCall, metadata: tuple = (), timeout: float = 5.0) -> Outcome:
    """Sends one call on a grpc.aio channel as raw bytes and reads its whole answer."""
    import grpc

    stream = channel.unary_stream(GENERATE)(call.raw, timeout=timeout, metadata=(*metadata, *call.metadata))
    replies: list[bytes] = []
    try:
        async for reply in stream:
            replies.append(reply)
    except grpc.aio.AioRpcError as error:
        size, reason = status_bytes(error.details(), error.trailing_metadata())
        return Outcome(
            call.index, call.kind, error.code().name, reason, size, (error.details() or "")[:300], len(replies)
        )
    final = bool(replies) and pb.GenerateResponse.FromString(replies[-1]).WhichOneof("kind") == "final"
    return Outcome(
        call.index, call.kind, "OK", num_replies=len(replies), final=final, admission_in_order=in_order(replies)
    )


def in_order(replies: list[bytes]) -> bool:
    """Whether the first reply, an Admission, says its times in order (predicted_start_at_us is 0 on a replica
    that does not send it)."""
    first = pb.GenerateResponse.FromString(replies[0]) if replies else None
    if first is None or first.WhichOneof("kind") != "admission":
        return True
    a = first.admission
    start = a.predicted_start_at_us or a.dispatched_at_us
    return a.received_at_us <= a.dispatched_at_us <= start <= max(a.predicted_finish_at_us, start)


class Tally:
    """Outcomes by (code, reason), the largest status seen, and the failures (at most `keep` of them kept)."""

    def __init__(self, keep: int = 50) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.kinds: dict[str, int] = {}
        self.max_status_bytes = 0
        self.max_status: Outcome | None = None
        self.failures: list[tuple[Outcome, str]] = []
        self.num_failures = 0
        self.num_admitted = 0  # calls that got their Admission message: each must be billed once
        self.keep = keep

    def add(self, outcome: Outcome) -> None:
        key = (outcome.code, outcome.reason)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.num_admitted += outcome.num_replies > 0
        family = outcome.kind.split(":")[0]
        self.kinds[family] = self.kinds.get(family, 0) + 1
        if outcome.status_bytes > self.max_status_bytes:
            self.max_status_bytes, self.max_status = outcome.status_bytes, outcome
        why = outcome.failure
        if why is not None:
            self.num_failures += 1
            if len(self.failures) < self.keep:
                self.failures.append((outcome, why))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self) -> str:
        lines = [f"{self.total} calls ({', '.join(f'{k} {n}' for k, n in sorted(self.kinds.items()))})"]
        for (code, reason), n in sorted(self.counts.items(), key=lambda item: -item[1]):
            lines.append(f"  {n:>8}  {code:<20} {reason}")
        if self.max_status is not None:
            lines.append(
                f"largest status: {self.max_status_bytes} bytes (call {self.max_status.index}, "
                f"{self.max_status.kind}, {self.max_status.code})"
            )
        lines.append(f"failures: {self.num_failures}")
        for outcome, why in self.failures:
            lines.append(f"  call {outcome.index} {outcome.kind}: {why}: {outcome.code} {outcome.message[:160]!r}")
        return "\n".join(lines)
