"""Chat, constrained and logprob calls through the SDK: the protobuf it builds (no server), what it refuses before
sending, the result types read from constructed responses, and, against fake replicas through both clients, that
retries resend the same conversation and response_format."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from google.protobuf import json_format
from zeroqueue.inference.v1 import inference_pb2 as pb

from services.client import (
    Client,
    DeadlineInfeasible,
    IncompleteOutput,
    Message,
    Rejected,
    RetryConfig,
    TokenLogprob,
    TopLogprob,
)
from services.client.errors import error_for
from services.client.failure import parse_failure
from services.client.request import build_request
from services.client.results import CallReport, admission_from, chunk_from, models_from, result_from
from tests.client.fakes import Fail, FakeReplicas, Reject, Serve, VirtualTime, run_call

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "args": {"type": "array"}}}
CHAT = [
    {"role": "system", "content": "Helpers."},
    Message("user", "parse argv"),
    {"role": "tool", "content": "ok", "name": "ls"},
]


def test_messages_become_chat_messages_with_their_roles_and_names():
    request = build_request(None, 16, messages=CHAT)
    assert [(m.role, m.content, m.name) for m in request.messages] == [
        (pb.CHAT_ROLE_SYSTEM, "Helpers.", ""),
        (pb.CHAT_ROLE_USER, "parse argv", ""),
        (pb.CHAT_ROLE_TOOL, "ok", "ls"),
    ]
    assert request.prompt == "" and not request.prompt_token_ids and request.max_tokens == 16
    assert not request.HasField("response_format") and not request.logprobs and request.request_id


@pytest.mark.parametrize(
    ("response_format", "field", "text"),
    [
        ({"type": "json_object"}, "json_object", None),
        # OpenAI's wrapper; the dict goes compactly, in its own key order (the order of the generated properties)
        ({"type": "json_schema", "json_schema": {"name": "f", "strict": True, "schema": SCHEMA}}, "json_schema", None),
        ({"type": "json_schema", "schema": SCHEMA}, "json_schema", None),
        ({"type": "json_schema", "schema": '{"type": "array"}'}, "json_schema", '{"type": "array"}'),
        ({"type": "regex", "regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"type": "lark_grammar", "grammar": 'start: "a"'}, "lark_grammar", 'start: "a"'),
    ],
)
def test_each_response_format_fills_its_oneof(response_format, field, text):
    request = build_request("def f():", 8, response_format=response_format)
    assert request.response_format.WhichOneof("format") == field and request.prompt == "def f():"
    if field == "json_schema" and text is None:
        sent = request.response_format.json_schema
        assert sent == '{"type":"object","properties":{"name":{"type":"string"},"args":{"type":"array"}}}'
        assert list(json.loads(sent)["properties"]) == ["name", "args"]
    elif text is not None:
        assert getattr(request.response_format, field) == text


def test_logprobs_and_the_prompt_kinds_go_as_asked():
    request = build_request([5, 6], 4, logprobs=True, top_logprobs=3, temperature=0.0)
    assert request.logprobs and request.top_logprobs == 3 and list(request.prompt_token_ids) == [5, 6]
    assert request.HasField("temperature") and request.temperature == 0.0
    assert not build_request("x", 4).logprobs and build_request("x", 4).top_logprobs == 0


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "exactly one of prompt"),
        ({"prompt": None}, "exactly one of prompt"),
        ({"prompt": None, "messages": []}, "non-empty list"),
        ({"prompt": None, "messages": {"role": "user", "content": "hi"}}, "non-empty list"),
        ({"prompt": None, "messages": [{"role": "human", "content": "hi"}]}, "messages[0]: role must be one of"),
        ({"prompt": None, "messages": [{"role": "user", "content": "a"}, {"role": "user"}]}, "messages[1]: needs role"),
        ({"prompt": None, "messages": [{"role": "user", "content": "a", "tone": "x"}]}, "messages[0]: needs role"),
        ({"prompt": None, "messages": [{"role": "user", "content": 3}]}, "messages[0]: content and name"),
        ({"prompt": None, "messages": ["hi"]}, "messages[0]: a dict"),
        ({"response_format": {"type": "xml"}}, "type must be one of json_object"),
        ({"response_format": "json"}, "a dict with a type"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "takes ['type'], not ['schema']"),
        ({"response_format": {"type": "json_schema"}}, "exactly one of"),
        ({"response_format": {"type": "json_schema", "schema": {}, "json_schema": {"schema": {}}}}, "exactly one"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "f"}}}, "holding the \"schema\""),
        ({"response_format": {"type": "json_schema", "schema": 3}}, "a JSON Schema is a dict"),
        ({"response_format": {"type": "regex", "regex": ""}}, "non-empty string 'regex'"),
        ({"response_format": {"type": "lark_grammar", "lark_grammar": "start: x"}}, "not ['lark_grammar']"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs=True"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be 0 to 20"),
    ],
)
def test_a_form_the_server_would_refuse_is_a_value_error_before_any_call(kwargs, says):
    kwargs.setdefault("prompt", "x")
    with FakeReplicas([[]]) as fakes, Client(fakes.addresses, api_key="k") as client:
        with pytest.raises(ValueError, match=re.escape(says)):
            client.generate(deadline_ms=1_000, **kwargs)
        assert fakes[0].calls == []


def test_generate_without_a_deadline_is_a_type_error():
    with Client(["127.0.0.1:1"], api_key="k") as client:
        with pytest.raises(TypeError, match="deadline_ms"):
            client.generate(messages=[{"role": "user", "content": "hi"}])


def _response(text: str) -> pb.GenerateResponse:
    return json_format.Parse(text, pb.GenerateResponse())


def test_chunks_and_the_result_read_logprobs_and_the_admission_its_compile_time():
    admission = admission_from(_response('{"admission": {"requestId": "r", "compileUs": "2500"}}').admission, "e:1")
    assert admission.compile_us == 2500 and admission.endpoint == "e:1"
    first = chunk_from(
        _response(
            '{"chunk": {"tokenIds": [7, 8], "text": "{}", "logprobs": ['
            '{"tokenId": 7, "logprob": -0.5, "top": [{"tokenId": 7, "logprob": -0.5}, {"tokenId": 9, "logprob": -2}]},'
            '{"tokenId": 8, "logprob": -0.25}]}}'
        ).chunk
    )
    assert first.logprobs == (
        TokenLogprob(7, -0.5, (TopLogprob(7, -0.5), TopLogprob(9, -2.0))),
        TokenLogprob(8, -0.25, ()),
    )
    plain = chunk_from(_response('{"chunk": {"tokenIds": [3], "text": "x"}}').chunk)
    assert plain.logprobs == ()
    final = _response('{"final": {"finishReason": "FINISH_REASON_STOP"}}').final
    result = result_from(final, admission, [first, plain], CallReport("r", (), 0.0))
    assert result.logprobs == first.logprobs and result.token_ids == (7, 8, 3)
    assert result.admission.compile_us == 2500


def _result(text: str, finish: str):
    final = _response(f'{{"final": {{"finishReason": "{finish}"}}}}').final
    admission = admission_from(pb.Admission(request_id="r"), "e")
    chunk = chunk_from(pb.TokenChunk(token_ids=[1, 2], text=text))
    return result_from(final, admission, [chunk], CallReport("r", (), 0.0))


def test_json_parses_a_whole_output_and_refuses_a_cut_one():
    assert _result('{"a": [1, 2]}', "FINISH_REASON_STOP").json() == {"a": [1, 2]}
    with pytest.raises(IncompleteOutput, match="finish_reason 'length'.*after 2 tokens"):
        _result('{"a": [1,', "FINISH_REASON_LENGTH").json()
    with pytest.raises(json.JSONDecodeError):
        _result("def f():", "FINISH_REASON_STOP").json()


def test_model_info_says_whether_chat_and_which_formats_are_served():
    reply = pb.ListModelsResponse(
        models=[
            pb.ModelInfo(name="m", has_chat_template=True, response_formats=["json_object", "regex"]),
            pb.ModelInfo(),
        ]
    )
    chat, bare = models_from(reply)
    assert chat.has_chat_template and chat.response_formats == ("json_object", "regex")
    assert not bare.has_chat_template and bare.response_formats == ()


def _error(code: grpc.StatusCode, reason: str, metadata: dict):
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status(code=code.value[0])
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, metadata=metadata))
    failure = parse_failure(code, "m", [("grpc-status-details-bin", status.SerializeToString())])
    return error_for(failure, CallReport("r", (), 0.0))


def test_a_compile_past_the_budget_and_a_compile_overload_say_so():
    error = _error(
        grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE", {"compile_ms": "850", "min_budget_ms": "900"}
    )
    assert isinstance(error, DeadlineInfeasible) and error.compile_ms == 850 and error.min_budget_ms == 900
    plain = _error(grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_INFEASIBLE", {"min_budget_ms": "900"})
    assert plain.compile_ms is None
    busy = _error(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", {"cause": "compiles"})
    assert isinstance(busy, Rejected) and busy.cause == "compiles"


@pytest.fixture(params=["sync", "async"])
def kind(request) -> str:
    return request.param


def test_a_chat_call_with_a_schema_and_logprobs_streams_them_and_parses(kind):
    texts = ('{"name": ', '"f"}')
    with FakeReplicas([[Serve(num_chunks=2, texts=texts, finish=pb.FINISH_REASON_STOP, compile_us=4200)]]) as fakes:
        out = run_call(
            kind,
            fakes.addresses,
            VirtualTime(),
            prompt=None,
            messages=CHAT,
            response_format={"type": "json_schema", "schema": SCHEMA},
            logprobs=True,
            top_logprobs=2,
        )
    assert out.error is None and out.result.json() == {"name": "f"}
    assert out.result.admission.compile_us == 4200 and out.result.finish_reason == "stop"
    assert [c.logprobs for c in out.chunks] == [
        (TokenLogprob(10, -0.5, (TopLogprob(100, -0.25), TopLogprob(101, -1.25))),),
        (TokenLogprob(11, -1.5, (TopLogprob(100, -0.25), TopLogprob(101, -1.25))),),
    ]
    assert out.result.logprobs == tuple(lp for c in out.chunks for lp in c.logprobs)
    (seen,) = fakes[0].calls
    assert [m.role for m in seen.request.messages] == [pb.CHAT_ROLE_SYSTEM, pb.CHAT_ROLE_USER, pb.CHAT_ROLE_TOOL]
    assert seen.request.top_logprobs == 2 and seen.request.response_format.WhichOneof("format") == "json_schema"


@pytest.mark.parametrize(
    ("script", "retry", "model"),
    [
        ([Reject(40), Fail(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING"), Serve()], None, ""),
        ([Fail(grpc.StatusCode.UNAVAILABLE, "NOT_SERVING"), Serve()], RetryConfig(fallback_model="small"), "big"),
    ],
    ids=["refused-then-down", "fallback-model"],
)
def test_every_retry_resends_the_same_conversation_format_and_logprobs(kind, script, retry, model):
    with FakeReplicas([script]) as fakes:
        out = run_call(
            kind,
            fakes.addresses,
            VirtualTime(),
            retry=retry,
            prompt=None,
            messages=CHAT,
            response_format={"type": "regex", "regex": "[a-z]+"},
            logprobs=True,
            model=model,
            rand=lambda: 0.0,
        )
    calls = fakes[0].calls
    assert out.result is not None and len(calls) == len(script)
    first = calls[0].request
    for seen in calls[1:]:
        assert seen.retry_attempt is not None
        assert list(seen.request.messages) == list(first.messages) and len(first.messages) == 3
        assert seen.request.response_format == first.response_format and seen.request.response_format.regex
        assert seen.request.logprobs and seen.request.request_id == first.request_id
    if retry is not None:
        assert [c.request.model for c in calls] == ["big", "small"]
