"""One admitted HTTP call, from admission to its last byte. A pump drains the call's outputs as the engine makes
them and closes the call the moment it ends, whoever reads: a stalled reader never holds a slot, and the writer
gives up on it once the call's deadline (and a grace) has passed. A client that goes away cancels the call at
once: the engine drops it within a step and it is billed once, for what ran."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from services.inference.call import Ticket
from services.inference.servicer import InferenceServicer

from . import replies
from .calls import Call
from .refusals import refusal, server_time

log = structlog.get_logger(__name__)
Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]
WRITE_GRACE_S = 5.0  # past the deadline, a reader still gets this long to take what the call made
_END = object()


def admitted_headers(ticket: Ticket) -> dict[str, str]:
    """What every reply to an admitted call says: its ids, its budget and where it came from, how long dispatch
    took (X-Request-Dispatch-Time, µs from the request's arrival to its admission into the next step)."""
    return {
        "x-call-id": ticket.call_id,
        "x-request-id": ticket.spec.request_id,
        "x-budget-ms": str(ticket.budget_ms),
        "x-budget-source": ticket.budget_source.value,
        "x-service-class": ticket.service_class,
        "x-request-dispatch-time": str((ticket.dispatched_ns - ticket.received_ns) // 1000),
        "x-server-time": server_time(),
    }


def _start(status: int, headers: dict[str, str], content_type: str) -> dict:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    raw += [(b"content-type", content_type.encode()), (b"cache-control", b"no-store")]
    return {"type": "http.response.start", "status": status, "headers": raw}


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Exchange:
    """The reply to one admitted call: `run` it as the request's ASGI response."""

    def __init__(self, servicer: InferenceServicer, call: Call, ticket: Ticket, token_text: replies.TokenText):
        self.servicer, self.call, self.ticket, self.token_text = servicer, call, ticket, token_text
        self.service = servicer.service
        self.outputs: asyncio.Queue = asyncio.Queue()  # bounded by the call's max_tokens: one entry per step at most
        self.failure: Exception | None = None  # what ended the pump other than the call's end (its usage not durable)

    async def _pump(self) -> None:
        try:
            async for output in self.service.stream(self.ticket):
                self.outputs.put_nowait(output)
        except Exception as error:  # noqa: BLE001 - the writer tells the caller, in the API's shape
            self.failure = error
        finally:
            self.service.close(self.ticket)  # unfinished (the client left): cancelled in the engine, billed once
            self.outputs.put_nowait(_END)

    async def run(self, send: Send, receive: Receive) -> None:
        pump = asyncio.create_task(self._pump())
        gone = asyncio.create_task(_disconnected(receive))
        deadline_s = (self.ticket.deadline_ns - self.service.clock.now_ns()) / 1e9
        write = asyncio.create_task(self._write(send))
        try:
            async with asyncio.timeout(max(deadline_s, 0.0) + WRITE_GRACE_S):
                await asyncio.wait({write, gone}, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            log.info("http_reader_stalled", call_id=self.ticket.call_id)
        finally:
            for task in (write, gone):
                task.cancel()
            if not write.done() or write.cancelled():
                pump.cancel()  # the client left or stalled before the end: the call ends now
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            if write.done() and not write.cancelled() and write.exception() is not None:
                raise write.exception()

    def _check_finished(self) -> None:
        """Raises the domain error of a call that did not end well (or whose relay failed)."""
        if self.failure is not None:
            raise self.failure
        self.servicer.check_finished(self.ticket)

    async def _write(self, send: Send) -> None:
        headers = admitted_headers(self.ticket)
        if self.call.stream:
            await self._stream(send, headers)
            return
        got = replies.Collected()
        while (output := await self.outputs.get()) is not _END:
            got.add(output)
        try:
            self._check_finished()
        except Exception as error:  # noqa: BLE001 - a domain error (or a bug) in the API's error shape
            await self._send_error(send, error, headers)
            return
        clock = self.service.clock
        headers["x-deadline-met"] = str(self.ticket.deadline_met).lower()
        # the replica's own view of the call, on its epoch clock: a client tells its network time from these
        headers["x-received-at-us"] = str(clock.epoch_us(self.ticket.received_ns))
        headers["x-finished-at-us"] = str(clock.epoch_us(self.ticket.finished_ns))
        headers["x-server-time"] = server_time()  # now, as the reply goes out
        card = self.service.card
        body = replies.body(self.call.api, self.ticket, got, card.name, card.device.unit, self.token_text)
        await send(_start(200, headers, "application/json"))
        await send({"type": "http.response.body", "body": replies.dumps(body)})

    async def _send_error(self, send: Send, error: Exception, headers: dict[str, str]) -> None:
        status, more, body = refusal(error, self.call, self.call.api.anthropic)
        if status == 500:
            log.error("http_call_failed", call_id=self.ticket.call_id, exc_info=error)
        await send(_start(status, headers | more, "application/json"))
        await send({"type": "http.response.body", "body": replies.dumps(body)})

    async def _stream(self, send: Send, headers: dict[str, str]) -> None:
        card = self.service.card
        events = replies.Stream(
            self.call.api, self.ticket, card.name, card.device.unit, self.token_text, self.call.include_usage
        )
        await send(_start(200, headers, "text/event-stream"))
        await self._body(send, events.start())
        while (output := await self.outputs.get()) is not _END:
            await self._body(send, events.chunk(output))
        try:
            self._check_finished()
        except Exception as error:  # noqa: BLE001 - told as the API's error event, after what was sent
            _, _, body = refusal(error, self.call, self.call.api.anthropic)
            await self._body(send, replies.sse(body, "error" if self.call.api.anthropic else None))
        else:
            await self._body(send, events.end())
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _body(send: Send, data: bytes) -> None:
        if data:
            await send({"type": "http.response.body", "body": data, "more_body": True})
