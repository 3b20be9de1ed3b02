"""What observers (the meter, the cost model, the metrics) learn of each engine step: plain data, so the same
observers work on the engine's thread and in the server process across a pipe. No torch here.

Named tuples, not dataclasses: a digest is built on every step, and its wire form (plain tuples of ints and
strings) pickles in about a microsecond, where a dataclass took several (measured: bench/metering_overhead.py).
"""
from __future__ import annotations

from typing import NamedTuple

from .request import Request, RequestStatus


class EndedRequest(NamedTuple):
    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_ns: int | None


class StepDigest(NamedTuple):
    began_ns: int                   # step() entered: taking new requests and scheduling count too
    ended_ns: int
    ran: bool                       # the executor ran; False when requests only ended (cancelled, expired)
    work: tuple[tuple[str, int], ...]   # (request_id, tokens run): decodes first (1 each), then prompt chunks
    context_tokens: int             # positions the decode rows attended to, summed
    ended: tuple[EndedRequest, ...]  # finished, cancelled or expired in this step
    num_unfinished: int             # requests still in the engine after this step
    num_free_slots: int

    @property
    def interval_ns(self) -> int:
        return self.ended_ns - self.began_ns

    @property
    def num_seqs(self) -> int:
        return len(self.work)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.work)

    def to_wire(self) -> tuple:
        """Plain tuples only (the status as its int), for the pipe to the server process."""
        ended = tuple((e[0], int(e[1]), e[2], e[3], e[4]) for e in self.ended)
        return (*self[:5], ended, self.num_unfinished, self.num_free_slots)

    @classmethod
    def from_wire(cls, wire: tuple) -> StepDigest:
        ended = tuple(EndedRequest(rid, RequestStatus(status), prompt, output, first)
                      for rid, status, prompt, output, first in wire[5])
        return cls(*wire[:5], ended, *wire[6:])


def ended_request(request: Request) -> EndedRequest:
    return EndedRequest(request.request_id, request.status, request.num_prompt_tokens, request.num_output_tokens,
                        request.first_token_ns)
