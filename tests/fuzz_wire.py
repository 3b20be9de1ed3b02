"""The protobuf wire format by hand, for fuzzed Generate calls (tests/fuzz_generate.py): a call as sent, and
varints, tags and length-delimited fields."""

from __future__ import annotations

from dataclasses import dataclass

GENERATE = "/zeroqueue.inference.v1.Inference/Generate"


@dataclass(frozen=True)
class FuzzCall:
    index: int
    kind: str  # valid | field:<names> | bytes:<mutation> | header:<name>
    raw: bytes  # the request's bytes as sent (possibly not a valid message)
    metadata: tuple[tuple[str, str], ...] = ()  # besides the caller's authorization


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64: ten bytes, as protobuf encodes them
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload
