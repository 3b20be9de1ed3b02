"""An admitted call's results in each API's own shape: one JSON body, or server-sent events as each API streams
them (OpenAI: `data:` chunks and `[DONE]`; Anthropic: named events from message_start to message_stop). The usage
object carries the call's device time beside its tokens: `device_time: {unit, amount}` (core_us or sm_us, as
billed)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from services.inference.call import Ticket
from services.inference.sched.request import FinishReason

from .calls import Api

TokenText = Callable[[int], str]  # a token id's text (the tokenizer's decode of it alone)
_OBJECT = {Api.CHAT: "chat.completion", Api.COMPLETIONS: "text_completion"}
_ANTHROPIC_STOP = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens"}


def dumps(value: dict) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def call_name(api: Api, call_id: str) -> str:
    """The API's id for a call: its prefix and the replica's call id (X-Call-Id says the same)."""
    prefix = {Api.CHAT: "chatcmpl-", Api.COMPLETIONS: "cmpl-", Api.MESSAGES: "msg_"}[api]
    return prefix + call_id


def device_time(ticket: Ticket, unit: str) -> dict:
    return {"unit": unit, "amount": ticket.usage.unit_us if ticket.usage is not None else 0}


def usage(api: Api, ticket: Ticket, unit: str) -> dict:
    """Each API's usage in its own words: Anthropic counts the prompt tokens its cache read apart from input_tokens,
    OpenAI counts them within prompt_tokens and says how many in prompt_tokens_details."""
    prompt, output = len(ticket.spec.prompt_token_ids), ticket.num_output_tokens
    cached = ticket.usage.cached_prompt_tokens if ticket.usage is not None else 0
    if api.anthropic:
        return {
            "input_tokens": prompt - cached,
            "cache_read_input_tokens": cached,
            "output_tokens": output,
            "device_time": device_time(ticket, unit),
        }
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
        "device_time": device_time(ticket, unit),
    }


def _chat_logprobs(token_ids: list[int], logprobs: list[tuple], text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, (lp, top) in zip(token_ids, logprobs)
        ]
    }


def _completion_logprobs(token_ids: list[int], logprobs: list[tuple], text: TokenText, offset: int) -> dict:
    tokens = [text(t) for t in token_ids]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [{text(i): v for i, v in top} for _, top in logprobs],
        "text_offset": offsets,
    }


class Collected:
    """What a call made, gathered for a one-body reply (or, chunk by chunk, for a stream)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[tuple] = []

    def add(self, output) -> None:
        self.text.append(output.text)
        if output.logprobs:
            self.token_ids += output.token_ids
            self.logprobs += output.logprobs


def body(api: Api, ticket: Ticket, got: Collected, model: str, unit: str, text: TokenText) -> dict:
    """The one-body reply of a finished call."""
    name, out = call_name(api, ticket.call_id), "".join(got.text)
    lp = ticket.spec.sampling.logprobs
    if api.anthropic:
        return {
            "id": name,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": out}],
            "stop_reason": _ANTHROPIC_STOP[ticket.finish_reason],
            "stop_sequence": None,
            "usage": usage(api, ticket, unit),
        }
    choice: dict = {"index": 0, "finish_reason": ticket.finish_reason.value, "logprobs": None}
    if api is Api.CHAT:
        choice["message"] = {"role": "assistant", "content": out}
        if lp:
            choice["logprobs"] = _chat_logprobs(got.token_ids, got.logprobs, text)
    else:
        choice["text"] = out
        if lp:
            choice["logprobs"] = _completion_logprobs(got.token_ids, got.logprobs, text, 0)
    return {
        "id": name,
        "object": _OBJECT[api],
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(api, ticket, unit),
    }


def sse(data: dict | str, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + (data.encode() if isinstance(data, str) else dumps(data)) + b"\n\n"


class Stream:
    """One call's server-sent events, in its API's shape: `start`, then `chunk` per output, then `end`."""

    def __init__(self, api: Api, ticket: Ticket, model: str, unit: str, text: TokenText, include_usage: bool):
        self.api, self.ticket, self.model, self.unit, self.text = api, ticket, model, unit, text
        self.include_usage = include_usage
        self.name = call_name(api, ticket.call_id)
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset: characters streamed so far

    def _openai(self, choice: dict, usage_: dict | None = None) -> bytes:
        chunk = {
            "id": self.name,
            "object": "chat.completion.chunk" if self.api is Api.CHAT else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if usage_ is not None:
            chunk["usage"] = usage_
        return sse(chunk)

    def start(self) -> bytes:
        if self.api is Api.CHAT:
            return self._openai({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        if self.api is Api.COMPLETIONS:
            return b""
        message = {
            "id": self.name,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(self.ticket.spec.prompt_token_ids), "output_tokens": 0},
        }
        return sse({"type": "message_start", "message": message}, "message_start") + sse(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            "content_block_start",
        )

    def chunk(self, output) -> bytes:
        if not output.text and not output.logprobs:
            return b""
        if self.api.anthropic:
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": output.text}}
            return sse(delta, "content_block_delta")
        ids, lps = list(output.token_ids), list(output.logprobs)
        if self.api is Api.CHAT:
            choice = {"index": 0, "delta": {"content": output.text}, "finish_reason": None, "logprobs": None}
            if lps:
                choice["logprobs"] = _chat_logprobs(ids, lps, self.text)
        else:
            choice = {"index": 0, "text": output.text, "finish_reason": None, "logprobs": None}
            if lps:
                choice["logprobs"] = _completion_logprobs(ids, lps, self.text, self.offset)
        self.offset += len(output.text)
        return self._openai(choice)

    def end(self) -> bytes:
        t = self.ticket
        if self.api.anthropic:
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": _ANTHROPIC_STOP[t.finish_reason], "stop_sequence": None},
                "usage": {"output_tokens": t.num_output_tokens, "device_time": device_time(t, self.unit)},
            }
            return (
                sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + sse(delta, "message_delta")
                + sse({"type": "message_stop"}, "message_stop")
            )
        last = {"index": 0, "finish_reason": t.finish_reason.value, "logprobs": None}
        last |= {"delta": {}} if self.api is Api.CHAT else {"text": ""}
        tail = self._openai({}, usage(self.api, t, self.unit)) if self.include_usage else b""
        return self._openai(last) + tail + sse("[DONE]")
