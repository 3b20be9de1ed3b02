"""An HTTP body and its headers as the gRPC door's GenerateRequest: the budget's precedence, the key, labels,
class and attempt headers, each API's fields, the fields refused by name, and refusals naming the API's fields."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers
from zeroqueue.inference.v1 import inference_pb2 as pb

from services import errors
from services.http.bodies import ChatCompletionBody, CompletionBody, MessagesBody
from services.http.calls import DEFAULT_MAX_TOKENS, Api, call_of
from services.http.refusals import refusal
from services.inference.call import BudgetSource

CHAT = {
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
}


def chat(headers: dict | None = None, **body):
    return call_of(Api.CHAT, ChatCompletionBody.model_validate({**CHAT, **body}), Headers(headers or {}))


def refused(make) -> list[tuple[str, str]]:
    with pytest.raises(errors.InvalidArgument) as caught:
        make()
    return [(v.field, v.description) for v in caught.value.violations]


@pytest.mark.parametrize(
    ("headers", "budget_s", "source"),
    [
        ({}, None, BudgetSource.SERVER_DEFAULT),
        ({"x-stainless-timeout": "7.5"}, 7.5, BudgetSource.SDK_TIMEOUT),
        ({"x-stainless-read-timeout": "600"}, 600.0, BudgetSource.SDK_TIMEOUT),
        ({"x-stainless-timeout": "NOT_GIVEN"}, None, BudgetSource.SERVER_DEFAULT),  # an SDK's, not a budget
        ({"x-envoy-expected-rq-timeout-ms": "2500"}, 2.5, BudgetSource.ENVOY_TIMEOUT),
        ({"x-envoy-expected-rq-timeout-ms": "2500", "x-stainless-timeout": "3"}, 3.0, BudgetSource.SDK_TIMEOUT),
        ({"x-budget-ms": "1200", "x-stainless-timeout": "3"}, 1.2, BudgetSource.BUDGET_HEADER),
    ],
)
def test_the_budget_comes_from_the_explicit_header_then_the_sdk_then_envoy(headers, budget_s, source):
    call = chat(headers)
    assert (call.budget_s, call.source) == (budget_s, source)


@pytest.mark.parametrize("value", ["-5", "0", "1.5", "x", "9" * 20, "86400001"])
def test_a_bad_explicit_budget_is_refused_naming_its_header(value):
    assert [f for f, _ in refused(lambda: chat({"x-budget-ms": value}))] == ["x-budget-ms"]


def test_a_chat_call_maps_roles_parts_limits_and_labels():
    call = chat(
        {"x-api-key": "k1", "x-labels": "team=search", "x-stainless-retry-count": "2", "x-request-id": "r-1"},
        metadata={"cost_center": "cc-1"},
        seed=7,
        stop="\n",
        logprobs=True,
        top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    )
    r = call.request
    assert [(m.role, m.content) for m in r.messages] == [
        (pb.CHAT_ROLE_SYSTEM, "Be brief."),
        (pb.CHAT_ROLE_USER, "a\nb"),
    ]
    assert r.max_tokens == DEFAULT_MAX_TOKENS and r.seed == 7 and list(r.stop) == ["\n"] and r.request_id == "r-1"
    assert r.logprobs and r.top_logprobs == 3 and r.response_format.json_schema == '{"type":"object"}'
    assert dict(r.labels) == {"cost_center": "cc-1", "team": "search"}
    assert ("authorization", "Bearer k1") in call.metadata and ("x-stainless-retry-count", "2") in call.metadata
    assert call.api_field("response_format.json_schema") == "response_format.json_schema.schema"
    assert (
        call.api_field("labels.cost_center") == "metadata.cost_center"
        and call.api_field("request_id") == "x-request-id"
    )


def test_completions_take_text_or_token_ids_and_their_integer_logprobs():
    call = call_of(Api.COMPLETIONS, CompletionBody.model_validate({"prompt": [[1, 2, 3]], "logprobs": 2}), Headers({}))
    assert list(call.request.prompt_token_ids) == [1, 2, 3] and call.request.max_tokens == 16
    assert call.request.top_logprobs == 2 and call.api_field("prompt_token_ids[1]") == "prompt[1]"
    assert call.api_field("top_logprobs") == "logprobs"


def test_completions_take_response_format_and_both_openai_apis_take_top_k():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    body = CompletionBody.model_validate({"prompt": "x", "response_format": fmt, "top_k": 5})
    call = call_of(Api.COMPLETIONS, body, Headers({}))
    assert call.request.response_format.json_schema == '{"type":"object"}' and call.request.top_k == 5
    assert call.api_field("response_format.json_schema") == "response_format.json_schema.schema"
    body = CompletionBody.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert call_of(Api.COMPLETIONS, body, Headers({})).request.response_format.HasField("json_object")
    assert chat(top_k=40).request.top_k == 40 and chat().request.top_k == 0
    assert refused(lambda: chat(top_k=1 << 40))[0][0] == "top_k"


def test_anthropic_messages_put_the_system_first_and_name_fields_as_anthropic_does():
    body = MessagesBody.model_validate(
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "S"}],
            "messages": [{"role": "user", "content": "hi"}],
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u-1"},
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
        }
    )
    call = call_of(Api.MESSAGES, body, Headers({}))
    assert [m.role for m in call.request.messages] == [pb.CHAT_ROLE_SYSTEM, pb.CHAT_ROLE_USER]
    assert dict(call.request.labels) == {"user_id": "u-1"} and list(call.request.stop) == ["END"]
    assert call.api_field("messages[1].role") == "messages[0].role" and call.api_field("messages[0]") == "system"
    assert call.api_field("stop[0]") == "stop_sequences[0]"
    assert call.api_field("response_format.json_schema") == "output_config.format.schema"


def test_fields_this_replica_cannot_honour_are_refused_by_name_never_dropped():
    fields = [f for f, _ in refused(lambda: chat(n=2, tools=[{}], logit_bias={"1": 2}, presence_penalty=0.5))]
    assert fields == ["n", "tools", "logit_bias", "presence_penalty"]
    body = CompletionBody.model_validate({"prompt": "x", "echo": True, "best_of": 3, "suffix": "s"})
    assert [f for f, _ in refused(lambda: call_of(Api.COMPLETIONS, body, Headers({})))] == ["best_of", "echo", "suffix"]
    open_servers = {"min_p": 0.1, "repetition_penalty": 1.2, "guided_json": {}, "guided_choice": ["a"]}
    assert [f for f, _ in refused(lambda: chat(**open_servers))] == list(open_servers)
    assert len(chat(min_p=0, repetition_penalty=1.0).request.messages) == 2  # their neutral values are accepted
    assert refused(lambda: chat(seed=-1))[0][0] == "seed"
    assert refused(lambda: chat(max_tokens=1 << 40))[0][0] == "max_tokens"


def test_the_class_comes_from_service_tier_or_the_header_and_they_must_agree():
    assert chat({"x-service-class": "batch"}).request.service_class == "batch"
    assert chat(service_tier="auto").request.service_class == ""
    assert chat(service_tier="interactive").request.service_class == "interactive"
    assert refused(lambda: chat({"x-service-class": "batch"}, service_tier="interactive"))[0][0] == "service_tier"


def test_a_refusal_names_the_apis_field_in_the_apis_error_shape():
    call = call_of(
        Api.MESSAGES,
        MessagesBody.model_validate(
            {"model": "m", "max_tokens": 5, "system": "S", "messages": [{"role": "user", "content": "x"}]}
        ),
        Headers({}),
    )
    error = errors.InvalidArgument([errors.FieldViolation("messages[1].content", "too long")])
    status, headers, body = refusal(error, call, anthropic=True)
    assert status == 400 and body["type"] == "error" and body["error"]["param"] == "messages[0].content"
    assert int(headers["x-server-time"]) > 0
    overloaded = errors.Overloaded(retry_after_ms=1234, predicted_finish_ms=900, budget_ms=800)
    status, headers, body = refusal(overloaded, None, anthropic=False)
    assert status == 429 and headers["retry-after"] == "2" and headers["retry-after-ms"] == "1234"
    assert headers["x-should-retry"] == "false"  # the hint is past the 800 ms budget
    assert body["error"]["error_info"]["metadata"]["retry_within_budget"] == "false"
    status, headers, _ = refusal(errors.DeadlineInfeasible(5, 120), None, anthropic=False)
    assert status == 400 and headers["x-min-budget-ms"] == "120" and headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("error", "retry_here"),
    [
        (errors.NotServing("warming", {"state": "warming_up"}), "true"),
        (errors.NotServing("draining", {"state": "draining"}), "false"),
        (errors.DeviceFailed("gone"), "false"),
    ],
)
def test_a_replica_that_cannot_serve_is_503_and_says_whether_to_retry_it(error, retry_here):
    status, headers, body = refusal(error, None, anthropic=False)
    assert status == 503 and headers["retry-after"] == "1" and headers["x-should-retry"] == retry_here
    assert body["error"]["type"] == "overloaded_error" and body["error"]["code"] == error.reason
