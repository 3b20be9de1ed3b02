"""pulse's HttpClient (services/pulse/http_client.py) with `stream: true`, so a benchmark over HTTP can time the
first token the way pulse times it over gRPC: when the first piece of output text reaches the client.

Each attempt is sent as the non-streaming client sends it, plus `stream: true`, `stream_options.include_usage`
and `extra` (a peer's own fields, such as llama.cpp's `cache_prompt`). A refusal (any status but 200) is the
HttpClient's Failure, so zeroqueue's 429s are retried as the SDK retries them. A 200's server-sent events are read
to `[DONE]` and folded into the one JSON body the door would have answered (text, finish_reason, usage), which the
HttpClient's driver reads as usual: the device time and cached prompt tokens come from the stream's last usage.

The runner records a first token only for chunks that carry token ids, which the HTTP door does not send; this
client keeps the call's start (generate) and first text (monotonic seconds) by request id instead, and
`fill_first_tokens` puts them on the runner's traces afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from services.pulse import http_client
from services.pulse.http_client import COMPLETIONS_PATH, HttpClient, _transport_failure, failure_from_response


def carries_text(line: str) -> bool:
    """An event line whose choices carry output text (the first such line is the first token's arrival)."""
    data = line[5:].strip() if line.startswith("data:") else "[DONE]"
    if data == "[DONE]":
        return False
    return any(choice.get("text") for choice in json.loads(data).get("choices") or ())


def fold_events(lines: list[str], prompt_tokens: int) -> tuple[dict, int]:
    """An OpenAI completions stream's `data:` lines as the one body a non-streaming reply has, and how many
    text chunks it carried. A usage the server left out (or a part of one) is filled from what the stream shows:
    the prompt's length, and one token per text chunk. llama.cpp's `timings.cache_n` stands for the cached
    prompt tokens OpenAI's usage calls prompt_tokens_details.cached_tokens."""
    text, finish, usage, chunks, cached = [], "", {}, 0, None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        for choice in event.get("choices") or ():
            if choice.get("text"):
                text.append(choice["text"])
                chunks += 1
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
        timings = event.get("timings") or {}
        cached = timings.get("cache_n", cached)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": chunks, **usage}
    if cached is not None and "prompt_tokens_details" not in usage:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    body = {"choices": [{"index": 0, "text": "".join(text), "finish_reason": finish}], "usage": usage}
    return body, chunks


class StreamingHttpClient(HttpClient):
    """HttpClient whose attempts stream; `started[request_id]` and `first_text[request_id]` (time.monotonic)
    time each call's first text, `cached_tokens[request_id]` is its usage's cached prompt tokens (if said)."""

    def __init__(self, *args, extra: dict | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.extra = dict(extra or {})
        self.started: dict[str, float] = {}
        self.first_text: dict[str, float] = {}
        self.cached_tokens: dict[str, int] = {}

    def generate(self, prompt=None, deadline_ms=None, **options):
        self.started[options.get("request_id") or ""] = time.monotonic()
        return super().generate(prompt, deadline_ms, **options)

    async def _try(self, driver, attempt, body):
        if round(attempt.timeout_s * 1000) < 1:
            return await super()._try(driver, attempt, body)  # no budget left: failed locally, never sent
        sent = {**body, **self.extra, "stream": True, "stream_options": {"include_usage": True}}
        if attempt.request.model:
            sent["model"] = attempt.request.model
        url = self.endpoints[attempt.endpoint] + COMPLETIONS_PATH
        wait_s = attempt.timeout_s + http_client.GRACE_S  # read now: a peer's run sets GRACE_S to 0
        headers = self._headers(driver, attempt)
        try:
            with self.pools.lease() as http:
                async with asyncio.timeout(wait_s):
                    async with http.stream("POST", url, json=sent, headers=headers, timeout=wait_s) as response:
                        if response.status_code != 200:
                            await response.aread()
                            should_retry = response.headers.get("x-should-retry", "").lower() != "false"
                            return None, failure_from_response(response), should_retry
                        lines = await self._read(response, driver.request_id)
        except (TimeoutError, httpx.TransportError) as error:
            return None, _transport_failure(error), True
        whole, _ = fold_events(lines, len(body["prompt"]))
        cached = (whole["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            self.cached_tokens[driver.request_id] = int(cached)
        kept = {k: v for k, v in response.headers.items() if k.lower().startswith("x-")}
        return httpx.Response(200, headers=kept, json=whole, request=response.request), None, True

    async def _read(self, response: httpx.Response, request_id: str) -> list[str]:
        lines = []
        async for line in response.aiter_lines():
            if request_id not in self.first_text and carries_text(line):
                self.first_text[request_id] = time.monotonic()
            lines.append(line)
        return lines


def fill_first_tokens(client: StreamingHttpClient, traces, id_prefix: str) -> None:
    """Each completed trace's first_token_s, from the client's clocks: its sent_s plus the call's start -> first
    text (so the runner's TTFT is the time from sending to the first text, as it is over gRPC)."""
    for trace in traces:
        rid = f"{id_prefix}-{trace.index}"
        if trace.sent_s is not None and rid in client.first_text and rid in client.started:
            trace.first_token_s = trace.sent_s + client.first_text[rid] - client.started[rid]
