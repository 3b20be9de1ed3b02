"""What observers (the meter, the cost model, the metrics) learn of each engine step: plain, picklable data,
so the same observers work on the engine's thread and in the server process across a pipe. No torch here."""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class EndedRequest:
    request_id: str
    status: RequestStatus
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_ns: int | None


@dataclass(frozen=True, slots=True)
class StepDigest:
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


def ended_request(request: Request) -> EndedRequest:
    return EndedRequest(request.request_id, request.status, request.num_prompt_tokens, request.num_output_tokens,
                        request.first_token_ns)
