"""What one HTTP request may hold, checked before anything parses it: its headers' bytes, its body's bytes as they
arrive (a body that is too large is never held whole), and its JSON's nesting depth, on the raw bytes before any
JSON parser sees them. A slow sender gets `body_timeout_s` for its whole body: it holds a connection, never a slot
(a call is admitted only once its body is in)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from services import errors

# A JSON string: brackets inside one do not nest. The unrolled form runs in re's C loop, ~1 ms per MiB here.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_LENGTH = re.compile(r"[0-9]{1,15}")  # ASCII digits only: str.isdigit() takes '²', which int() refuses
# +1 for an opening bracket, -1 for a closing one, 0 for every other byte
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("{"), ord("[")]] = 1
_NESTING[[ord("}"), ord("]")]] = -1
_NESTING.flags.writeable = False


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on one HTTP request, beside the Generate bounds (RequestLimits) its body is then held to."""

    max_header_bytes: int = 16 << 10  # every header's name and value together
    max_json_depth: int = 64  # a JSON Schema nests deep; a document of 10,000 brackets is an attack
    body_timeout_s: float = 10.0  # for the whole body to arrive (a trickling sender is cut off)
    body_per_request_byte: int = 2  # JSON's escapes: a text may take twice its bytes as a JSON string
    inline_parse_bytes: int = 64 << 10  # larger bodies are checked and parsed on a worker thread

    def max_body_bytes(self, max_request_bytes: int) -> int:
        """No valid body is larger: twice the largest valid Generate request (escapes; token ids as text)."""
        return max_request_bytes * self.body_per_request_byte


class ClientGone(Exception):
    """The client closed its connection before its body arrived: an ordinary departure, not an error."""


class BodyTooLarge(errors.RequestTooLarge):
    """HTTP 413: the body is larger than any valid one (its Content-Length said so, or its bytes did)."""


class BodyTooSlow(errors.InvalidArgument):
    """HTTP 408: the body did not arrive within the limit; nothing was parsed or admitted."""

    reason = "BODY_TIMEOUT"

    def __init__(self, timeout_s: float, received_bytes: int) -> None:
        why = f"not complete after {timeout_s:g} s ({received_bytes} bytes)"
        super().__init__([errors.FieldViolation("body", why)])


class HeadersTooLarge(errors.InvalidArgument):
    """HTTP 431: the request's headers together are larger than the limit."""

    reason = "HEADERS_TOO_LARGE"

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        super().__init__([errors.FieldViolation("headers", f"{size_bytes} bytes; at most {max_bytes}")])
        self.metadata = {"size_bytes": str(size_bytes), "max_bytes": str(max_bytes)}


class MalformedHttp(errors.InvalidArgument):
    """HTTP 400 from the protocol: bytes the HTTP parser refuses (not HTTP/1.1, an unknown method, broken framing)."""

    reason = "MALFORMED_HTTP"

    def __init__(self, why: str) -> None:
        super().__init__([])
        self.message = f"not an HTTP/1.1 request this door can read: {why}"


def check_headers(headers: list[tuple[bytes, bytes]], limits: HttpLimits) -> None:
    size = sum(len(k) + len(v) for k, v in headers)
    if size > limits.max_header_bytes:
        raise HeadersTooLarge(size, limits.max_header_bytes)


async def read_body(
    receive: Callable[[], Awaitable[dict]], declared: str | None, max_bytes: int, limits: HttpLimits
) -> bytes:
    """The request's body, at most `max_bytes`, within the body timeout. `declared`: its Content-Length header."""
    if declared is not None and _LENGTH.fullmatch(declared) and int(declared) > max_bytes:
        raise BodyTooLarge(int(declared), max_bytes, errors.FieldViolation("body", "Content-Length says so"))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone  # nothing was admitted: nothing to answer, nothing to bill
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(size, max_bytes, errors.FieldViolation("body", "more bytes arrived"))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyTooSlow(limits.body_timeout_s, size) from None


def json_depth(body: bytes) -> int:
    """How deep the brackets of `body` nest, strings aside: a scan of the bytes, no parse."""
    stripped = _STRING.sub(b'""', body)
    if not stripped:
        return 0
    return int(np.cumsum(_NESTING[np.frombuffer(stripped, np.uint8)], dtype=np.int32).max(initial=0))


def check_depth(body: bytes, limits: HttpLimits) -> None:
    if body.count(b"[") + body.count(b"{") <= limits.max_json_depth:
        return  # no deeper than its brackets: a scan would find nothing
    depth = json_depth(body)
    if depth > limits.max_json_depth:
        raise errors.InvalidArgument(
            [errors.FieldViolation("body", f"JSON nests {depth} levels deep; at most {limits.max_json_depth}")]
        )
