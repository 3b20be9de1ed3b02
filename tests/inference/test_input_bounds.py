"""Every input path is bounded before it costs, and every refusal is precise and small: the request's bytes, the
prompt's bytes and token count, malformed protobuf, retry headers, and the size of the status itself."""

from __future__ import annotations

import asyncio
import base64
import builtins
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from zeroqueue.inference.v1 import inference_pb2 as pb

from services import errors
from services.inference import generate_request as request_module
from services.inference.device.executor import ExecutorConfig
from services.inference.generate_request import RequestLimits, to_spec
from services.inference.replica import receive_limit
from services.inference.serve_config import ServeConfig
from services.metering.server import MAX_MESSAGE_BYTES as METERING_MAX_MESSAGE_BYTES
from tests.fuzz_generate import GENERATE, delimited, tag, varint
from tests.inference.harness import ServerThread, status_details
from tests.inference.test_server import PROMPT, generate, health, rejected

CONTEXT = 256
LIMITS = RequestLimits()
SERVING = health_pb2.HealthCheckResponse.SERVING
SOFT_METADATA_LIMIT = 8 << 10  # gRPC's default soft limit: above it a client drops some replies


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(ServeConfig(str(llama_dir), port=0, executor=ExecutorConfig(max_batch=4, max_seq_len=CONTEXT)))
    yield s.start()
    s.stop()


def raw_call(
    server,
    raw: bytes,
    key: str | None = None,
    metadata=(),
    method: str = GENERATE,
    streaming: bool = True,
    timeout: float = 30,
):
    """Sends `raw` as the request's bytes; returns the responses (bytes) or the grpc.RpcError."""
    channel = server.channel(key)
    call = (channel.unary_stream if streaming else channel.unary_unary)(method)
    try:
        replies = call(raw, timeout=timeout, metadata=metadata)
        return list(replies) if streaming else [replies]
    except grpc.RpcError as error:
        return error
    finally:
        channel.close()


def status_size(error: grpc.RpcError) -> int:
    """Bytes the status takes in the trailers: grpc-message percent-encoded, the details base64-encoded."""
    details = dict(error.trailing_metadata() or ()).get("grpc-status-details-bin", b"")
    message = urllib.parse.quote((error.details() or "").encode(), safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
    return len(message) + len(base64.b64encode(details))


def violations(error: grpc.RpcError) -> list[str]:
    found = status_details(error).get("BadRequest")
    return [v.field for v in found.field_violations] if found else []


def reason(error: grpc.RpcError) -> str:
    return status_details(error)["ErrorInfo"].reason


# --- the prompt's bytes and the request's bytes ---------------------------------------------------------------


class SpyTokenizer:
    """The real tokenizer, counting calls; `hold` makes encode_batch wait until released."""

    def __init__(self, tokenizer, hold: bool = False) -> None:
        self.tokenizer, self.calls = tokenizer, 0
        self.hold, self.started, self.release = hold, threading.Event(), threading.Event()

    def encode(self, text, **options):
        self.calls += 1
        return self.tokenizer.encode(text, **options)

    def encode_batch(self, texts, **options):
        self.calls += 1
        self.started.set()
        if self.hold:
            self.release.wait(30)
        return self.tokenizer.encode_batch(texts, **options)


@pytest.fixture
def spy(server):
    servicer = server.replica.servicer
    original = servicer.tokenizer
    servicer.tokenizer = SpyTokenizer(original)
    yield servicer.tokenizer
    servicer.tokenizer = original


def test_prompt_over_the_byte_cap_is_refused_untokenized(server, spy):
    cap = LIMITS.prompt_bytes(CONTEXT)
    assert cap == CONTEXT * LIMITS.max_bytes_per_token < LIMITS.max_prompt_bytes
    error = rejected(server.stub(), prompt="x" * (cap + 1))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE, error.details()
    assert violations(error) == ["prompt"] and f"at most {cap}" in error.details()
    assert spy.calls == 0
    # multibyte text counts its bytes: cap // 4 + 1 four-byte characters are over the cap
    error = rejected(server.stub(), prompt="🙂" * (cap // 4 + 1))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE and violations(error) == ["prompt"]
    assert spy.calls == 0


def test_request_larger_than_any_valid_one_is_refused_before_parsing(server, spy):
    bound = LIMITS.max_request_bytes(CONTEXT)
    assert server.replica.receive_bytes(CONTEXT) >= 4 << 20  # gRPC's default: the transport takes it to us
    error = rejected(server.stub(), prompt="x" * (bound + 1))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert reason(error) == "REQUEST_TOO_LARGE" and violations(error) == ["prompt"]
    assert status_details(error)["ErrorInfo"].metadata["max_bytes"] == str(bound)
    assert spy.calls == 0
    assert health(server) == SERVING


def test_the_receive_limit_fits_the_context():
    limits = RequestLimits()
    # a conversation as large as the prompt's bound (its messages' own bytes beside), a response_format, the rest
    conversation = CONTEXT * 32 + limits.max_messages * (96 + limits.max_name_chars)
    assert limits.max_request_bytes(CONTEXT) == conversation + limits.max_format_bytes + (64 << 10)
    assert receive_limit(limits, CONTEXT, hosts_metering=False) == 4 << 20  # gRPC's default, at least
    assert receive_limit(limits, CONTEXT, hosts_metering=True) == METERING_MAX_MESSAGE_BYTES
    assert receive_limit(limits, 1 << 20, hosts_metering=False) == (1 << 20) * 8 + (128 << 10)


def test_the_largest_valid_request_fits_its_bound_and_is_served(server):
    fields = dict(
        model=server.replica.service.card.name,
        prompt_token_ids=[319] * (CONTEXT - 2),
        max_tokens=1,
        stop=["🙂" * 64] * 8,
        request_id="r" * 128,
        temperature=0.5,
        top_p=0.5,
        top_k=7,
        seed=2**64 - 1,
        labels={f"k{i:02d}" + "k" * 60: "é" * 128 for i in range(16)},
        service_class="standard",
    )
    size = pb.GenerateRequest(**fields).ByteSize()
    assert size <= LIMITS.max_request_bytes(CONTEXT)
    messages = generate(server.stub(), prompt="", **fields)
    assert messages[-1].WhichOneof("kind") == "final"


def test_millions_of_token_ids_are_refused_at_once_and_health_answers_meanwhile(server):
    raw = pb.GenerateRequest(prompt_token_ids=[5] * 3_000_000, max_tokens=1).SerializeToString()
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(raw_call, server, raw)
        assert health(server) == SERVING
        error = answer.result(60)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert reason(error) == "REQUEST_TOO_LARGE" and violations(error) == ["prompt_token_ids"]
    assert health(server) == SERVING
    assert not server.replica.service.in_flight


def test_token_ids_past_the_context_are_counted_before_they_are_copied(server, monkeypatch):
    sizes = []

    def spy_tuple(items=()):
        sizes.append(len(items) if hasattr(items, "__len__") else -1)
        return builtins.tuple(items)

    monkeypatch.setattr(request_module, "tuple", spy_tuple, raising=False)
    error = rejected(server.stub(), prompt="", prompt_token_ids=[5] * 10_000)
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE and violations(error) == ["prompt_token_ids"]
    assert "10000 tokens" in error.details() and reason(error) == "INVALID_ARGUMENT"
    assert all(size < CONTEXT for size in sizes), sizes


def test_to_spec_counts_two_million_ids_without_copying_or_scanning(monkeypatch, llama_dir):
    message = pb.GenerateRequest(prompt_token_ids=[400] * 2_000_000, max_tokens=1)  # 400: outside the vocab
    copies = []
    monkeypatch.setattr(request_module, "tuple", lambda items=(): copies.append(len(items)) or (), raising=False)
    card = type("ModelCard", (), {"name": "m", "context_length": CONTEXT, "vocab_size": 320})()

    async def never(text):
        raise AssertionError("tokenized")

    with pytest.raises(errors.InvalidArgument) as info:
        asyncio.run(to_spec(message, card, LIMITS, (), never))
    assert [v.field for v in info.value.violations] == ["prompt_token_ids"]
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE and all(size < CONTEXT for size in copies), copies


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """The tokenizer is held mid-prompt: health must answer meanwhile, which it cannot if the loop waits."""
    servicer = server.replica.servicer
    original = servicer.tokenizer
    held = servicer.tokenizer = SpyTokenizer(original, hold=True)
    text = "def add(a, b):\n    return a + b\n" * 60  # ~1.9 KB: over the inline limit, under the cap
    assert LIMITS.inline_tokenize_chars < len(text) < LIMITS.prompt_bytes(CONTEXT)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(raw_call, server, pb.GenerateRequest(prompt=text, max_tokens=1).SerializeToString())
            assert held.started.wait(30)
            assert health(server) == SERVING and not answer.done()
            held.release.set()
            result = answer.result(60)
    finally:
        held.release.set()
        servicer.tokenizer = original
    num_tokens = len(original.encode(text).ids)
    if num_tokens < CONTEXT:
        assert not isinstance(result, grpc.RpcError), result
    else:
        assert result.code() == grpc.StatusCode.OUT_OF_RANGE and violations(result) == ["prompt"]
        assert f"{num_tokens} tokens" in result.details()


def test_short_prompts_are_tokenized_inline_and_served(server, spy):
    messages = generate(server.stub(), max_tokens=2, temperature=0.0)
    assert messages[-1].WhichOneof("kind") == "final" and spy.calls == 1


# --- malformed protobuf -----------------------------------------------------------------------------------------

VALID = pb.GenerateRequest(prompt=PROMPT, max_tokens=2, labels={"team": "a"}).SerializeToString()
MALFORMED = [
    (VALID[:-1], "labels"),  # truncated inside a map entry
    (VALID + tag(4, 0) + b"\x80\x80", "max_tokens"),  # truncated varint
    (VALID + tag(4, 0) + b"\xff" * 11, "max_tokens"),  # overlong varint
    (delimited(2, b"ok\xff\xfe"), "prompt"),  # invalid UTF-8
    (delimited(2, b"\xed\xa0\x80"), "prompt"),  # an encoded surrogate
    (delimited(1, b"\xc0\xaf") + delimited(2, b"hi"), "model"),  # an overlong encoding
    (delimited(9, b"\xff"), "stop"),
    (delimited(10, b"\xe6\x9d"), "request_id"),  # cut mid-character
    (delimited(11, delimited(1, b"\xff") + delimited(2, b"v")), "labels.key"),
    (delimited(11, delimited(1, b"team") + delimited(2, b"\xff")), "labels.value"),
    (VALID + tag(2, 2) + varint(1000) + b"abc", "prompt"),  # length past the end
    (VALID + tag(7, 7), "top_k"),  # a wire type that does not exist
    (b"\x00", None),  # field number 0
    (b"\xff" * 11, None),  # a tag that never ends
    (delimited(3, b"\x05\x80"), None),  # packed ids with a truncated varint
]


@pytest.mark.parametrize("raw,field", MALFORMED, ids=[f"{i}-{c[1]}" for i, c in enumerate(MALFORMED)])
def test_malformed_bytes_are_invalid_argument_with_error_info(server, raw, field):
    error = raw_call(server, raw, key="")  # before authentication: no key needed to hear it
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    info = status_details(error)["ErrorInfo"]
    assert info.reason == "MALFORMED_REQUEST"
    assert info.metadata["message_type"] == "zeroqueue.inference.v1.GenerateRequest"
    assert violations(error) == ([field] if field else [])
    assert "not a valid zeroqueue.inference.v1.GenerateRequest" in error.details()
    assert health(server) == SERVING


def test_wrong_wire_types_parse_as_unknown_fields_and_are_validated(server):
    # protobuf keeps a known field number with the wrong wire type as an unknown field: the prompt is then unset
    error = raw_call(server, tag(2, 0) + varint(7) + tag(4, 0) + varint(2))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and violations(error) == ["prompt"]
    replies = raw_call(server, VALID + tag(2, 5) + b"\x00\x00\x80\x3f")
    assert pb.GenerateResponse.FromString(replies[-1]).WhichOneof("kind") == "final"


def test_every_method_parses_its_own_bytes(server):
    error = raw_call(server, b"\xff\xff", method="/zeroqueue.inference.v1.Inference/ListModels", streaming=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(error) == "MALFORMED_REQUEST"
    (reply,) = raw_call(server, b"", method="/zeroqueue.inference.v1.Inference/ListModels", streaming=False)
    assert pb.ListModelsResponse.FromString(reply).models[0].context_length == CONTEXT
    # the Metering service this replica hosts, too
    error = raw_call(server, b"\xff\xff", method="/zeroqueue.metering.v1.Metering/WhoAmI", streaming=False)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and reason(error) == "MALFORMED_REQUEST"


# --- retry headers ----------------------------------------------------------------------------------------------

BAD_COUNTS = ["9" * 4301, "9" * 6000, "1234567", "-1", "abc", "", "1.5", "+1"]


@pytest.mark.parametrize("value", BAD_COUNTS, ids=[v[:8] + f"-{len(v)}" for v in BAD_COUNTS])
def test_a_retry_header_that_is_no_count_is_refused_naming_it(server, value):
    error = rejected(server.stub(), metadata=(("x-retry-attempt", value),))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert violations(error) == ["x-retry-attempt"] and status_size(error) < SOFT_METADATA_LIMIT


def test_headers_up_to_16_kib_always_reach_the_handler(server):
    # gRPC's default soft limit (8 KiB) would refuse about half of these at random, RESOURCE_EXHAUSTED and bare
    for _ in range(10):
        error = rejected(server.stub(), metadata=(("x-retry-attempt", "9" * 6000), ("x-retry-attempt", "8" * 6000)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()[:100]
        assert violations(error) == ["x-retry-attempt", "x-retry-attempt"]


@pytest.mark.parametrize("value", ["9" * 6000, "abc", "2"])
def test_grpc_previous_rpc_attempts_is_gRPCs_own_and_never_fails_a_call(server, value):
    # gRPC's core consumes this header (it never reaches invocation_metadata in grpcio 1.85); whatever it says,
    # the call is answered as if it were not there
    messages = generate(server.stub(), max_tokens=1, metadata=(("grpc-previous-rpc-attempts", value),))
    assert messages[-1].WhichOneof("kind") == "final"


def test_retry_headers_parse_with_a_length_cap():
    v = request_module._Violations()
    assert request_module._retry_attempt((("x-retry-attempt", "2"), ("grpc-previous-rpc-attempts", "5")), v) == 5
    assert not v.items
    headers = (("grpc-previous-rpc-attempts", "9" * 5000), ("x-retry-attempt", "٣"))
    assert request_module._retry_attempt(headers, v) == 0
    assert [i.field for i in v.items] == ["grpc-previous-rpc-attempts", "x-retry-attempt"]
    assert all(len(i.description) < 200 for i in v.items)


def test_a_retry_count_of_up_to_six_digits_is_taken(server):
    for value in ("0", "3", "999999"):
        messages = generate(server.stub(), max_tokens=1, metadata=(("x-retry-attempt", value),))
        assert messages[-1].WhichOneof("kind") == "final"


# --- the status stays small -------------------------------------------------------------------------------------

HUGE_ECHOES = [
    dict(model="m" * 60_000),
    dict(request_id="r" * 60_000),
    dict(stop=["y" * 65] * 1000),
    dict(stop=["y" * 5000] * 8),
    dict(stop=[""] * 8),
    dict(labels={f"Bad Key {i} " + "K" * 3000: "x" for i in range(16)}),
    dict(labels={f"key{i}": "v" for i in range(1000)}),
    dict(labels={"k" * 60_000: "v"}),
    dict(labels={f"team{i}": "\x00" * 128 for i in range(16)}),
    dict(service_class="é" * 20_000),
    dict(service_class="\x00" * 40_000),
    dict(
        model="é" * 20_000,
        service_class="G" * 33,
        request_id="!" * 200,
        max_tokens=-1,
        temperature=float("nan"),
        top_p=2.0,
        top_k=-1,
        stop=["🙂" * 65] * 8,
        labels={f"B{i}" + "é" * 500: "x" for i in range(16)},
        prompt="",
        prompt_token_ids=[-1] * 10,
    ),
]


@pytest.mark.parametrize("fields", HUGE_ECHOES, ids=[",".join(sorted(f)) for f in HUGE_ECHOES])
def test_status_stays_small_whatever_the_request_echoes(server, fields):
    error = rejected(server.stub(), **fields)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details()[:200])
    assert violations(error) and status_size(error) < SOFT_METADATA_LIMIT
    assert len(violations(error)) <= errors.MAX_VIOLATIONS + 1
    assert all(len(field) <= 80 for field in violations(error))


# --- sampling ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 1.2e-38, 1e-30, 5e-5])
def test_a_vanishing_temperature_samples_as_greedy(server, temperature):
    greedy = generate(server.stub(), max_tokens=6, temperature=0.0)
    tiny = generate(server.stub(), max_tokens=6, temperature=temperature, seed=1)
    assert tokens(tiny) == tokens(greedy) and len(tokens(greedy)) == 6


def tokens(messages) -> list[int]:
    return [t for m in messages if m.WhichOneof("kind") == "chunk" for t in m.chunk.token_ids]
