"""The official OpenAI and Anthropic Python SDKs, unmodified, against a real replica's HTTP door: every API, streamed
and not, structured output that parses, and the SDK's own timeout as the call's budget."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.http.conftest import base_url, flushed
from tests.inference.test_usage import ledger_rows

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}},
    "required": ["ok", "kind"],
    "additionalProperties": False,
}
CHAT = [{"role": "system", "content": "You write short Python functions."}, {"role": "user", "content": "Add."}]


def oai(server, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(server) + "/v1", api_key=server.key, **options)


def claude(server, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url(server), api_key=server.key, **options)


def test_chat_completions_streamed_and_not_say_the_same_and_bill_device_time(bundled):
    client, model = oai(bundled), bundled.replica.servicer.name
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, max_tokens=12, temperature=0, seed=3
    )
    whole = raw.parse()
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.role == "assistant"
    assert whole.id == "chatcmpl-" + raw.headers["x-call-id"]
    assert int(raw.headers["x-request-dispatch-time"]) >= 0 and raw.headers["x-deadline-met"] == "true"
    received, finished = int(raw.headers["x-received-at-us"]), int(raw.headers["x-finished-at-us"])
    assert received < finished <= int(raw.headers["x-server-time"])
    device = whole.usage.model_extra["device_time"]
    assert device["unit"] == "core_us" and device["amount"] > 0
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.model_extra["device_time"]["amount"] > 0
    flushed(bundled)
    rows = ledger_rows(bundled.config.ledger_url, f"SELECT * FROM usage_records WHERE call_id = '{whole.id[9:]}'")
    assert len(rows) == 1 and rows[0].unit_us == device["amount"] and rows[0].request_kind == "chat"


def test_completions_with_logprobs_and_token_ids(bundled):
    client, model = oai(bundled), bundled.replica.servicer.name
    done = client.completions.create(model=model, prompt="def f(x):", max_tokens=6, logprobs=2, temperature=0)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == done.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    ids = bundled.replica.servicer.tokenizer.encode("def f(x):").ids
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == done.choices[0].text
    streamed = client.completions.create(model=model, prompt="def f(x):", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_anthropic_messages_streamed_and_not(bundled):
    client, model = claude(bundled), bundled.replica.servicer.name
    messages = [{"role": "user", "content": "Add two numbers."}]
    greedy = {"temperature": 0}  # this SDK's create no longer names it; the API still takes it
    whole = client.messages.create(model=model, max_tokens=10, messages=messages, system="Be brief.", extra_body=greedy)
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    assert whole.usage.output_tokens >= 1 and whole.usage.model_extra["device_time"]["amount"] > 0
    with client.messages.stream(
        model=model, max_tokens=10, messages=messages, system="Be brief.", extra_body=greedy
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_json_schema_output_parses_through_both_sdks(bundled):
    model = bundled.replica.servicer.name
    done = oai(bundled).chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)
    reply = claude(bundled).messages.create(
        model=model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Answer."}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert reply.stop_reason == "end_turn"
    jsonschema.validate(json.loads(reply.content[0].text), SCHEMA)


def test_a_completion_takes_response_format_and_top_k_as_the_open_servers_do(bundled):
    """vLLM's and SGLang's completions take `response_format` and `top_k` (through the SDK's extra_body): here the
    output parses as its schema and is billed as a constrained call, and top_k 1 samples greedily."""
    client, model = oai(bundled), bundled.replica.servicer.name
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    raw = client.completions.with_raw_response.create(
        model=model, prompt="Answer: ", max_tokens=40, extra_body={"response_format": fmt}
    )
    done = raw.parse()
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)
    flushed(bundled)
    call_id = raw.headers["x-call-id"]
    (row,) = ledger_rows(bundled.config.ledger_url, f"SELECT * FROM usage_records WHERE call_id = '{call_id}'")
    assert row.request_kind == "constrained"
    ask = dict(model=model, prompt="def parse(argv):", max_tokens=8)
    sampled = client.completions.create(**ask, temperature=1.0, seed=3, extra_body={"top_k": 1})
    assert sampled.choices[0].text == client.completions.create(**ask, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**ask, extra_body={"guided_json": SCHEMA})
    assert refused.value.body["param"] == "guided_json"


@pytest.mark.parametrize("which", ["openai", "anthropic"])
def test_the_sdks_own_timeout_is_the_budget_and_an_explicit_header_wins(bundled, which):
    model = bundled.replica.servicer.name
    if which == "openai":
        client = oai(bundled, timeout=7.5)

        def headers(**extra):
            return client.chat.completions.with_raw_response.create(
                model=model, messages=CHAT, max_tokens=2, extra_headers=extra
            ).headers
    else:
        client = claude(bundled, timeout=6.0)

        def headers(**extra):
            return client.messages.with_raw_response.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}], extra_headers=extra
            ).headers

    own = headers()
    assert own["x-budget-source"] == "x-stainless-timeout"
    assert int(own["x-budget-ms"]) == (7500 if which == "openai" else 6000)
    explicit = headers(**{"X-Budget-Ms": "4321"})
    assert explicit["x-budget-source"] == "x-budget-ms" and explicit["x-budget-ms"] == "4321"


def test_bad_fields_are_refused_by_the_sdk_as_bad_requests_naming_them(bundled):
    model = bundled.replica.servicer.name
    with pytest.raises(openai.BadRequestError) as caught:
        oai(bundled, max_retries=3).chat.completions.create(model=model, messages=CHAT, max_tokens=4, n=2)
    assert caught.value.body["param"] == "n" and caught.value.body["error_info"]["reason"] == "INVALID_ARGUMENT"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(bundled).messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "x"}], stop_sequences=[""]
        )
    assert caught.value.body["error"]["param"] == "stop_sequences[0]"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url(bundled) + "/v1", api_key="zq_wrong").models.list()
    assert [m.id for m in oai(bundled).models.list()] == [model]
