"""uvicorn's httptools protocol with a bound on a request's head: the request line and headers together may take at
most `max_header_bytes` before they are complete. httptools buffers a header until it ends, so without this a
client could make the server hold any amount of header bytes; with it, the head is refused with 431 in the
error shape of the path it names, and the connection closed, at most one read past the bound."""

from __future__ import annotations

import json
from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .limits import HeadersTooLarge, MalformedHttp
from .refusals import refusal


def _reply(error: Exception, anthropic: bool) -> bytes:
    """A refusal written before any route sees the request, through the door's one map (refusals.py): its API's
    error body (by the path, when it arrived), and no retry invited (the same bytes fail the same way)."""
    status, headers, body = refusal(error, None, anthropic)
    data = json.dumps(body).encode()
    headers |= {"content-type": "application/json", "content-length": str(len(data)), "x-should-retry": "false"}
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (head + "connection: close\r\n\r\n").encode() + data


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
            reply = _reply(HeadersTooLarge(self._head_bytes, self.max_header_bytes), self._anthropic())
            self.transport.write(reply)
            self.transport.close()

    def _anthropic(self) -> bool:
        return (getattr(self, "url", b"") or b"").startswith(b"/v1/messages")

    def send_400_response(self, msg: str) -> None:
        """Bytes the HTTP parser refuses (not HTTP/1.1, an unknown method, broken framing): 400 in the API's shape."""
        reply = _reply(MalformedHttp(msg), self._anthropic())
        self.transport.write(reply)
        self.transport.close()
