"""The synchronous client: `Client(endpoints, api_key).generate(prompt, deadline_ms=...)`.

    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], api_key=key) as client:
        generation = client.generate("def fib(n):", deadline_ms=2_000, max_tokens=64, temperature=0)
        for chunk in generation:
            print(chunk.text, end="")
        print(generation.result.usage, generation.report.num_attempts, generation.report.waited_s)
        record = client.complete(
            messages=[{"role": "user", "content": "a function that parses --name=value arguments"}],
            response_format={"type": "json_schema", "schema": {"type": "object"}},
            deadline_ms=2_000, max_tokens=64, logprobs=True,
        ).json()

A call starts when its iteration does. Retries (see retry.py) happen before the first chunk; once the
server has admitted the call, a failure is raised to the caller as it is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import grpc
from zeroqueue.inference.v1 import inference_pb2 as pb
from zeroqueue.inference.v1 import inference_pb2_grpc

from .call import Attempt, CallDriver
from .failure import failure_from_rpc
from .request import Message, budget_ms, build_request
from .results import Admission, CallReport, Chunk, ModelInfo, Result, models_from
from .retry import Retrier, RetryConfig


def channel_credentials(tls: bool | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    return grpc.ssl_channel_credentials() if tls else None


class Generation(Iterator[Chunk]):
    """Iterates the call's chunks; `result` holds the Result (usage, timings, full text) once it ends, and
    `report` its attempts so far. Stopping early (close(), or leaving the loop) cancels the call."""

    def __init__(self, client: Client, request: pb.GenerateRequest, deadline_ms: float) -> None:
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

    def __next__(self) -> Chunk:
        return next(self._stream)

    def close(self) -> None:
        self._stream.close()

    def collect(self) -> Result:
        """Runs the call to its end; returns the Result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def _run(self) -> Iterator[Chunk]:
        driver = self._driver = self._client._driver(self._request, self._deadline_ms)
        call, attempt = self._client._admit(driver)
        try:
            for message in call:
                kind = message.WhichOneof("kind")
                if kind == "chunk":
                    yield driver.chunk(message.chunk)
                elif kind == "final":
                    self.result = driver.result(message.final)
                    return
            raise driver.protocol_error("the stream ended without a final message")
        except grpc.RpcError as error:
            raise driver.failed(attempt, failure_from_rpc(error, True, driver.num_tokens)) from error
        finally:
            if self.result is None:
                call.cancel()


class Client:
    """Thread-safe; one channel per endpoint. `tls`: False (plaintext), True (system roots) or credentials.
    `clock`, `wall_clock`, `sleep` and `rand` are there for tests."""

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
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint")
        self.endpoints = tuple(endpoints)
        self.api_key = api_key
        credentials = channel_credentials(tls)
        self._channels = [
            grpc.secure_channel(e, credentials, options=list(channel_options))
            if credentials
            else grpc.insecure_channel(e, options=list(channel_options))
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
    ) -> Generation:
        """A call whose whole life, retries included, fits in `deadline_ms`.

        What it sends, exactly one of:
          prompt       text, or a sequence of ints sent as token ids;
          messages     a conversation, rendered by the model's chat template (ListModels: has_chat_template): a list
                       of Message(role, content, name="") or of OpenAI-style dicts {"role", "content", "name"?}, role
                       one of system, user, assistant, tool.
        `response_format` (OpenAI-style; the one way to constrain the output, there is no separate json_schema=):
          {"type": "json_object"}                                 any JSON object
          {"type": "json_schema", "json_schema": {"schema": S}}   or {"type": "json_schema", "schema": S}: S a dict
                                                                  (sent compactly, in its own key order) or JSON text
          {"type": "regex", "regex": "..."}                       the whole output matches it
          {"type": "lark_grammar", "grammar": "..."}              a Lark grammar from `start`
        A constrained call that ends with finish_reason "stop" holds exactly that (Result.json() parses it); "length"
        means max_tokens cut it short. A first call with a new format waits for its compile (Admission.compile_us).
        `logprobs`: each token's log-probability (Chunk.logprobs, Result.logprobs); `top_logprobs` (0-20, needs
        logprobs) adds that many most likely alternatives at each position.
        A form the server would refuse (no or two prompts, an unknown role or format type, top_logprobs without
        logprobs) raises ValueError before anything is sent. Retries resend the same request."""
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
        return Generation(self, request, deadline_ms)

    def complete(
        self, prompt: str | Sequence[int] | None = None, deadline_ms: float | None = None, **options
    ) -> Result:
        """generate(...) run to its end: its Result."""
        return self.generate(prompt, deadline_ms, **options).collect()

    def list_models(self, endpoint: int = 0, timeout_s: float = 5.0) -> list[ModelInfo]:
        reply = self._stubs[endpoint].ListModels(
            pb.ListModelsRequest(), timeout=timeout_s, metadata=(("authorization", f"Bearer {self.api_key}"),)
        )
        return models_from(reply)

    def _driver(self, request: pb.GenerateRequest, deadline_ms: float) -> CallDriver:
        return CallDriver(self.retrier, self.endpoints, self.api_key, request, deadline_ms)

    def _admit(self, driver: CallDriver) -> tuple[grpc.Call, Attempt]:
        """Attempts until one is admitted; raises the typed error when the retrier gives up."""
        while True:
            if driver.delay_s > 0:
                self._sleep(driver.delay_s)
            attempt = driver.begin()
            call = self._stubs[attempt.endpoint].Generate(
                attempt.request, timeout=attempt.timeout_s, metadata=attempt.metadata
            )
            try:
                first = next(call)
            except grpc.RpcError as error:
                failed = driver.failed(attempt, failure_from_rpc(error))
                if failed is not None:
                    raise failed from error
                continue
            except StopIteration:
                raise driver.protocol_error("the stream ended before its admission") from None
            if first.WhichOneof("kind") != "admission":
                call.cancel()
                raise driver.protocol_error(f"the first message was {first.WhichOneof('kind')}, not the admission")
            driver.admitted(attempt, first)
            return call, attempt

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
