"""Both doors, one replica: a call through each leaves one usage row each, alike in everything the bill reads but
the door, and chargeback splits them by door exactly."""

from __future__ import annotations

import time

from zeroqueue.inference.v1 import inference_pb2 as pb

from billing import commands
from billing.chargeback import chargeback_report
from billing.db import make_engine, session_factory
from billing.pricing import cost_micros
from tests.http.conftest import flushed, post
from tests.inference.test_usage import ledger_rows

BILLED = (  # every column the bill reads, but the door and the call's own ids and times
    "tenant_id", "model", "cost_center", "team", "service_class", "request_kind", "prompt_tokens",
    "completion_tokens", "outcome", "unit", "device_kind", "device_id", "num_units", "labels", "deadline_met",
)  # fmt: skip


def test_one_call_through_each_door_is_one_row_each_told_apart_only_by_its_door(bundled):
    fields = {"prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "seed": 1}
    replies = list(
        bundled.stub().Generate(
            pb.GenerateRequest(**fields, labels={"team": "search", "cost_center": "cc-9"}, request_id="door-1"),
            timeout=30,
        )
    )
    grpc_call = replies[0].admission.call_id
    reply = post(bundled, "/v1/completions", fields, x_labels="team=search,cost_center=cc-9", x_request_id="door-1")
    assert reply.status_code == 200
    http_call = reply.headers["x-call-id"]
    assert reply.json()["choices"][0]["text"] == "".join(r.chunk.text for r in replies if r.HasField("chunk"))
    flushed(bundled)
    url = bundled.config.ledger_url
    rows = {r.call_id: r for r in ledger_rows(url, "SELECT * FROM usage_records WHERE request_id = 'door-1'")}
    assert set(rows) == {grpc_call, http_call}  # the same client id in each door: two calls, two rows
    by_door = {rows[c].door: rows[c] for c in rows}
    assert set(by_door) == {"grpc", "http"}
    assert [getattr(by_door["grpc"], c) for c in BILLED] == [getattr(by_door["http"], c) for c in BILLED]
    commands.add_price(url, by_door["grpc"].model, "core_us", 1_000, "USD", "2020-01-01T00:00:00Z")
    engine = make_engine(url)
    try:
        with session_factory(engine)() as session:
            period = time.strftime("%Y-%m", time.gmtime())
            split = chargeback_report(session, period, ["team", "door"])
            whole = chargeback_report(session, period, ["team"])
    finally:
        engine.dispose()
    search = {dict(r.group)["door"]: r for r in split.rows if dict(r.group)["team"] == "search"}
    assert {d: r.num_requests for d, r in search.items()} == {"grpc": 1, "http": 1}
    assert {d: r.unit_us for d, r in search.items()} == {d: by_door[d].unit_us for d in ("grpc", "http")}
    (team,) = [r for r in whole.rows if dict(r.group)["team"] == "search"]
    assert team.unit_us == sum(r.unit_us for r in search.values())
    # each row is priced on its own total (rounded once), so the split rows' costs may sum to 1 more or less
    assert team.cost_micros == cost_micros(team.unit_us, 1_000) > 0
    assert all(r.cost_micros == cost_micros(r.unit_us, 1_000) for r in search.values())


def test_each_api_says_how_many_prompt_tokens_the_prefix_cache_served(bundled):
    # a tenant's second call with the same long prompt reuses its first call's full KV blocks (16 tokens each)
    prompt = "def route_refund(order, amount):\n    return ledger.post(order.id, -amount)\n" * 6
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first, again = (post(bundled, "/v1/completions", body).json()["usage"] for _ in range(2))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached == (again["prompt_tokens"] - 1) // 16 * 16 > 0  # OpenAI: within prompt_tokens
    model = bundled.replica.service.card.name
    message = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": prompt + "# once more\n"}]}
    first, again = (post(bundled, "/v1/messages", message).json()["usage"] for _ in range(2))
    assert first["cache_read_input_tokens"] == 0 < again["cache_read_input_tokens"]
    # Anthropic counts what the cache read apart from input_tokens
    assert again["input_tokens"] + again["cache_read_input_tokens"] == first["input_tokens"]
