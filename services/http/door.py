"""The HTTP door on the replica's own event loop: Starlette routes under uvicorn (chosen by measuring: BENCHMARKS.md
"HTTP stacks"), in front of the servicer's one `admit`. Every request is bounded before it is parsed (limits.py),
then parsed and checked (bodies.py, calls.py), admitted or refused (refusals.py), and answered (exchange.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
import uvicorn
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from billing.records import Door
from services import errors
from services.auth import bearer_key
from services.inference.metrics import ADMISSION_BUCKETS_S
from services.inference.servicer import InferenceServicer

from . import bodies
from .calls import Api, Call, call_of, key_metadata
from .exchange import Exchange
from .limits import ClientGone, HttpLimits, check_depth, check_headers, read_body
from .refusals import refusal, server_time
from .wire import BoundedHead

log = structlog.get_logger(__name__)
_BODY = {Api.CHAT: bodies.ChatCompletionBody, Api.COMPLETIONS: bodies.CompletionBody, Api.MESSAGES: bodies.MessagesBody}


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.responses = Counter(
            "zeroqueue_http_responses", "HTTP door replies by API and status", ["api", "status"], registry=registry
        )
        self.refusal_reply_time = Histogram(
            "zeroqueue_http_refusal_reply_seconds",
            "HTTP door: the request's body in to a 429 handed to the server (the gRPC door's, from its whole "
            "message: zeroqueue_refusal_reply_seconds)",
            buckets=ADMISSION_BUCKETS_S,  # the gRPC door's: side by side, bucket for bucket
            registry=registry,
        )


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers by name (uvicorn lower-cases them), decoded once: Starlette's Headers scans them all
    on every lookup, and a call reads about ten."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in raw}


class _Server(uvicorn.Server):
    """uvicorn inside the replica: the replica's own signal handling drains both doors, so uvicorn takes none."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpDoor:
    def __init__(self, servicer: InferenceServicer, registry: CollectorRegistry, limits: HttpLimits | None = None):
        self.servicer = servicer
        self.limits = limits or HttpLimits()
        self.metrics = HttpMetrics(registry)
        self._parse_pool = ThreadPoolExecutor(2, thread_name_prefix="http-parse")
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0
        routes = [
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._no_route})

    async def start(self, host: str, port: int, tls: tuple[str, str] | None = None) -> int:
        """Serves on host:port (0: any free port), over TLS with `tls` (certificate chain, key: PEM files);
        returns the port once listening."""
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only then, and without it a reply
        # written as head then body waits for the client's delayed ACK (~40 ms a reply, every 429 included)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        cert, key = tls if tls is not None else (None, None)
        protocol = type("DoorProtocol", (BoundedHead,), {"max_header_bytes": self.limits.max_header_bytes})
        config = uvicorn.Config(
            self.app,
            http=protocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=30,
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.005)
        self.port = sock.getsockname()[1]
        log.info("http_listening", address=f"{host}:{self.port}")
        return self.port

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._parse_pool.shutdown(wait=False)

    # ---- routes ----
    async def _chat(self, request: Request) -> Response | None:
        return await self._generate(Api.CHAT, request)

    async def _completions(self, request: Request) -> Response | None:
        return await self._generate(Api.COMPLETIONS, request)

    async def _messages(self, request: Request) -> Response | None:
        return await self._generate(Api.MESSAGES, request)

    async def _generate(self, api: Api, request: Request):
        received_ns = time.monotonic_ns()  # the budget runs from here: the body's bytes are the caller's time too
        read_ns = received_ns
        call: Call | None = None
        try:
            check_headers(request.scope["headers"], self.limits)
            raw = await read_body(request.receive, request.headers.get("content-length"), self._max_body(), self.limits)
            read_ns = time.monotonic_ns()  # a refusal's reply time runs from here, as gRPC's from a whole message
            body = await self._parse(api, raw)
            call = call_of(api, body, _headers(request.scope["headers"]))
            ticket = await self.servicer.admit(
                call.request, call.metadata, call.budget_s, call.source, received_ns, Door.HTTP
            )
        except ClientGone:
            return Response(status_code=499)  # uvicorn drops what is sent to a closed connection
        except Exception as error:  # noqa: BLE001 - every refusal in the API's shape; a bug is logged as one
            return self._refuse(error, call, api, read_ns)
        self.metrics.responses.labels(api.value, "200").inc()
        return _Admitted(Exchange(self.servicer, call, ticket, self._token_text))

    def _max_body(self) -> int:
        card = self.servicer.service.card if self.servicer.service is not None else None
        context = card.context_length if card is not None else 1 << 16
        return self.limits.max_body_bytes(self.servicer.limits.max_request_bytes(context))

    async def _parse(self, api: Api, raw: bytes):
        model = _BODY[api]

        def parse():
            check_depth(raw, self.limits)
            try:
                return model.model_validate_json(raw)
            except ValidationError as exc:
                raise errors.InvalidArgument(bodies.violations(exc)) from None

        if len(raw) <= self.limits.inline_parse_bytes:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, parse)

    def _token_text(self, token_id: int) -> str:
        return self.servicer.tokenizer.decode([token_id], skip_special_tokens=False)

    def _refuse(self, error: Exception, call: Call | None, api: Api, read_ns: int) -> JSONResponse:
        status, headers, body = refusal(error, call, api.anthropic)
        if call is not None and call.request.request_id:
            headers["x-request-id"] = call.request.request_id[:128]  # the caller's, echoed: which call this was
        if status == 500:
            log.error("http_unexpected_error", api=api.value, exc_info=error)
        elif status == 429:
            self.metrics.refusal_reply_time.observe((time.monotonic_ns() - read_ns) / 1e9)
        self.metrics.responses.labels(api.value, str(status)).inc()
        return JSONResponse(body, status, headers)

    async def _no_route(self, request: Request, exc: HTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), in the API's error shape."""
        anthropic = request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers
        where = f"{request.method[:16]} {request.url.path[:64]}"
        error = _NoRoute(exc.status_code, f"{exc.detail}: {where}; this door serves {', '.join(_PATHS)}")
        status, headers, body = refusal(error, None, anthropic)
        return JSONResponse(body, exc.status_code, headers | dict(exc.headers or {}))

    async def _models(self, request: Request) -> JSONResponse:
        anthropic = "anthropic-version" in request.headers or "x-api-key" in request.headers
        try:
            key = bearer_key(key_metadata(_headers(request.scope["headers"])))
            await self.servicer.authenticator.authenticate(key)
        except Exception as error:  # noqa: BLE001 - in the API's error shape
            status, headers, body = refusal(error, None, anthropic)
            return JSONResponse(body, status, headers)
        service = self.servicer.service
        name = service.card.name if service is not None else self.servicer.name
        if anthropic:
            entry = {"id": name, "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
            return JSONResponse({"data": [entry], "has_more": False, "first_id": name, "last_id": name})
        entry = {"id": name, "object": "model", "created": 0, "owned_by": "zeroqueue"}
        if service is not None:
            card = service.card
            entry |= {
                "context_length": card.context_length,
                "vocab_size": card.vocab_size,
                "max_batch": card.max_batch,
                "device": {"kind": card.device.kind, "name": card.device.name, "unit": card.device.unit},
                "state": service.state.value,
                "has_chat_template": self.servicer.chat is not None,
            }
        return JSONResponse({"object": "list", "data": [entry]}, headers={"x-server-time": server_time()})

    async def _health(self, request: Request) -> JSONResponse:
        """200 while the replica takes calls; 503 (warming, draining, a failed device) with its state."""
        service = self.servicer.service
        state = "warming_up" if service is None else service.state.value
        device = "unknown" if service is None else service.device_state.value
        ok = state == "ready" and device != "failed"
        return JSONResponse({"state": state, "device_state": device}, 200 if ok else 503)


_PATHS = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "GET /v1/models", "GET /health")


class _NoRoute(errors.ServiceError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.code = grpc.StatusCode.NOT_FOUND if status == 404 else grpc.StatusCode.INVALID_ARGUMENT
        self.reason = "UNKNOWN_PATH" if status == 404 else "METHOD_NOT_ALLOWED"


class _Admitted(Response):
    """An admitted call's reply: the exchange writes it (a JSON body, or server-sent events)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await self.exchange.run(send, receive)
