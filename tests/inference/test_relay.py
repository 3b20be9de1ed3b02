"""The service's relay of engine outputs to a call's stream: one message per output while it keeps up, and
the outputs that queued up while it fell behind in one message, with nothing lost, reordered or re-counted."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import MappingProxyType

from services.inference.call import BudgetSource, GenerateSpec, LoopSink, Ticket
from services.inference.clock import Clock
from services.inference.engine.engine import RequestOutput
from services.inference.meter import RecordContext
from services.inference.metrics import ServiceMetrics, StepLog
from services.inference.sched.request import SamplingParams
from services.inference.service import InferenceService


class Progress:
    """The admission controller as the relay sees it: told each call's token count; it predicts nothing."""

    predicts = False

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_progress(self, key: str, num_generated: int) -> None:
        self.seen.append(num_generated)


def _service(metrics: ServiceMetrics, progress: Progress) -> InferenceService:
    return InferenceService(
        engine=None,
        card=None,
        admission=progress,
        metrics=metrics,
        clock=Clock(),
        meter=None,
        outbox=None,
        steps=StepLog(),
    )


def _ticket(queue: asyncio.Queue, received_ns: int) -> Ticket:
    spec = GenerateSpec("r1", (1, 2, 3), SamplingParams(max_tokens=4), MappingProxyType({}))
    done: Future = Future()
    done.set_result(None)
    return Ticket(
        spec,
        RecordContext("tenant", spec.labels, received_ns, received_ns, received_ns + 10**10, spec.request_id),
        "call-1",
        None,
        queue,
        10_000,
        BudgetSource.CLIENT_DEADLINE,
        received_ns + 10**9,
        usage_on_disk=done,
    )


def _outputs(t0_ns: int) -> list[RequestOutput]:
    step_ns = 3_000_000
    return [
        RequestOutput(
            "r1", (10 + i,), f"t{i}", t0_ns + (i + 1) * step_ns, i + 1, "length" if i == 3 else None, t0_ns + 1_000
        )
        for i in range(4)
    ]


def _count(metrics: ServiceMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"{name}_count")


async def _relay(queued_before_reading: int) -> tuple[list[RequestOutput], ServiceMetrics, Progress, Ticket]:
    metrics, progress = ServiceMetrics(), Progress()
    service, t0 = _service(metrics, progress), Clock().now_ns()
    ticket = _ticket(asyncio.Queue(), t0)
    outputs = _outputs(t0)
    for output in outputs[:queued_before_reading]:
        ticket.outputs.put_nowait(output)
    got, stream = [], service.stream(ticket)
    async for message in stream:
        got.append(message)
        if len(got) == 1:  # the rest arrive one at a time, each read before the next comes
            for output in outputs[queued_before_reading:]:
                ticket.outputs.put_nowait(output)
                got.append(await anext(stream))
            break
    return got, metrics, progress, ticket


def test_a_relay_that_keeps_up_sends_one_message_per_output():
    got, metrics, progress, ticket = asyncio.run(_relay(queued_before_reading=1))
    assert [m.token_ids for m in got] == [(10,), (11,), (12,), (13,)]
    assert _count(metrics, "zeroqueue_relay_lag_seconds") == 4
    assert ticket.finish_reason == "length" and ticket.num_output_tokens == 4


def test_outputs_that_queued_up_go_out_as_one_message_in_order():
    got, metrics, progress, ticket = asyncio.run(_relay(queued_before_reading=3))
    outputs = _outputs(ticket.received_ns)
    assert [m.token_ids for m in got] == [(10, 11, 12), (13,)]
    assert got[0].text == "t0t1t2" and got[0].time_ns == outputs[0].time_ns  # when its first token came
    assert got[0].num_output_tokens == 3 and got[0].finish_reason is None
    assert got[-1].finish_reason == "length" and ticket.finished_ns == outputs[3].time_ns
    # every output is still accounted one by one: TTFT once, an inter-token gap per later token, progress
    assert ticket.first_token_ns == outputs[0].time_ns and progress.seen == [1, 2, 3, 4]
    assert _count(metrics, "zeroqueue_ttft_seconds") == 1 and _count(metrics, "zeroqueue_inter_token_seconds") == 3
    assert _count(metrics, "zeroqueue_relay_lag_seconds") == 2


def test_the_final_output_ends_the_message_it_is_in():
    async def relay():
        metrics, progress = ServiceMetrics(), Progress()
        t0 = Clock().now_ns()
        ticket = _ticket(asyncio.Queue(), t0)
        for output in _outputs(t0):
            ticket.outputs.put_nowait(output)
        return [m async for m in _service(metrics, progress).stream(ticket)]

    got = asyncio.run(relay())
    assert len(got) == 1 and got[0].token_ids == (10, 11, 12, 13) and got[0].finish_reason == "length"


def test_the_sink_puts_directly_on_its_own_loop_and_through_the_loop_from_another_thread():
    async def put_both_ways():
        sink = LoopSink(asyncio.get_running_loop())
        first = _outputs(0)[0]
        sink.put(first)
        assert sink.queue.qsize() == 1  # on the loop: put at once, no wake-up through the self-pipe
        await asyncio.to_thread(sink.put, first._replace(token_ids=(99,)))  # handed over through the loop
        return [sink.queue.get_nowait().token_ids for _ in range(sink.queue.qsize())]

    assert asyncio.run(put_both_ways()) == [(10,), (99,)]


class FakeClock:
    """The relay's clock, moved by the test."""

    now = 0

    def now_ns(self) -> int:
        return self.now


def test_a_stream_interval_holds_later_tokens_but_never_the_first_or_the_end():
    MS = 1_000_000

    async def relay():
        metrics, progress, clock = ServiceMetrics(), Progress(), FakeClock()
        service = InferenceService(
            engine=None,
            card=None,
            admission=progress,
            metrics=metrics,
            clock=clock,
            meter=None,
            outbox=None,
            steps=StepLog(),
            stream_interval_ms=20,
        )
        ticket = _ticket(asyncio.Queue(), 0)
        outputs = [RequestOutput("r1", (10 + i,), f"t{i}", 0, i + 1, "length" if i == 4 else None, 0) for i in range(5)]
        stream, sent = service.stream(ticket), []
        pending = asyncio.ensure_future(anext(stream))
        for now_ms, output in zip((0, 5, 10, 25, 27), outputs):
            clock.now = now_ms * MS
            ticket.outputs.put_nowait(output)
            for _ in range(3):
                await asyncio.sleep(0)
            if pending.done():
                sent.append((now_ms, pending.result().token_ids))
                if output.finish_reason is None:
                    pending = asyncio.ensure_future(anext(stream))
        return sent, progress.seen

    sent, progress = asyncio.run(relay())
    # the first token at once; 5 and 10 ms are within 20 ms of it, so they wait; at 25 ms the three go together;
    # the end at 27 ms goes at once although the last message was 2 ms before
    assert sent == [(0, (10,)), (25, (11, 12, 13)), (27, (14,))]
    assert progress == [1, 2, 3, 4, 5]  # held tokens still count as generated when they come


def test_a_replica_with_a_stream_interval_sends_the_same_tokens_in_fewer_messages(llama_dir):
    from services.inference.device.executor import ExecutorConfig
    from services.inference.serve_config import ServeConfig
    from tests.inference.conftest import Collector, make_engine, request, run_to_completion
    from tests.inference.harness import ServerThread
    from tests.inference.test_server import PROMPT, generate

    replica = ServerThread(
        ServeConfig(
            str(llama_dir), port=0, executor=ExecutorConfig(max_batch=2, max_seq_len=256), stream_interval_ms=60_000
        )
    ).start()
    try:
        messages = generate(replica.stub(), max_tokens=12, temperature=0.0)
    finally:
        replica.stop()
    chunks = [tuple(m.chunk.token_ids) for m in messages if m.WhichOneof("kind") == "chunk"]
    # within a minute of the first chunk nothing else goes until the end, which takes the rest (the first may
    # carry more than one token when the relay fell a step behind on a busy machine: they queued up)
    assert len(chunks) <= 2 and messages[-1].final.usage.completion_tokens == 12
    engine, sink = make_engine(llama_dir), Collector()
    engine.add_request(request("ref", engine.tokenizer.encode(PROMPT).ids, max_tokens=12), sink)
    run_to_completion(engine)
    assert sum(chunks, ()) == tuple(sink.tokens("ref"))


def test_serve_refuses_a_negative_stream_interval():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--stream-interval-ms", "-5"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--stream-interval-ms: must be 0 or more" in result.stderr
