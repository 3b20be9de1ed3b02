"""Registers a servicer whose requests reach it as raw bytes and are parsed inside the handler.

gRPC's own deserializer runs before any handler: a DecodeError there (a truncated varint, a string field that
is not UTF-8) comes back UNKNOWN "Unexpected DecodeError", before authentication and outside services/errors.py.
Here the bytes are measured first (a method may refuse more than any valid request holds, before parsing),
then parsed, and a failure is an errors.MalformedRequest or errors.RequestTooLarge through `rpc_errors`, like
every other refusal: INVALID_ARGUMENT / OUT_OF_RANGE with an ErrorInfo, and a BadRequest naming the field when
a short scan of the wire format finds it. A client-streaming method (reflection's) has each message parsed as
its handler reads it. grpcio's own servicers (health, reflection) are registered here too: services/standard.py.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import message_factory

from services import errors
from services.errors import FieldViolation
from services.status import rpc_errors

_MAX_SCANNED_TAGS = 4096  # the locating scan is a Python loop on the event loop: it gives up after this


def add_servicer(
    server: grpc.aio.Server,
    service: _descriptor.ServiceDescriptor,
    servicer: object,
    max_request_bytes: int | None = None,
) -> None:
    """Like the generated add_XServicer_to_server, for every method of `service`; `max_request_bytes` bounds
    each request before it is parsed (None: the server's receive limit only)."""
    handlers = {}
    for method in service.methods:
        if _not_implemented(servicer, method.name):
            continue  # unregistered: gRPC itself answers UNIMPLEMENTED, as for any unknown method
        parse = _parser(method, max_request_bytes)
        behavior = getattr(servicer, method.name)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidirectional(behavior, parse, method.name), response_serializer=serialize
            )
        elif method.client_streaming:
            raise TypeError(f"{method.full_name}: client streaming with a unary reply is not parsed here")
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(behavior, parse, method.name), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behavior, parse, method.name), response_serializer=serialize
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _not_implemented(servicer: object, name: str) -> bool:
    """The servicer inherits the generated base class's method, which only raises NotImplementedError
    (grpcio-health-checking's aio servicer has no List)."""
    return getattr(type(servicer), name).__module__.endswith("_pb2_grpc")


def _unary(behavior, parse, name: str):
    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        async with rpc_errors(context, name):
            request = parse(raw)
        return await behavior(request, context)

    return handler


def _streaming(behavior, parse, name: str):
    if not inspect.isasyncgenfunction(behavior):
        # a coroutine that writes its replies with context.write (grpcio-health-checking's Watch)
        return _unary(behavior, parse, name)

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        async with rpc_errors(context, name):
            request = parse(raw)
        # closed with this handler, whatever ends it (a cancelled call too): its own cleanup runs at once
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return handler


def _bidirectional(behavior, parse, name: str):
    async def handler(raw_requests, context: grpc.aio.ServicerContext):
        async def requests():
            async for raw in raw_requests:
                async with rpc_errors(context, name):  # aborts the call: the servicer's loop ends there
                    request = parse(raw)
                yield request

        async with contextlib.aclosing(behavior(requests(), context)) as responses:
            async for response in responses:
                yield response

    return handler


def _parser(method: _descriptor.MethodDescriptor, max_bytes: int | None) -> Callable[[bytes], _message.Message]:
    message_class = message_factory.GetMessageClass(method.input_type)
    descriptor = method.input_type

    def parse(raw: bytes) -> _message.Message:
        if max_bytes is not None and len(raw) > max_bytes:
            raise errors.RequestTooLarge(len(raw), max_bytes, largest_field(descriptor, raw))
        try:
            return message_class.FromString(raw)
        except (_message.DecodeError, RecursionError) as exc:
            detail = str(exc).rpartition(": ")[2]  # upb: "Error parsing message with type 'X': <why>"
            raise errors.MalformedRequest(descriptor.full_name, locate_problem(descriptor, raw), detail) from None

    return parse


class _Corrupt(Exception):
    def __init__(self, field: str, description: str) -> None:
        super().__init__(field, description)
        self.violation = FieldViolation(field, description)


class _GaveUp(Exception):
    pass


def _varint(raw: bytes, pos: int, field: str) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(pos + 10, len(raw))):
        value |= (raw[i] & 0x7F) << shift
        if raw[i] < 0x80:
            return value, i + 1
        shift += 7
    raise _Corrupt(field, "has a truncated or overlong varint" if field else "ends in a truncated varint tag")


def _fields(descriptor: _descriptor.Descriptor, raw: bytes, prefix: str, budget: list[int]):
    """(field name, wire type, payload start, payload end) per top-level field; raises _Corrupt at the first
    corruption it sees, _GaveUp past the tag budget."""
    pos = 0
    while pos < len(raw):
        budget[0] -= 1
        if budget[0] < 0:
            raise _GaveUp
        tag, pos = _varint(raw, pos, "")
        number, wire = tag >> 3, tag & 7
        known = descriptor.fields_by_number.get(number)
        name = prefix + (known.name if known is not None else f"#{number}")
        if number == 0 or number >= 1 << 29:
            raise _Corrupt(prefix.rstrip("."), f"has a tag with field number {number}")
        start = pos
        if wire == 0:
            _, pos = _varint(raw, pos, name)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, start = _varint(raw, pos, name)
            pos = start + length
        elif wire in (3, 4):  # groups: upb keeps them as unknown fields, or reports the mismatch
            continue
        else:
            raise _Corrupt(name, f"has wire type {wire}, which does not exist")
        if pos > len(raw):
            raise _Corrupt(name, "is cut short: the message ends inside it")
        yield name, known, wire, start, pos


def locate_problem(descriptor: _descriptor.Descriptor, raw: bytes) -> FieldViolation | None:
    """Best effort: the first field whose bytes are corrupt or whose string is not UTF-8 (map entries too)."""
    try:
        _scan(descriptor, raw, "", [_MAX_SCANNED_TAGS], depth=0)
    except _Corrupt as corrupt:
        return corrupt.violation
    except _GaveUp:
        return None
    return None


def _scan(descriptor, raw: bytes, prefix: str, budget: list[int], depth: int) -> None:
    for name, known, wire, start, end in _fields(descriptor, raw, prefix, budget):
        if known is None or wire != 2:
            continue
        if known.type == _descriptor.FieldDescriptor.TYPE_STRING:
            try:
                raw[start:end].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _Corrupt(name, f"is not valid UTF-8 (byte {exc.start} of the string)") from None
        elif known.type == _descriptor.FieldDescriptor.TYPE_MESSAGE and depth < 2:
            _scan(known.message_type, raw[start:end], name + ".", budget, depth + 1)


def largest_field(descriptor: _descriptor.Descriptor, raw: bytes) -> FieldViolation | None:
    """The top-level field that holds the most bytes of `raw` (all its occurrences together), as a violation."""
    sizes: dict[str, int] = {}
    try:
        for name, _, _, start, end in _fields(descriptor, raw, "", [_MAX_SCANNED_TAGS]):
            sizes[name] = sizes.get(name, 0) + end - start
    except (_Corrupt, _GaveUp):
        pass
    if not sizes:
        return None
    name = max(sizes, key=sizes.__getitem__)
    return FieldViolation(errors.clip(name), f"holds {sizes[name]} bytes of it")
