"""Chat calls and constrained calls over gRPC, end to end: the bundled model's own template, a model without one,
ChatML's end of turn, a JSON Schema call that parses, its compile cached, a compile that cannot fit its budget refused
before any step, bad constraints refused naming their field, and the kind of each call on its usage record."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from zeroqueue.inference.v1 import inference_pb2 as pb

from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.chat import ChatMessage
from services.inference.device.executor import ExecutorConfig
from services.inference.generate_request import to_spec
from services.inference.serve_config import ServeConfig
from tests.checkpoints import CHATML_TOKENS
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_overload import wait_until
from tests.inference.test_usage import ledger_rows

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1}},
    "required": ["name", "qty"],
    "additionalProperties": False,
}
CHAT = [
    pb.ChatMessage(role=pb.CHAT_ROLE_SYSTEM, content="You write short Python functions."),
    pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="Add two numbers."),
]


def serve(path, **config) -> ServerThread:
    executor = ExecutorConfig(max_batch=8, max_seq_len=config.pop("max_seq_len", 256))
    return ServerThread(ServeConfig(str(path), port=0, executor=executor, **config)).start()


@pytest.fixture(scope="module")
def bundled():
    s = serve(BUNDLED_MODEL, dtype="bfloat16", max_seq_len=512)
    yield s
    s.stop()


def call(server, **fields) -> list[pb.GenerateResponse]:
    fields.setdefault("max_tokens", 40)
    fields.setdefault("temperature", 0.0)
    return list(server.stub().Generate(pb.GenerateRequest(**fields), timeout=60))


def text_of(replies) -> str:
    return "".join(r.chunk.text for r in replies if r.WhichOneof("kind") == "chunk")


def refusal(server, timeout: float = 30, **fields) -> grpc.RpcError:
    fields.setdefault("max_tokens", 8)
    with pytest.raises(grpc.RpcError) as caught:
        list(server.stub().Generate(pb.GenerateRequest(**fields), timeout=timeout))
    return caught.value


def test_the_bundled_model_serves_a_chat_call_through_its_own_template(bundled):
    model = bundled.stub().ListModels(pb.ListModelsRequest()).models[0]
    assert model.has_chat_template and set(model.response_formats) == {
        "json_object",
        "json_schema",
        "regex",
        "lark_grammar",
    }
    replies = call(bundled, messages=CHAT)
    assert replies[-1].final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    servicer = bundled.replica.servicer
    rendered = servicer.chat.render([ChatMessage("system", CHAT[0].content), ChatMessage("user", CHAT[1].content)])
    expected = servicer.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert replies[0].admission.prompt_tokens == len(expected) == replies[-1].final.usage.prompt_tokens


def test_a_json_schema_call_parses_and_its_compile_is_cached_for_the_next(bundled):
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], note={"enum": ["cached-test"]}))
    first = call(bundled, prompt="order = ", response_format=pb.ResponseFormat(json_schema=json.dumps(schema)))
    second = call(bundled, prompt="order = ", response_format=pb.ResponseFormat(json_schema=json.dumps(schema)))
    assert first[0].admission.compile_us > 0 and second[0].admission.compile_us == 0
    for replies in (first, second):
        if replies[-1].final.finish_reason == pb.FINISH_REASON_STOP:
            jsonschema.validate(json.loads(text_of(replies)), schema)
    assert text_of(first) == text_of(second)


def test_logprobs_come_with_every_streamed_token(bundled):
    replies = call(bundled, prompt="def f(x):", logprobs=True, top_logprobs=3, temperature=0.7, seed=5)
    chunks = [r.chunk for r in replies if r.WhichOneof("kind") == "chunk" and r.chunk.token_ids]
    assert chunks and all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    for c in chunks:
        for token_id, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == token_id and lp.logprob <= 0 and len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)


def test_a_compile_that_cannot_fit_the_budget_is_refused_before_any_step(bundled):
    compiler = bundled.replica.servicer.compiler
    base_us = compiler.cost.base_us
    compiler.cost.base_us = 60e6  # as if this replica compiled a grammar in a minute
    steps = bundled.replica.service.steps.steps_began_between(0, 2**62)
    try:
        schema = json.dumps(dict(SCHEMA, title="never-compiled"))
        error = refusal(bundled, prompt="x", response_format=pb.ResponseFormat(json_schema=schema), timeout=5)
    finally:
        compiler.cost.base_us = base_us
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = status_details(error)["ErrorInfo"]
    assert info.reason == "DEADLINE_INFEASIBLE" and int(info.metadata["compile_ms"]) >= 60_000
    assert bundled.replica.service.steps.steps_began_between(0, 2**62) == steps  # nothing ran
    assert not bundled.replica.service.in_flight


@pytest.mark.parametrize(
    "response_format, field",
    [
        (pb.ResponseFormat(json_schema='{"type": "strin"}'), "response_format.json_schema"),
        (pb.ResponseFormat(json_schema="{" * 5000), "response_format.json_schema"),
        (pb.ResponseFormat(json_schema=json.dumps({"enum": ["x" * 100] * 700})), "response_format.json_schema"),
        (pb.ResponseFormat(regex="a("), "response_format.regex"),
        (pb.ResponseFormat(lark_grammar="start: missing"), "response_format.lark_grammar"),
        (pb.ResponseFormat(), "response_format"),
    ],
)
def test_a_bad_constraint_is_refused_naming_its_field(bundled, response_format, field):
    error = refusal(bundled, prompt="x", response_format=response_format)
    assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
    assert [v.field for v in status_details(error)["BadRequest"].field_violations] == [field]


def test_messages_beside_a_prompt_and_bad_roles_are_refused_naming_the_field(bundled):
    error = refusal(bundled, prompt="x", messages=CHAT)
    assert [v.field for v in status_details(error)["BadRequest"].field_violations] == ["messages"]
    error = refusal(bundled, messages=[pb.ChatMessage(role=pb.CHAT_ROLE_UNSPECIFIED, content="hi")])
    assert [v.field for v in status_details(error)["BadRequest"].field_violations] == ["messages[0].role"]
    error = refusal(bundled, prompt="x", top_logprobs=21, logprobs=True)
    assert [v.field for v in status_details(error)["BadRequest"].field_violations] == ["top_logprobs"]


def test_a_model_without_a_template_refuses_messages_precisely(llama_dir):
    server = serve(llama_dir)
    try:
        assert not server.stub().ListModels(pb.ListModelsRequest()).models[0].has_chat_template
        error = refusal(server, messages=CHAT)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        (violation,) = status_details(error)["BadRequest"].field_violations
        assert violation.field == "messages" and "no chat template" in violation.description
        assert call(server, prompt="def f():", max_tokens=3)[-1].final.usage.completion_tokens == 3  # still serving
    finally:
        server.stop()


def test_a_chatml_call_ends_at_the_templates_end_of_turn(chatml_dir):
    server = serve(chatml_dir, engine_process=False)
    try:
        servicer = server.replica.servicer
        end_of_turn = servicer.tokenizer.token_to_id(CHATML_TOKENS[1])
        assert end_of_turn in servicer.chat_stop_token_ids
        request = pb.GenerateRequest(messages=CHAT, max_tokens=8)
        spec = server.run(to_spec(request, server.replica.service.card, servicer.limits, (), servicer))
        assert end_of_turn in spec.sampling.stop_token_ids
        rendered = "<|im_start|>system\nYou write short Python functions.<|im_end|>\n<|im_start|>user\nAdd two numbers."
        assert servicer.tokenizer.decode(list(spec.prompt_token_ids), skip_special_tokens=False).startswith(rendered)
        assert spec.prompt_token_ids.count(servicer.tokenizer.token_to_id(CHATML_TOKENS[0])) == 3  # one id each
    finally:
        server.stop()


def test_each_call_is_billed_with_its_kind(chatml_dir):
    server = serve(chatml_dir)
    try:
        constrained = pb.ResponseFormat(regex="[a-z]{2}")
        call(server, prompt="x", max_tokens=2)
        call(server, messages=CHAT, max_tokens=2)
        call(server, prompt="x", response_format=constrained)
        call(server, messages=CHAT, response_format=constrained)
    finally:
        server.stop()  # the outbox drains into the ledger
    rows = ledger_rows(
        server.config.ledger_url, "SELECT request_kind, COUNT(*) FROM usage_records GROUP BY request_kind"
    )
    assert dict(rows) == {"plain": 1, "chat": 1, "constrained": 1, "chat_constrained": 1}


def test_only_calls_that_ran_all_their_tokens_teach_admission_how_late_calls_finish(bundled):
    """A prediction prices all of max_tokens. A call that stopped before them (here its response_format's end)
    finished early by its own output, not by the device's speed: its small actual/predicted ratio would widen the
    deviation that stretches every slot's planned end and every refusal's hint (`Lateness`), so it is no evidence."""
    service = bundled.replica.service
    admission, seen = service.admission, []
    observe = admission.observe_finish

    def observed(predicted_ns: int, actual_ns: int) -> None:
        seen.append((predicted_ns, actual_ns))
        observe(predicted_ns, actual_ns)

    admission.observe_finish = observed
    try:
        assert call(bundled, prompt="def f(x):", max_tokens=4)[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
        wait_until(lambda: not service.in_flight, timeout=10)
        assert len(seen) == 1, seen  # a full run is evidence
        stopped = call(bundled, prompt="def f(x):", max_tokens=8, response_format=pb.ResponseFormat(regex="ab"))
        wait_until(lambda: not service.in_flight, timeout=10)
        final = stopped[-1].final
        assert final.finish_reason == pb.FINISH_REASON_STOP and final.usage.completion_tokens < 8, final
        assert len(seen) == 1, seen  # an early stop is not
    finally:
        del admission.observe_finish
