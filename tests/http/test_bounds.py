"""The HTTP door bounds a request before parsing it: its head, its body's declared and actual size, its JSON's depth,
its arrival time; and a reader that does not read holds no slot."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from services.http.limits import HttpLimits, json_depth
from tests.http.conftest import base_url, post, wait_until


def raw(server, data: bytes, read_timeout: float = 10.0) -> bytes:
    """Sends `data` as is on a fresh connection; returns what comes back until the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", server.replica.http_port), timeout=read_timeout) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            pass
        return got


def status_and_body(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body.strip().startswith(b"{") else {}


def test_json_depth_is_read_off_the_bytes_with_strings_aside():
    assert json_depth(b'{"a": [1, {"b": "[[[[{{{{"}]}') == 3
    assert json_depth(b'"\\"[[[["') == 0
    assert json_depth(b"[" * 100 + b"]" * 100) == 100


def test_a_head_past_its_bound_is_refused_431_without_being_held(bundled):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n"
    status, body = status_and_body(raw(bundled, head))
    assert status == 431 and body["error"]["code"] == "HEADERS_TOO_LARGE"


def test_a_declared_or_actual_body_past_its_bound_is_413_before_parsing(bundled):
    limit = bundled.replica.http._max_body()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bundled.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {limit + 1}\r\n\r\n"
    ).encode()
    status, body = status_and_body(raw(bundled, head + b"{"))  # the rest never needs to arrive
    assert status == 413 and body["error"]["code"] == "REQUEST_TOO_LARGE"
    reply = post(bundled, "/v1/completions", {"prompt": "x" * (limit + 10), "max_tokens": 1})
    assert reply.status_code == 413 and reply.json()["error"]["error_info"]["metadata"]["max_bytes"] == str(limit)


def test_deep_json_is_refused_naming_the_body(bundled):
    deep = '{"prompt": "x", "max_tokens": 1, "metadata": ' + "[" * 70 + "]" * 70 + "}"
    reply = httpx.post(
        base_url(bundled) + "/v1/completions",
        content=deep,
        headers={"authorization": f"Bearer {bundled.key}", "content-type": "application/json"},
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body"
    assert "71 levels" in reply.json()["error"]["message"]  # the object around the 70 arrays


def test_a_body_that_trickles_past_the_timeout_is_408(bundled):
    door = bundled.replica.http
    before, door.limits = door.limits, HttpLimits(body_timeout_s=0.3)
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bundled.key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        ).encode()
        status, body = status_and_body(raw(bundled, head + b'{"prompt": ', read_timeout=5))
    finally:
        door.limits = before
    assert status == 408 and body["error"]["code"] == "BODY_TIMEOUT"


def test_a_reader_that_never_reads_holds_no_slot(bundled):
    """The door's app driven as its server would, with a reader whose window never opens: sending the reply's first
    body bytes blocks for good (a socket's buffers would hide that for a short reply). The call still ends when its
    engine ends it, and its slot is free."""
    body = json.dumps({"prompt": "def f(x):", "max_tokens": 30, "stream": True}).encode()
    headers = [(b"authorization", f"Bearer {bundled.key}".encode()), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
    }  # fmt: skip

    async def start() -> asyncio.Task:
        never, requests = asyncio.Event(), [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            return requests.pop() if requests else await never.wait()  # nor does the client leave

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                await never.wait()

        return asyncio.create_task(bundled.replica.http.app(scope, receive, send))

    service = bundled.replica.service
    reply = bundled.run(start())
    try:
        wait_until(lambda: service.in_flight, timeout=10)
        wait_until(lambda: not service.in_flight, timeout=30)
    finally:
        bundled.loop.call_soon_threadsafe(reply.cancel)


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_wrong_method_or_path_is_answered_in_the_apis_error_shape(bundled, method):
    reply = httpx.request(method, base_url(bundled) + "/v1/chat/completions")
    assert reply.status_code == 405 and reply.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
    missing = httpx.post(base_url(bundled) + "/v1/messages/nope", headers={"anthropic-version": "2023-06-01"})
    assert missing.status_code == 404 and missing.json()["type"] == "error"


def test_a_client_that_leaves_before_its_body_is_in_costs_nothing(bundled):
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {bundled.key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", bundled.replica.http_port)) as s:
        s.sendall(head + b'{"prompt":')
    reply = post(bundled, "/v1/completions", {"prompt": "x", "max_tokens": 1})  # the door serves on
    assert reply.status_code == 200


def test_bytes_the_http_parser_refuses_get_a_400_in_the_apis_shape_not_plain_text(bundled):
    status, body = status_and_body(raw(bundled, b"FOO /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 400 and body["error"]["code"] == "MALFORMED_HTTP"
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (20 << 10)
    status, body = status_and_body(raw(bundled, head))  # never ends its head: refused at the bound
    assert status == 431 and body["type"] == "error" and body["error"]["code"] == "HEADERS_TOO_LARGE"


def test_every_connection_the_door_accepts_sends_without_waiting_for_acks(bundled):
    """TCP_NODELAY on accepted sockets: a reply goes out as head then body, and with Nagle on the body would wait
    for the client's delayed ACK."""
    with httpx.Client(base_url=base_url(bundled)) as client:
        assert client.get("/health").status_code == 200
        connections = bundled.replica.http._server.server_state.connections
        sockets = [c.transport.get_extra_info("socket") for c in connections]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
