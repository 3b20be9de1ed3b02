"""The comparator of `zeroqueue serve --admission fifo`: what queueing servers do. No torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from .decisions import Admit, Commitment, Decision


class FifoAdmission:
    """The conventional server: admit everything, let the engine's queue grow without bound. An `Admission`
    (interface.py) that predicts nothing, refuses nothing and so promises nothing."""

    predicts = False

    def __init__(self) -> None:
        self.commitments: dict[str, Commitment] = {}
        self.events: Counter[str] = Counter()  # no refusal, so no promise: always empty

    @property
    def num_admitted(self) -> int:
        return len(self.commitments)

    @property
    def num_reserved(self) -> int:
        return 0

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        self.commitments[new.key] = new
        return Admit(predicted_finish_ns=0)

    def on_progress(self, key: str, num_generated: int) -> None:
        pass

    def step_ended(self, ended_ns: int) -> None:
        pass  # predicts nothing, so nothing waits on the step in flight

    def observe_finish(self, predicted_ns: int, actual_ns: int) -> None:
        pass

    def started(self, key: str) -> None:
        pass  # nothing is held

    def release(self, key: str) -> None:
        self.commitments.pop(key, None)

    def due(self, now_ns: int) -> list[str]:
        return []  # nothing is held: every call goes to the engine's queue at once

    def set_weights(self, weights: Mapping[str, float]) -> None:
        pass  # no fair share: every call is admitted
