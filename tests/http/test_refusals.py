"""The deadline contract over HTTP, as the official SDKs meet it at a full four-slot replica: a 429 retried after
exactly the server's retry-after-ms (the replica counts the attempt), no retry where x-should-retry says false or the
budget is infeasible, the articles' header check with a plain client, and a client that leaves mid-stream."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.http.conftest import base_url, flushed, post, wait_until
from tests.inference.test_usage import ledger_rows


class Recorder:
    """The SDK's own HTTP client, recording each request it sends and each reply it gets."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict]] = []
        self.got: list[tuple[float, int, dict]] = []
        self.lock = threading.Lock()

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self._request], "response": [self._response]})

    def _request(self, request: httpx.Request) -> None:
        with self.lock:
            self.sent.append((time.monotonic(), dict(request.headers)))

    def _response(self, response: httpx.Response) -> None:
        with self.lock:
            self.got.append((time.monotonic(), response.status_code, dict(response.headers)))


def sdk(server, recorder: Recorder, **options) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base_url(server) + "/v1", api_key=server.key, http_client=recorder.client(), **options
    )


def completion(client: openai.OpenAI, request_id: str, max_tokens: int, **headers):
    return client.completions.create(
        model="",
        prompt="def f(x):",
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"X-Request-Id": request_id, **headers},
    )


def occupy(server, n: int, max_tokens: int) -> list[threading.Thread]:
    """n long calls that hold n slots for a while: greedy, as the tiny checkpoint's greedy text runs to max_tokens
    (sampled, it may draw its end-of-sequence token after two, and free a slot the test counts on)."""
    body = {"prompt": "x", "max_tokens": max_tokens, "temperature": 0}
    threads = [threading.Thread(target=post, args=(server, "/v1/completions", body)) for _ in range(n)]
    for t in threads:
        t.start()
    wait_until(lambda: len(server.replica.service.in_flight) >= n)
    return threads


def retry_attempts(server, attempt: str) -> float:
    return sum(
        s.value
        for m in server.replica.metrics.registry.collect()
        if m.name == "zeroqueue_retry_attempts"
        for s in m.samples
        if s.name.endswith("_total") and s.labels.get("attempt") == attempt
    )


def test_a_burst_is_retried_by_the_sdk_after_exactly_the_servers_hint(slow):
    recorder, retried_before = Recorder(), retry_attempts(slow, "1")
    client = sdk(slow, recorder, max_retries=6, timeout=20.0)
    ids = [f"burst-{i}" for i in range(12)]
    threads = [threading.Thread(target=completion, args=(client, i, 20)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refusals = [(at, h) for at, status, h in recorder.got if status == 429]
    assert refusals, "a burst of 12 at four slots met no 429"
    by_id: dict[str, list[tuple[float, dict]]] = {}
    for at, headers in recorder.sent:
        by_id.setdefault(headers["x-request-id"], []).append((at, headers))
    for at, headers in refusals:
        assert headers["x-should-retry"] == "true" and int(headers["retry-after"]) * 1000 >= int(
            headers["retry-after-ms"]
        )
        request_id = headers["x-request-id"]
        later = [(t, h) for t, h in by_id[request_id] if t > at]
        assert later, f"{request_id}: the 429 was not retried"
        gap_ms = (later[0][0] - at) * 1000
        assert gap_ms >= int(headers["retry-after-ms"]) * 0.95  # the SDK slept the server's hint, not its own
    counts = {i: [int(h["x-stainless-retry-count"]) for _, h in by_id[i]] for i in ids}
    assert all(c == list(range(len(c))) for c in counts.values())  # the count rises by one per attempt
    assert sum(len(c) for c in counts.values()) == len(ids) + len(refusals)
    assert sum(status == 200 for _, status, _ in recorder.got) == len(ids)  # every call got through in the end
    assert retry_attempts(slow, "1") > retried_before  # the replica saw and counted the retries


def test_no_retry_where_the_server_says_not_or_the_budget_is_infeasible(slow):
    running = occupy(slow, 4, max_tokens=60)
    try:
        recorder = Recorder()
        client = sdk(slow, recorder, max_retries=5)
        with pytest.raises(openai.RateLimitError) as refused:
            completion(client, "tight-1", 4, **{"X-Budget-Ms": "400"})
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert refused.value.body["error_info"]["metadata"]["retry_within_budget"] == "false"
        with pytest.raises(openai.BadRequestError) as infeasible:
            completion(client, "tiny-1", 20, **{"X-Budget-Ms": "5"})
        assert infeasible.value.body["code"] == "DEADLINE_INFEASIBLE"
        assert int(infeasible.value.response.headers["x-min-budget-ms"]) > 5
        assert len(recorder.sent) == 2  # one request each: neither was retried
    finally:  # the slots are free again for the module's next test, whatever happened here
        for t in running:
            t.join()


def curl(server, *args: str) -> dict[str, str]:
    """`curl -s -D -` (the articles' check): the status line and headers of one POST."""
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-D",
            "-",
            "-o",
            "/dev/null",
            "-H",
            f"Authorization: Bearer {server.key}",
            "-H",
            "Content-Type: application/json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    lines = out.strip().splitlines()
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return {"status": lines[0].split()[1], **headers}


def test_curl_during_load_shows_the_429_contract_and_admitted_dispatch_times(slow):
    url = base_url(slow) + "/v1/completions"
    admitted = curl(slow, url, "-d", '{"prompt": "x", "max_tokens": 2}')
    assert admitted["status"] == "200" and int(admitted["x-request-dispatch-time"]) >= 0
    assert admitted["x-call-id"] and int(admitted["x-server-time"]) > 0
    running = occupy(slow, 4, max_tokens=40)
    refused = curl(slow, url, "-H", "X-Budget-Ms: 900", "-d", '{"prompt": "x", "max_tokens": 20}')
    assert refused["status"] == "429", refused
    assert int(refused["retry-after"]) * 1000 >= int(refused["retry-after-ms"]) > 0
    assert abs(int(refused["x-server-time"]) - time.time_ns() // 1000) < 60_000_000
    assert refused["x-should-retry"] in ("true", "false")
    for t in running:
        t.join()


def test_a_client_that_leaves_mid_stream_frees_its_slot_and_is_billed_once(slow):
    body = {"prompt": "def f(x):", "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {slow.key}", "x-request-id": "leaves-1"}
    seen = 0
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", base_url(slow) + "/v1/completions", json=body, headers=headers) as reply:
            call_id = reply.headers["x-call-id"]
            for line in reply.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
    wait_until(lambda: not slow.replica.service.in_flight, timeout=5)
    query = f"SELECT * FROM usage_records WHERE call_id = '{call_id}'"
    wait_until(lambda: ledger_rows(slow.config.ledger_url, query), timeout=30)  # the engine's end, then the outbox
    flushed(slow)
    rows = ledger_rows(slow.config.ledger_url, query)
    assert len(rows) == 1 and rows[0].outcome == "cancelled" and rows[0].unit_us > 0
    assert rows[0].door == "http"
    # it ran a step or two past the client's leaving (tokens in flight on the wire), never to its 200 tokens
    assert rows[0].completion_tokens < 20
