"""2,000 fuzzed HTTP requests (tests/fuzz_http.py: bodies, headers, methods, paths, encodings, framing) against one
replica's HTTP door, each written as raw HTTP/1.1 bytes on its own connection, while a well-formed gRPC Generate
stream and a well-formed HTTP (SSE) chat stream of a second tenant run beside them, again and again: no 500, every
refusal in its API's error shape, both side streams as they are alone, health answering throughout, and the ledger
holding exactly one usage row per admitted call (the call ids every reply named), on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from billing import commands
from services.inference.device.spec import ExecutorConfig
from services.inference.serve_config import ServeConfig
from tests.billing.conftest import ledger, postgres_schema_url, sqlite_template  # noqa: F401 - fixtures
from tests.fuzz_http import SLOW_BODY_S, HttpCase, HttpFuzzer
from tests.inference.harness import ServerThread
from tests.inference.test_usage import ledger_rows

NUM_REQUESTS = 2000
CONCURRENCY = 8
SEED = int(os.environ.get("ZQ_HTTP_FUZZ_SEED", "20240612"))
REPLY_TIMEOUT_S = SLOW_BODY_S + 20
PIECE_GAP_S = 0.005  # between a trickled request's pieces
# The one 5xx allowed: 504 DEADLINE_MISSED for an admitted call whose budget is this short (X-Budget-Ms 5-250, an SDK
# timeout of 0.05 s): admission predicts its finish from calibrated step times, and on a 2-core host shared with this
# client steps run 2x slow at times, so a call admitted within a few ms of its budget can miss it. It is billed once.
# Never 503: the replica is ready throughout (health says so); never 500.
MISSABLE_BUDGET_MS = 1000
# Server bugs this fuzz found and reported, not yet fixed: a failing case that meets one is tallied under its name, and
# the test xfails naming each while one still occurs (any other failure fails it as ever). Delete one once fixed.
KNOWN_BUGS: dict = {}  # none known: wire.py's 431 now answers in the path's shape, with x-server-time
STEADY_GRPC = pb.GenerateRequest(prompt="def add(a, b):\n    return", max_tokens=16, temperature=0.0)
STEADY_HTTP = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 16, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


@pytest.fixture
def server(ledger, chatml_dir):  # noqa: F811 - the ledger fixture: SQLite and PostgreSQL
    key = commands.create_tenant(ledger.url, "acme")
    executor = ExecutorConfig(max_batch=4, max_seq_len=256)
    s = ServerThread(ServeConfig(str(chatml_dir), port=0, http_port=0, ledger_url=ledger.url, executor=executor))
    s.key = key
    yield s.start()
    s.stop()


# --- one raw request and its reply ---------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int = 0  # 0: no reply
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""


def parse_reply(data: bytes, head_only: bool, eof: bool) -> Reply | None:
    """The reply in `data`, or None while it is incomplete (1xx replies, as 100 Continue, are skipped)."""
    status = 100
    while status < 200:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return Reply(error=f"closed mid-head: {data[:80]!r}") if eof else None
        lines, data = data[:end].decode("latin-1").split("\r\n"), data[end + 4 :]
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if head_only or status in (204, 304):
        return Reply(status, headers)
    if headers.get("transfer-encoding") == "chunked":
        chunks = []
        while (eol := data.find(b"\r\n")) >= 0:
            size = int(data[:eol].split(b";")[0], 16)
            if len(data) < eol + size + 4:
                break
            if size == 0:
                return Reply(status, headers, b"".join(chunks))
            chunks.append(data[eol + 2 : eol + 2 + size])
            data = data[eol + size + 4 :]
    elif "content-length" in headers:
        if len(data) >= int(headers["content-length"]):
            return Reply(status, headers, data[: int(headers["content-length"])])
    elif eof:
        return Reply(status, headers, data)
    return Reply(status, headers, error="closed mid-body") if eof else None


async def send(port: int, case: HttpCase) -> Reply:
    """Writes the case's bytes on a fresh connection (its pieces apart) and reads the reply. A plain socket: the
    server may answer and close before it reads a body or head it refuses, and the reply must still be read."""
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))

        async def write() -> None:
            for at, end in zip((0, *case.pieces), (*case.pieces, len(case.raw))):
                await loop.sock_sendall(sock, case.raw[at:end])
                await asyncio.sleep(PIECE_GAP_S if end < len(case.raw) else 0)

        writing, data, reply = asyncio.create_task(write()), b"", None
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                while reply is None:
                    chunk = await loop.sock_recv(sock, 1 << 16)
                    data += chunk
                    reply = parse_reply(data, case.method == "HEAD", eof=not chunk)
        except (OSError, TimeoutError, ValueError, IndexError) as error:
            reply = parse_reply(data, case.method == "HEAD", eof=True)
            reply.error += f" ({error!r})" if reply.error else ""
        writing.cancel()
        return reply


# --- judging a reply -------------------------------------------------------------------------------------------------


def _error_detail(case: HttpCase, data) -> tuple[dict | None, str]:
    """The error object of a refusal in its API's shape, or why it is not in it."""
    if not isinstance(data, dict):
        return None, "not a JSON object"
    if case.anthropic and (data.get("type") != "error" or not isinstance(data.get("error"), dict)):
        return None, "not Anthropic's shape {type: error, error: {...}}"
    detail = data.get("error")
    if not isinstance(detail, dict):
        return None, "not OpenAI's shape {error: {...}}"
    missing = [k for k in ("message", "type", "param", "code", "error_info") if k not in detail]
    info = detail.get("error_info")
    if missing or not detail["message"] or not isinstance(info, dict) or not info.get("reason"):
        return None, f"an error without {missing or 'a message or error_info.reason'}"
    return detail, ""


def _refusal_problem(case: HttpCase, reply: Reply) -> tuple[str, str]:
    """(reason, problem) of a non-2xx reply."""
    if reply.status == 400 and b"MALFORMED_HTTP" in reply.body:
        # bytes the HTTP parser refuses: in an API's shape (the path may not have been read), never plain text
        detail = json.loads(reply.body).get("error") if reply.body.startswith(b"{") else None
        ok = isinstance(detail, dict) and detail.get("code") == "MALFORMED_HTTP" and "x-server-time" in reply.headers
        return "MALFORMED_HTTP", "" if ok and case.unparsable else f"the parser's 400 for {case.kind}: {reply.body!r}"
    if case.method == "HEAD":
        return "HEAD", ""
    try:
        detail, why = _error_detail(case, json.loads(reply.body))
    except ValueError:
        detail, why = None, "not JSON"
    if detail is None:
        return "", f"{why}: {reply.body[:200]!r}"
    reason = detail["error_info"]["reason"]
    if "x-server-time" not in reply.headers:
        return reason, "a refusal without x-server-time"
    if reply.status == 429 and not {"retry-after", "retry-after-ms"} <= reply.headers.keys():
        return reason, "a 429 without Retry-After and retry-after-ms"
    if reply.status >= 500 and not (reply.status == 504 and reason == "DEADLINE_MISSED" and _missable(reply)):
        return reason, f"{reply.status} {reason}"
    return reason, ""


def _missable(reply: Reply) -> bool:
    """An admitted call with a budget short enough to miss under this load (it was admitted, and billed)."""
    budget = reply.headers.get("x-budget-ms", "")
    return "x-call-id" in reply.headers and budget.isdigit() and int(budget) < MISSABLE_BUDGET_MS


def _stream_problem(case: HttpCase, reply: Reply) -> str:
    events = [line[6:] for line in reply.body.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if not events:
        return "a stream without events"
    last = events[-1]
    if last == "[DONE]" or '"type":"message_stop"' in last:
        return ""
    detail, why = _error_detail(case, json.loads(last))
    if detail is None:
        return f"a stream that ends with neither its end nor an error: {why}"
    missed = detail["error_info"]["reason"] == "DEADLINE_MISSED" and _missable(reply)
    return "" if missed or detail["error_info"]["reason"] == "GRAMMAR_LIMITS" else f"stream error {detail['code']}"


def judge(case: HttpCase, reply: Reply) -> tuple[str, str]:
    """(what the reply was, why it is a server bug or '')."""
    if reply.error:
        return "NO_REPLY", f"no whole reply: {reply.error}"
    if reply.status >= 400 or reply.status < 200:
        return _refusal_problem(case, reply)
    if 300 <= reply.status < 400:
        return "REDIRECT", "" if "location" in reply.headers else "a redirect without Location"
    if case.method != "POST" or case.path not in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        return "OK", ""
    if not {"x-call-id", "x-request-dispatch-time"} <= reply.headers.keys():
        return "OK", "a 200 without x-call-id and x-request-dispatch-time"
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        return "OK", _stream_problem(case, reply)
    body = json.loads(reply.body)
    return "OK", "" if body["id"].endswith(reply.headers["x-call-id"]) else "a reply whose id is not its call's"


class Tally(logging.Handler):
    """The replies by (status, reason), the admitted calls' ids, the failures, the known bugs met (by name: the
    cases); and, as a logging handler on uvicorn's error log, any error the server logged (an exception out of the
    app, a 500 it tried to send)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.counts: Counter = Counter()  # (status, reason)
        self.kinds: Counter = Counter()  # family
        self.call_ids: list[str] = []  # every admitted call's, as its reply named it
        self.failures: list[str] = []
        self.known: dict[str, list] = {}

    def add(self, case: HttpCase, reply: Reply) -> None:
        try:
            what, problem = judge(case, reply)
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # a body not as its headers say
            what, problem = "UNREADABLE", f"{error!r}: {reply.body[:200]!r}"
        self.counts[(reply.status, what)] += 1
        self.kinds[case.kind.split(":")[0]] += 1
        if "x-call-id" in reply.headers:
            self.call_ids.append(reply.headers["x-call-id"])
        if problem and (bug := next((k for k, met in KNOWN_BUGS.items() if met(case, reply)), None)):
            self.known.setdefault(bug, []).append(case.index)
        elif problem:
            self.failures.append(f"case {case.index} {case.kind}: {reply.status} {problem}")

    def emit(self, record: logging.LogRecord) -> None:
        self.failures.append(f"logged: {record.getMessage()} {record.exc_info and record.exc_info[1]!r}")

    def report(self) -> str:
        lines = [f"seed {SEED}: {sum(self.counts.values())} requests ({dict(sorted(self.kinds.items()))})"]
        lines += [f"  {n:>6}  {status} {what}" for (status, what), n in sorted(self.counts.items())]
        lines += [f"known bug, {len(v)} times ({v[:8]}): {k}" for k, v in self.known.items()]
        lines.append(f"admitted: {len(self.call_ids)}; failures: {len(self.failures)}")
        return "\n".join(lines + [f"  {f[:400]}" for f in self.failures[:40]])


# --- beside the fuzz: a second tenant's well-formed calls, and health ---------------------------------------------


@dataclass
class Side:
    stop: asyncio.Event
    problems: list[str] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    grpc_done: int = 0
    http_done: int = 0
    health: list[float] = field(default_factory=list)  # how long each answer took


async def _steady_grpc(address: str, key: str, expected: list[int], side: Side) -> None:
    metadata = (("authorization", f"Bearer {key}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        while not side.stop.is_set() or not side.grpc_done:
            try:
                replies = [r async for r in stub.Generate(STEADY_GRPC, timeout=60, metadata=metadata)]
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    await asyncio.sleep(0.05)
                    continue
                side.problems.append(f"steady gRPC call: {error.code().name} {error.details()}")
                return
            side.call_ids.append(replies[0].admission.call_id)
            if _tokens(replies) != expected or replies[-1].WhichOneof("kind") != "final":
                side.problems.append(f"steady gRPC call streamed {_tokens(replies)}, alone {expected}")
                return
            side.grpc_done += 1


def _tokens(replies) -> list[int]:
    return [t for r in replies if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]


async def stream_chat(client: httpx.AsyncClient, key: str) -> tuple[int, dict, str, list[str]]:
    """One well-formed SSE chat call, as an SDK makes it: (status, headers, the text, the events' data)."""
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=STEADY_HTTP, headers=headers) as response:
        if response.status_code != 200:
            return response.status_code, dict(response.headers), (await response.aread()).decode(), []
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return 200, dict(response.headers), text, events


async def _steady_http(port: int, key: str, expected: str, side: Side) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        while not side.stop.is_set() or not side.http_done:
            status, headers, text, events = await stream_chat(client, key)
            if status == 429:
                await asyncio.sleep(int(headers["retry-after-ms"]) / 1000)
                continue
            if status != 200:
                side.problems.append(f"steady HTTP call: {status} {text[:300]}")
                return
            side.call_ids.append(headers["x-call-id"])
            if text != expected or events[-1] != "[DONE]" or '"usage"' not in events[-2]:
                side.problems.append(f"steady HTTP call streamed {text!r}, alone {expected!r}; ends {events[-2:]}")
                return
            side.http_done += 1


async def _health(address: str, port: int, side: Side) -> None:
    request = health_pb2.HealthCheckRequest(service="zeroqueue.inference.v1.Inference")
    async with grpc.aio.insecure_channel(address) as channel, httpx.AsyncClient(timeout=5) as client:
        stub = health_pb2_grpc.HealthStub(channel)
        while not side.stop.is_set():
            t0 = time.monotonic()
            try:
                reply = await stub.Check(request, timeout=5)
                answer = await client.get(f"http://127.0.0.1:{port}/health")
            except (grpc.aio.AioRpcError, httpx.HTTPError) as error:
                side.problems.append(f"health: {error!r}")
                return
            if reply.status != health_pb2.HealthCheckResponse.SERVING or answer.status_code != 200:
                side.problems.append(f"health: gRPC {reply.status}, HTTP {answer.status_code} {answer.text}")
            side.health.append(time.monotonic() - t0)
            await asyncio.sleep(0.1)


async def _fuzz(server: ServerThread, beta_key: str, alone: tuple[list[int], str]) -> tuple[Tally, Side]:
    tally, side = Tally(), Side(asyncio.Event())
    port, card = server.replica.http_port, server.replica.service.card
    fuzzer = HttpFuzzer(
        SEED, card.name, card.context_length, card.vocab_size, server.replica.http._max_body(), (server.key, beta_key)
    )
    beside = [
        asyncio.create_task(_steady_grpc(server.address, beta_key, alone[0], side)),
        asyncio.create_task(_steady_http(port, beta_key, alone[1], side)),
        asyncio.create_task(_health(server.address, port, side)),
    ]
    indices = iter(range(NUM_REQUESTS))

    async def worker() -> None:
        for index in indices:
            case = fuzzer.case(index)
            tally.add(case, await send(port, case))

    logging.getLogger("uvicorn.error").addHandler(tally)
    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        logging.getLogger("uvicorn.error").removeHandler(tally)
    side.stop.set()
    await asyncio.wait_for(asyncio.gather(*beside), 120)
    return tally, side


@pytest.mark.slow
def test_fuzzed_http_beside_well_formed_streams(server):
    beta_key = commands.create_tenant(server.config.ledger_url, "beta")
    alone_grpc = list(server.stub(key=beta_key).Generate(STEADY_GRPC, timeout=60))
    http_call_id, http_text = asyncio.run(_alone_http(server.replica.http_port, beta_key))
    call_ids = [alone_grpc[0].admission.call_id, http_call_id]

    tally, side = asyncio.run(_fuzz(server, beta_key, (_tokens(alone_grpc), http_text)))
    print(
        tally.report(),
        f"\nbeside: {side.grpc_done} gRPC and {side.http_done} HTTP streams, {len(side.health)} health checks",
    )
    assert sum(tally.counts.values()) == NUM_REQUESTS
    assert not tally.failures, f"seed {SEED}:\n" + tally.report()
    assert not side.problems, side.problems
    assert side.grpc_done and side.http_done, (side.grpc_done, side.http_done)
    assert side.health and max(side.health) < 5, max(side.health, default=None)
    assert sum(n for (status, _), n in tally.counts.items() if status == 200) > 100  # valid calls were served
    assert sum(n for (status, _), n in tally.counts.items() if status == 400) > 300  # and the bytes were fuzzed
    deadline = time.monotonic() + 10
    while server.replica.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.replica.service.in_flight
    server.stop()  # the outbox drains into the ledger
    billed = [row[0] for row in ledger_rows(server.config.ledger_url, "SELECT call_id FROM usage_records")]
    named = call_ids + tally.call_ids + side.call_ids
    assert len(set(named)) == len(named), [c for c, n in Counter(named).items() if n > 1][:10]  # no id twice
    assert sorted(billed) == sorted(named), (len(billed), len(named), set(billed) ^ set(named))
    if tally.known:  # reported, not hidden: see KNOWN_BUGS
        pytest.xfail("known server bugs met: " + "; ".join(f"{k} ({len(v)}x)" for k, v in tally.known.items()))


async def _alone_http(port: int, key: str) -> tuple[str, str]:
    """The steady HTTP call alone: (its call id, its text)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        status, headers, text, events = await stream_chat(client, key)
    assert status == 200 and events[-1] == "[DONE]", (status, text)
    return headers["x-call-id"], text
