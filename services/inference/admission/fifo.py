"""The comparator of `zeroqueue serve --admission fifo`: what queueing servers do. No torch."""

from __future__ import annotations

from .decisions import Admit, Commitment, Decision


class FifoAdmission:
    """The conventional server: admit everything, let the engine's queue grow without bound."""

    def __init__(self) -> None:
        self.commitments: dict[str, Commitment] = {}

    @property
    def num_admitted(self) -> int:
        return len(self.commitments)

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        self.commitments[new.request_id] = new
        return Admit(predicted_finish_ns=0)

    def on_progress(self, request_id: str, num_generated: int) -> None:
        pass

    def observe_finish(self, predicted_ns: int, actual_ns: int) -> None:
        pass

    def release(self, request_id: str) -> None:
        self.commitments.pop(request_id, None)
