"""The asyncio client, same semantics as client.Client. Construct it inside the event loop that uses it.

async with AsyncClient(["10.0.0.1:50051", "10.0.0.2:50051"], api_key=key) as client:
    generation = client.generate("def fib(n):", deadline_ms=2_000, max_tokens=64)
    async for chunk in generation:
        print(chunk.text, end="")
    print(generation.result.usage, generation.report.num_attempts)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from .call import Attempt, CallDriver
from .client import channel_credentials
from .failure import failure_from_rpc
from .request import Message, budget_ms, build_request
from .results import Admission, CallReport, Chunk, ModelInfo, Result, models_from
from .retry import Retrier, RetryConfig


class AsyncGeneration(AsyncIterator[Chunk]):
    """Async-iterates the call's chunks; `result` holds the Result once it ends, `report` its attempts.
    Cancelling the consuming task, or aclose(), cancels the call."""

    def __init__(self, client: AsyncClient, request: pb.GenerateRequest, deadline_ms: float) -> None:
        self._client, self._request, self._deadline_ms = client, request, deadline_ms
        self._driver: CallDriver | None = None
        self._stream = self._run()
        self.result: Result | None = None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def report(self) -> CallReport | None:
        return self._driver.report() if self._driver is not None else None

    @property
    def admission(self) -> Admission | None:
        """The replica's admission (budget, predicted finish, compile_us) once the call is admitted."""
        return self._driver.admission if self._driver is not None else None

    async def __anext__(self) -> Chunk:
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def collect(self) -> Result:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def _run(self) -> AsyncIterator[Chunk]:
        driver = self._driver = self._client._driver(self._request, self._deadline_ms)
        call, attempt = await self._client._admit(driver)
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise driver.protocol_error("the stream ended without a final message")
                kind = message.WhichOneof("kind")
                if kind == "chunk":
                    yield driver.chunk(message.chunk)
                elif kind == "final":
                    self.result = driver.result(message.final)
                    return
        except grpc.aio.AioRpcError as error:
            raise driver.failed(attempt, failure_from_rpc(error, True, driver.num_tokens)) from error
        finally:
            if self.result is None:
                call.cancel()


class AsyncClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        api_key: str,
        tls: bool | grpc.ChannelCredentials = False,
        *,
        retry: RetryConfig | None = None,
        channel_options: Sequence[tuple[str, object]] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint")
        self.endpoints = tuple(endpoints)
        self.api_key = api_key
        credentials = channel_credentials(tls)
        options = list(channel_options)
        self._channels = [
            grpc.aio.secure_channel(e, credentials, options=options)
            if credentials
            else grpc.aio.insecure_channel(e, options=options)
            for e in self.endpoints
        ]
        self._stubs = [inference_pb2_grpc.InferenceStub(c) for c in self._channels]
        self.retrier = Retrier(retry or RetryConfig(), len(self.endpoints), clock, wall_clock, rand)
        self._sleep = sleep

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        deadline_ms: float | None = None,
        *,
        messages: Sequence[Message | Mapping[str, str]] | None = None,
        response_format: Mapping[str, object] | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        max_tokens: int = 64,
        model: str = "",
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        request_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        service_class: str = "",
    ) -> AsyncGeneration:
        """As Client.generate (its docstring says what each argument sends); iterate with `async for`."""
        deadline_ms = budget_ms(deadline_ms)
        request = build_request(
            prompt,
            max_tokens,
            messages=messages,
            response_format=response_format,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            model=model,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            request_id=request_id,
            labels=labels,
            service_class=service_class,
        )
        return AsyncGeneration(self, request, deadline_ms)

    async def complete(
        self, prompt: str | Sequence[int] | None = None, deadline_ms: float | None = None, **options
    ) -> Result:
        """generate(...) run to its end: its Result."""
        return await self.generate(prompt, deadline_ms, **options).collect()

    async def list_models(self, endpoint: int = 0, timeout_s: float = 5.0) -> list[ModelInfo]:
        reply = await self._stubs[endpoint].ListModels(
            pb.ListModelsRequest(), timeout=timeout_s, metadata=(("authorization", f"Bearer {self.api_key}"),)
        )
        return models_from(reply)

    def _driver(self, request: pb.GenerateRequest, deadline_ms: float) -> CallDriver:
        return CallDriver(self.retrier, self.endpoints, self.api_key, request, deadline_ms)

    async def _admit(self, driver: CallDriver) -> tuple[grpc.aio.UnaryStreamCall, Attempt]:
        while True:
            if driver.delay_s > 0:
                await self._sleep(driver.delay_s)
            attempt = driver.begin()
            call = self._stubs[attempt.endpoint].Generate(
                attempt.request, timeout=attempt.timeout_s, metadata=attempt.metadata
            )
            try:
                first = await call.read()
            except grpc.aio.AioRpcError as error:
                failed = driver.failed(attempt, failure_from_rpc(error))
                if failed is not None:
                    raise failed from error
                continue
            except BaseException:
                call.cancel()
                raise
            if first is grpc.aio.EOF:
                raise driver.protocol_error("the stream ended before its admission")
            if first.WhichOneof("kind") != "admission":
                call.cancel()
                raise driver.protocol_error(f"the first message was {first.WhichOneof('kind')}, not the admission")
            driver.admitted(attempt, first)
            return call, attempt

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
