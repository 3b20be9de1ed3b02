"""uvicorn's httptools protocol with a bound on a request's head: the request line and headers together may take at
most `max_header_bytes` before they are complete. httptools buffers a header until it ends, so without this a
client could make the server hold any amount of header bytes; with it, the head is refused with 431 in the
error shape of the path it names, and the connection closed, at most one read past the bound."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.errors import DOMAIN

from .refusals import server_time


def _refusal(status: str, kind: str, reason: str, message: str, metadata: dict, anthropic: bool) -> bytes:
    """A reply written before any route sees the request: its API's error body (by the path, when it arrived)."""
    error = {
        "message": message,
        "type": kind,
        "param": "headers" if reason == "HEADERS_TOO_LARGE" else None,
        "code": reason,
        "error_info": {"reason": reason, "domain": DOMAIN, "metadata": metadata},
    }
    body = json.dumps({"type": "error", "error": error} if anthropic else {"error": error}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"x-server-time: {server_time()}\r\nx-should-retry: false\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedHead(HttpToolsProtocol):
    """The door's protocol: `max_header_bytes` is set on the subclass the door makes (door.py). Every byte read
    outside a message's body counts toward its head (the next request's, on a kept-alive connection)."""

    max_header_bytes = 16 << 10

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._in_body, self._head_bytes = False, 0

    def on_headers_complete(self) -> None:
        self._in_body = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body, self._head_bytes = False, 0
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head_bytes += len(data)
        super().data_received(data)
        if not self._in_body and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            # the request line has arrived by now (it is far shorter than the bound): answer in its API's shape
            limit = self.max_header_bytes
            message = f"the request's line and headers exceed {limit} bytes"
            metadata = {"max_bytes": str(limit)}
            reply = _refusal(
                "431 Request Header Fields Too Large",
                "request_too_large",
                "HEADERS_TOO_LARGE",
                message,
                metadata,
                self._anthropic(),
            )
            self.transport.write(reply)
            self.transport.close()

    def _anthropic(self) -> bool:
        return (getattr(self, "url", b"") or b"").startswith(b"/v1/messages")

    def send_400_response(self, msg: str) -> None:
        """Bytes the HTTP parser refuses (not HTTP/1.1, an unknown method, broken framing): 400 in the API's shape."""
        reply = _refusal("400 Bad Request", "invalid_request_error", "MALFORMED_HTTP", msg, {}, self._anthropic())
        self.transport.write(reply)
        self.transport.close()
