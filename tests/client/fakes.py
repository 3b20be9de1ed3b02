"""Fake replicas for SDK tests: a grpc.aio Inference servicer that answers from a script and remembers every
call it saw (metadata, request, the deadline it carried). Real loopback ports, one event loop thread."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from services import errors
from services.client import AsyncClient, CallReport, Chunk, Client, Result, RetryConfig, ZeroQueueError
from services.status import RpcStatus, status_for, to_grpc_status


@dataclass(frozen=True)
class Reject:
    """RESOURCE_EXHAUSTED as the real replica sends it; `skew_s` shifts its x-server-time."""

    hint_ms: int
    skew_s: float = 0.0


@dataclass(frozen=True)
class Refuse:
    """The real replica's refusal for load (`errors.Overloaded`), on the wire as its status map sends it."""

    error: errors.Overloaded


@dataclass(frozen=True)
class Fail:
    code: grpc.StatusCode
    reason: str = ""
    metadata: dict = field(default_factory=dict)
    violations: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Serve:
    """Admission, `num_chunks` token chunks, then a final message, or the status `then_fail` instead of it. Chunk i
    holds token 10 + i and the text `texts[i]` (default "t<i>"), and, when the call asked for logprobs, that token's
    logprob -0.5 - i with `top_logprobs` alternatives (ids 100, 101, ...). A call with a response_format is admitted
    with `compile_us` and ends `finish`."""

    num_chunks: int = 2
    then_fail: grpc.StatusCode | None = None
    texts: tuple[str, ...] = ()
    compile_us: int = 1500
    finish: int = pb.FINISH_REASON_LENGTH


def _chunk(request: pb.GenerateRequest, answer: Serve, i: int, now_us: int) -> pb.TokenChunk:
    chunk = pb.TokenChunk(token_ids=[10 + i], text=answer.texts[i] if answer.texts else f"t{i}", emitted_at_us=now_us)
    if request.logprobs:
        top = [pb.TopLogprob(token_id=100 + k, logprob=-0.25 - k) for k in range(request.top_logprobs)]
        chunk.logprobs.append(pb.TokenLogprob(token_id=10 + i, logprob=-0.5 - i, top=top))
    return chunk


@dataclass(frozen=True)
class SeenCall:
    request: pb.GenerateRequest
    metadata: dict
    time_remaining_s: float | None
    at_s: float  # monotonic, when the call arrived

    @property
    def retry_attempt(self) -> str | None:
        return self.metadata.get("x-retry-attempt")


def _status(answer: Reject | Refuse | Fail) -> grpc.Status:
    if isinstance(answer, Refuse):
        return to_grpc_status(status_for(answer.error))
    if isinstance(answer, Reject):
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(answer.hint_ms)
        server_time_us = int((time.time() + answer.skew_s) * 1e6)
        return to_grpc_status(
            RpcStatus(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "overloaded",
                [
                    error_details_pb2.ErrorInfo(reason="OVERLOADED", domain="zeroqueue.dev"),
                    error_details_pb2.RetryInfo(retry_delay=delay),
                ],
                (
                    ("retry-after-ms", str(answer.hint_ms)),
                    ("grpc-retry-pushback-ms", str(answer.hint_ms)),
                    ("x-server-time", str(server_time_us)),
                ),
            )
        )
    details = [
        error_details_pb2.ErrorInfo(
            reason=answer.reason or answer.code.name, domain="zeroqueue.dev", metadata=answer.metadata
        )
    ]
    if answer.violations:
        details.append(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in answer.violations
                ]
            )
        )
    return to_grpc_status(
        RpcStatus(
            answer.code, f"scripted {answer.code.name}", details, (("x-server-time", str(time.time_ns() // 1000)),)
        )
    )


class ScriptedInference(inference_pb2_grpc.InferenceServicer):
    def __init__(self, script: list) -> None:
        self.script = deque(script)
        self.calls: list[SeenCall] = []
        self.address = ""

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.calls.append(
            SeenCall(request, dict(context.invocation_metadata()), context.time_remaining(), time.monotonic())
        )
        answer = self.script.popleft() if self.script else Serve()
        if not isinstance(answer, Serve):
            await context.abort_with_status(_status(answer))
        now_us = time.time_ns() // 1000
        yield pb.GenerateResponse(
            admission=pb.Admission(
                request_id=request.request_id,
                received_at_us=now_us,
                dispatched_at_us=now_us,
                budget_ms=1000,
                prompt_tokens=3,
                compile_us=answer.compile_us if request.HasField("response_format") else 0,
            )
        )
        for i in range(answer.num_chunks):
            yield pb.GenerateResponse(chunk=_chunk(request, answer, i, now_us))
        if answer.then_fail is not None:
            await context.abort_with_status(_status(Fail(answer.then_fail)))
        yield pb.GenerateResponse(
            final=pb.Final(
                finish_reason=answer.finish,
                timings=pb.Timings(received_at_us=now_us, total_us=500, ttft_us=100, deadline_met=True),
                usage=pb.Usage(
                    prompt_tokens=3,
                    completion_tokens=answer.num_chunks,
                    sm_us=1234,
                    unit="core_us",
                    device_kind="cpu",
                    num_compute_units=1,
                ),
            )
        )

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):
        return pb.ListModelsResponse(
            models=[
                pb.ModelInfo(
                    name="fake",
                    context_length=256,
                    vocab_size=300,
                    max_batch=4,
                    state=pb.WARMUP_STATE_READY,
                    has_chat_template=True,
                    response_formats=["json_object", "json_schema", "regex", "lark_grammar"],
                )
            ]
        )


class FakeReplicas:
    """`with FakeReplicas([script_a, script_b]) as fakes:` fakes.addresses, fakes[i].calls."""

    def __init__(self, scripts: list[list], credentials: grpc.ServerCredentials | None = None) -> None:
        self.servicers = [ScriptedInference(s) for s in scripts]
        self.credentials = credentials
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.servers: list[grpc.aio.Server] = []

    def __enter__(self) -> FakeReplicas:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        for servicer in self.servicers:
            server = grpc.aio.server()
            inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
            port = (
                server.add_secure_port("127.0.0.1:0", self.credentials)
                if self.credentials
                else server.add_insecure_port("127.0.0.1:0")
            )
            await server.start()
            servicer.address = f"127.0.0.1:{port}"
            self.servers.append(server)

    def __exit__(self, *exc_info: object) -> None:
        async def stop() -> None:
            for server in self.servers:
                await server.stop(grace=0)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __getitem__(self, i: int) -> ScriptedInference:
        return self.servicers[i]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servicers]

    @property
    def all_calls(self) -> list[SeenCall]:
        return sorted((c for s in self.servicers for c in s.calls), key=lambda c: c.at_s)


class VirtualTime:
    """A monotonic clock that sleeping advances without waiting, so a test sees the exact delays asked for."""

    def __init__(self) -> None:
        self.offset_s = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return time.monotonic() + self.offset_s

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.offset_s += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


@dataclass
class Outcome:
    chunks: list[Chunk]
    result: Result | None
    error: ZeroQueueError | None
    report: CallReport


def run_call(
    kind: str,
    addresses: list[str],
    vt: VirtualTime,
    retry: RetryConfig | None = None,
    rand=random.random,
    wall_clock=time.time,
    prompt="def f():",
    **options,
) -> Outcome:
    """One call through the sync or the asyncio client (`kind`), sleeping on `vt`: its chunks, and its result or
    error, and report. `options` go to generate()."""
    options.setdefault("deadline_ms", 2_000)
    options.setdefault("max_tokens", 4)
    if kind == "sync":
        with Client(
            addresses, api_key="key-1", retry=retry, clock=vt.clock, sleep=vt.sleep, rand=rand, wall_clock=wall_clock
        ) as client:
            generation, chunks = client.generate(prompt, **options), []
            try:
                for chunk in generation:
                    chunks.append(chunk)
            except ZeroQueueError as error:
                return Outcome(chunks, None, error, error.report)
            return Outcome(chunks, generation.result, None, generation.report)

    async def main() -> Outcome:
        async with AsyncClient(
            addresses,
            api_key="key-1",
            retry=retry,
            clock=vt.clock,
            sleep=vt.async_sleep,
            rand=rand,
            wall_clock=wall_clock,
        ) as client:
            generation, chunks = client.generate(prompt, **options), []
            try:
                async for chunk in generation:
                    chunks.append(chunk)
            except ZeroQueueError as error:
                return Outcome(chunks, None, error, error.report)
            return Outcome(chunks, generation.result, None, generation.report)

    return asyncio.run(main())
