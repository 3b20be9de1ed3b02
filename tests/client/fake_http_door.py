"""A fake HTTP door for pulse's tests: POST /v1/completions answered from a script, as the replica's door answers
(the contract pulse's http_client.py follows). A real loopback port (the standard library's threading server), so
the client's connection pool, keep-alive and timeouts are the real ones."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Complete:
    """A 200: `completion_tokens` tokens of text, deadline met or not."""

    completion_tokens: int = 2
    deadline_met: bool = True


@dataclass(frozen=True)
class Refuse:
    """A refusal: 429 OVERLOADED with a retry hint by default."""

    status: int = 429
    code: str = "OVERLOADED"
    hint_ms: int | None = 20
    should_retry: bool | None = None  # x-should-retry; None: not sent
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SeenRequest:
    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict
    at_s: float


def _refusal(answer: Refuse) -> tuple[dict[str, str], dict]:
    headers = {"x-server-time": str(time.time_ns() // 1000)}
    metadata = {"cause": "slots_full", **answer.metadata}
    if answer.hint_ms is not None:
        headers |= {"retry-after-ms": str(answer.hint_ms), "retry-after": str(-(-answer.hint_ms // 1000))}
        metadata["retry_after_ms"] = str(answer.hint_ms)
    if answer.should_retry is not None:
        headers["x-should-retry"] = "true" if answer.should_retry else "false"
    kind = "rate_limit_error" if answer.status == 429 else "invalid_request_error"
    error = {"message": f"refused: {answer.code}", "type": kind, "param": None, "code": answer.code}
    error["error_info"] = {"reason": answer.code, "domain": "zeroqueue", "metadata": metadata}
    return headers, {"error": error}


def _completion(answer: Complete, seen: SeenRequest, number: int) -> tuple[dict[str, str], dict]:
    prompt = seen.body.get("prompt")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": answer.completion_tokens}
    usage |= {"total_tokens": prompt_tokens + answer.completion_tokens}
    usage["device_time"] = {"unit": "core_us", "amount": 1234}
    choice = {"text": " t" * answer.completion_tokens, "index": 0, "finish_reason": "length"}
    body = {"id": f"cmpl-{number}", "object": "text_completion", "choices": [choice], "usage": usage}
    headers = {
        "x-call-id": f"call-{number}",
        "x-request-id": seen.headers.get("x-request-id", ""),
        "x-budget-ms": seen.headers.get("x-budget-ms", ""),
        "x-budget-source": "header",
        "x-request-dispatch-time": "150",
        "x-server-time": str(time.time_ns() // 1000),
        "x-deadline-met": "true" if answer.deadline_met else "false",
    }
    return headers, body


class FakeHttpDoor:
    """Answers each POST with the script's next answer (Complete() once it runs out); `seen` holds every request.
    With `retries_complete`, a retry (x-stainless-retry-count other than 0) is completed without taking an answer
    from the script, so the script answers the schedule's calls whatever order a loaded host delivers them in."""

    def __init__(self, script: list | None = None, retries_complete: bool = False) -> None:
        self.script = list(script or [])
        self.retries_complete = retries_complete
        self.seen: list[SeenRequest] = []
        self.lock = threading.Lock()
        door = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def do_POST(self) -> None:  # noqa: N802 - the standard library's name
                length = int(self.headers.get("content-length", 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                seen = SeenRequest(self.path, headers, json.loads(self.rfile.read(length)), time.monotonic())
                with door.lock:
                    door.seen.append(seen)
                    retry = door.retries_complete and headers.get("x-stainless-retry-count", "0") != "0"
                    answer = door.script.pop(0) if door.script and not retry else Complete()
                    number = len(door.seen)
                if isinstance(answer, Complete):
                    status, (headers, body) = 200, _completion(answer, seen, number)
                else:
                    status, (headers, body) = answer.status, _refusal(answer)
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {**headers, "content-type": "application/json"}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHttpDoor:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
