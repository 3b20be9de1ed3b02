"""uvicorn's httptools protocol with a bound on a request's head: the request line and headers together may take at
most `max_header_bytes` before they are complete. httptools buffers a header until it ends, so without this a
client could make the server hold any amount of header bytes; with it, the head is refused with 431 in the OpenAI
error shape (the path may not be known yet) and the connection closed, at most one read past the bound."""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.errors import DOMAIN


def _head_too_large(max_bytes: int) -> bytes:
    error = {
        "message": f"the request's line and headers exceed {max_bytes} bytes",
        "type": "request_too_large",
        "param": "headers",
        "code": "HEADERS_TOO_LARGE",
        "error_info": {"reason": "HEADERS_TOO_LARGE", "domain": DOMAIN, "metadata": {"max_bytes": str(max_bytes)}},
    }
    body = json.dumps({"error": error}).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedHead(HttpToolsProtocol):
    """The door's protocol: `max_header_bytes` is set on the subclass the door makes (door.py)."""

    max_header_bytes = 16 << 10

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._in_head, self._head_bytes = True, 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            self.transport.write(_head_too_large(self.max_header_bytes))
            self.transport.close()
