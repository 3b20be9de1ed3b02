"""The fuzzer's raw-bytes mutations of a valid serialized GenerateRequest (tests/fuzz_generate.py draws one per
call): bits flipped, cut, spliced, wire types and varints broken, strings that are not UTF-8, fields repeated past
every bound. Each takes the fuzzer (for its context and vocabulary), its seeded random.Random and the bytes."""

from __future__ import annotations

import struct

from zeroqueue.inference.v1 import inference_pb2 as pb

from tests.fuzz_wire import delimited, tag, varint

_STRING_FIELDS = {f.number: f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.type == f.TYPE_STRING}
_BAD_UTF8 = (b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe6\x9d", b"\xf4\x90\x80\x80", b"\x80", b"a\xffb")


# --- raw-bytes mutations of a valid serialized request ----------------------------------------------------------


def _flip_bits(fuzzer, rng, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def _truncate(fuzzer, rng, raw: bytes) -> bytes:
    return raw[: rng.randrange(len(raw))]


def _insert_random(fuzzer, rng, raw: bytes) -> bytes:
    i = rng.randrange(len(raw) + 1)
    return raw[:i] + rng.randbytes(rng.randint(1, 16)) + raw[i:]


def _delete_span(fuzzer, rng, raw: bytes) -> bytes:
    i = rng.randrange(len(raw))
    return raw[:i] + raw[i + rng.randint(1, 8) :]


def _random_bytes(fuzzer, rng, raw: bytes) -> bytes:
    return rng.randbytes(rng.choice((1, 2, 5, 64, 1000)))


def _overlong_varint(fuzzer, rng, raw: bytes) -> bytes:
    return raw + tag(4, 0) + b"\xff" * rng.choice((9, 10, 11, 20))


def _truncated_varint(fuzzer, rng, raw: bytes) -> bytes:
    return raw + tag(rng.choice((4, 7, 8)), 0) + b"\x80" * rng.randint(1, 5)


def _bad_utf8(fuzzer, rng, raw: bytes) -> bytes:
    number = rng.choice(sorted(_STRING_FIELDS))
    payload = rng.choice((b"ok", b"")) + rng.choice(_BAD_UTF8) + rng.choice((b"", b"tail"))
    return raw + delimited(number, payload)


def _bad_utf8_label(fuzzer, rng, raw: bytes) -> bytes:
    key, value = (b"team", rng.choice(_BAD_UTF8)) if rng.random() < 0.5 else (rng.choice(_BAD_UTF8), b"v")
    return raw + delimited(11, delimited(1, key) + delimited(2, value))


def _wrong_wire_type(fuzzer, rng, raw: bytes) -> bytes:
    number = rng.randint(1, 11)
    wire = rng.choice((0, 1, 2, 5))
    body = {0: varint(rng.getrandbits(40)), 1: rng.randbytes(8), 5: rng.randbytes(4), 2: varint(3) + b"abc"}[wire]
    return raw + tag(number, wire) + body


def _nonexistent_wire_type(fuzzer, rng, raw: bytes) -> bytes:
    return raw + tag(rng.randint(1, 20), rng.choice((6, 7))) + b"\x01"


def _group(fuzzer, rng, raw: bytes) -> bytes:
    number = rng.randint(1, 20)
    return raw + tag(number, 3) + rng.choice((b"", tag(number, 4), tag(number + 1, 4), tag(number, 3) * 200))


def _length_past_end(fuzzer, rng, raw: bytes) -> bytes:
    return raw + tag(rng.choice((1, 2, 3, 9, 10, 11)), 2) + varint(rng.choice((5, 1000, 2**31, 2**63)))


def _field_number_zero(fuzzer, rng, raw: bytes) -> bytes:
    return rng.choice((b"\x00", b"\x02\x00", raw + b"\x00\x01"))


def _huge_field_number(fuzzer, rng, raw: bytes) -> bytes:
    return raw + varint((2**29 - 1) << 3 | 0) + b"\x01" + varint(rng.getrandbits(35) << 3)


def _duplicate_fields(fuzzer, rng, raw: bytes) -> bytes:
    return raw * rng.choice((2, 3, 50))


def _unpacked_ids(fuzzer, rng, raw: bytes) -> bytes:
    count = rng.choice((4, fuzzer.context_length, fuzzer.context_length * 4, 50_000))
    return raw + b"".join(tag(3, 0) + varint(rng.randrange(fuzzer.vocab_size)) for _ in range(count))


def _packed_ids_bad(fuzzer, rng, raw: bytes) -> bytes:
    payload = rng.choice((b"\x80", b"\x05\x80\x80", b"\xff" * 11, varint(-1) * 3))
    return raw + delimited(3, payload)


def _float_payload(fuzzer, rng, raw: bytes) -> bytes:
    bits = rng.choice((0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x80000001, 0x7F7FFFFF))
    return raw + tag(rng.choice((5, 6)), 5) + struct.pack("<I", bits)


def _huge_request(fuzzer, rng, raw: bytes) -> bytes:
    number = rng.choice((1, 2, 3, 9, 10))
    size = rng.choice((fuzzer.max_request_bytes // 4, fuzzer.max_request_bytes))
    return raw + delimited(number, b"\x01" * size)


BYTE_MUTATIONS = (
    _flip_bits,
    _truncate,
    _insert_random,
    _delete_span,
    _random_bytes,
    _overlong_varint,
    _truncated_varint,
    _bad_utf8,
    _bad_utf8,
    _bad_utf8_label,
    _wrong_wire_type,
    _nonexistent_wire_type,
    _group,
    _length_past_end,
    _field_number_zero,
    _huge_field_number,
    _duplicate_fields,
    _unpacked_ids,
    _packed_ids_bad,
    _float_payload,
    _huge_request,
)
