"""The servers and body schemas that bench/http_stacks.py measures (issue 32).

One server process per stack: a `grpc.aio` server with the health service and the HTTP server, both on the one
asyncio event loop of the main thread (plain asyncio, no uvloop: what the replica runs). Every stack answers
POST /v1/chat/completions the same way: the body read whole, parsed and validated with one schema (pydantic v2's
`model_validate_json`, or msgspec's typed decoder in the `-msgspec` arm; json.loads alone in the opt-in `-jsonloads`
arm), and a ~350-byte JSON reply made by `json.dumps`; a body the schema refuses gets 422.

    python bench/http_stack_apps.py --stack uvicorn-httptools-starlette --port 8080 --grpc-port 50051

prints `ready` on stdout once both servers listen.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

HOST = "127.0.0.1"
PATH = "/v1/chat/completions"
Answer = Callable[[bytes], tuple[int, bytes]]

# --- the body schema: a subset of OpenAI's chat-completions request, the same rules in both libraries ---

Role = Literal["system", "user", "assistant", "tool"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Role
    content: str | list[TextPart]
    name: str | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatRequest(BaseModel):
    model: str = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    stop: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None


class MTextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class MMessage(msgspec.Struct):
    role: Role
    content: str | list[MTextPart]
    name: str | None = None


class MJsonSchemaFormat(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class MResponseFormat(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: MJsonSchemaFormat | None = None


class MChatRequest(msgspec.Struct):
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    messages: Annotated[list[MMessage], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    stream: bool = False
    stop: str | list[str] | None = None
    response_format: MResponseFormat | None = None
    metadata: dict[str, str] | None = None


MSGSPEC_DECODER = msgspec.json.Decoder(MChatRequest)


def sample_body() -> bytes:
    """A realistic chat body: 3 messages of ~200 characters, a small json_schema, 2 metadata labels (~1 KiB)."""
    words = "the replica admits a call only when its deadline can be met by the predicted step times "
    system = ("You are a careful assistant for an operations team. Answer in JSON that matches the schema. " * 3)[:200]
    user = ("Summarise why " + words * 3)[:200]
    assistant = ("Earlier answer: " + words * 3)[:200]
    schema = {
        "type": "object",
        "properties": {"summary": {"type": "string", "maxLength": 280}, "risk": {"enum": ["low", "medium", "high"]}},
        "required": ["summary", "risk"],
        "additionalProperties": False,
    }
    body = {
        "model": "zq-python-tiny",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
            {"role": "assistant", "content": assistant},
        ],
        "max_tokens": 256,
        "temperature": 0.7,
        "stream": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "triage", "schema": schema, "strict": True}},
        "metadata": {"tenant": "acme-prod", "trace": "c0ffee-7b1d"},
    }
    return json.dumps(body).encode()


def invalid_body() -> bytes:
    body = json.loads(sample_body())
    body["temperature"] = 5.0
    return json.dumps(body).encode()


_ids = itertools.count(1)


def reply(model: str, prompt_chars: int) -> bytes:
    """~350 bytes: what a chat completion's answer looks like, made the same way in every arm."""
    prompt_tokens = prompt_chars // 4
    doc = {
        "id": f"chatcmpl-{next(_ids):012d}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": '{"summary": "admitted within deadline", "risk": "low"}'},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 14, "total_tokens": prompt_tokens + 14},
    }
    return json.dumps(doc).encode()


def answer_pydantic(body: bytes) -> tuple[int, bytes]:
    try:
        req = ChatRequest.model_validate_json(body)
    except ValidationError as e:
        return 422, e.json(include_url=False).encode()
    return 200, reply(req.model, sum(len(m.content) for m in req.messages if isinstance(m.content, str)))


def answer_msgspec(body: bytes) -> tuple[int, bytes]:
    try:
        req = MSGSPEC_DECODER.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        return 422, json.dumps({"detail": str(e)}).encode()
    return 200, reply(req.model, sum(len(m.content) for m in req.messages if isinstance(m.content, str)))


def answer_json(body: bytes) -> tuple[int, bytes]:
    """The floor: json.loads and no schema (nothing refused but bad JSON); not a candidate, a yardstick."""
    try:
        req = json.loads(body)
    except ValueError:
        return 422, b'{"detail": "bad JSON"}'
    return 200, reply(req["model"], sum(len(m["content"]) for m in req["messages"] if isinstance(m["content"], str)))


# --- the apps ---


def starlette_app(answer: Answer):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        status, body = answer(await request.body())
        return Response(body, status_code=status, media_type="application/json")

    return Starlette(routes=[Route(PATH, chat, methods=["POST"])])


def raw_asgi_app(answer: Answer):
    """The same endpoint with no framework: what starlette itself costs is the difference."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if scope["path"] == PATH and scope["method"] == "POST":
            status, body = answer(b"".join(chunks))
        else:
            status, body = 404, b'{"detail": "not found"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


# --- the servers, each started on the running loop ---

_keep: list[Any] = []  # tasks and servers that must outlive their start function


async def wait_listening(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection(HOST, port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def start_uvicorn(app, port: int, http: str) -> None:
    import uvicorn

    config = uvicorn.Config(
        app, host=HOST, port=port, http=http, ws="none", lifespan="off", access_log=False, log_level="warning"
    )
    server = uvicorn.Server(config)
    _keep.append(asyncio.get_running_loop().create_task(server.serve()))
    while not server.started:
        await asyncio.sleep(0.01)


async def start_hypercorn(app, port: int) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{HOST}:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    never = asyncio.Event()
    _keep.append(asyncio.get_running_loop().create_task(serve(app, config, shutdown_trigger=never.wait)))
    await wait_listening(port)


async def start_aiohttp(answer: Answer, port: int) -> None:
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        status, body = answer(await request.read())
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_post(PATH, chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, HOST, port).start()
    _keep.append(runner)


STACKS: dict[str, Callable[[int], Awaitable[None]]] = {
    "uvicorn-httptools-starlette": lambda port: start_uvicorn(starlette_app(answer_pydantic), port, "httptools"),
    "uvicorn-h11-starlette": lambda port: start_uvicorn(starlette_app(answer_pydantic), port, "h11"),
    "hypercorn-starlette": lambda port: start_hypercorn(starlette_app(answer_pydantic), port),
    "aiohttp": lambda port: start_aiohttp(answer_pydantic, port),
    "uvicorn-httptools-raw-asgi": lambda port: start_uvicorn(raw_asgi_app(answer_pydantic), port, "httptools"),
    "uvicorn-httptools-starlette-msgspec": lambda port: start_uvicorn(starlette_app(answer_msgspec), port, "httptools"),
}
# opt-in (--stacks): the same server with json.loads and no schema, to see the schemas' cost inside the server
EXTRA_STACKS: dict[str, Callable[[int], Awaitable[None]]] = {
    "uvicorn-httptools-starlette-jsonloads": lambda port: start_uvicorn(starlette_app(answer_json), port, "httptools")
}
NO_SCHEMA = frozenset(EXTRA_STACKS)


async def serve(stack: str, port: int, grpc_port: int) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{HOST}:{grpc_port}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await {**STACKS, **EXTRA_STACKS}[stack](port)
    print("ready", flush=True)
    await asyncio.Event().wait()  # until the bench kills the process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", choices=sorted({**STACKS, **EXTRA_STACKS}), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.stack, args.port, args.grpc_port))


if __name__ == "__main__":
    main()
