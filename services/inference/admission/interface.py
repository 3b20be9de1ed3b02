"""What the service asks of admission, whichever it has (as vLLM's sched/interface.py): deadline admission
(controller.py `AdmissionController`) and the FIFO comparator (fifo.py `FifoAdmission`) both are one. The
service, the replica and the metrics hold an `Admission` and never ask which. No torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Protocol

from .decisions import Commitment, Decision


class FreeBlocks(Protocol):
    """The paged KV pool as deadline admission plans it (kv_pool.py `KvReservations`): how many blocks a call
    could take now."""

    @property
    def num_free(self) -> int: ...


class Admission(Protocol):
    @property
    def predicts(self) -> bool:
        """Whether decisions predict finishes: then the engine is told each call's deadline, and admission hears
        how long admitted calls really took (observe_finish). FIFO predicts nothing."""
        ...

    @property
    def num_admitted(self) -> int:
        """Calls admitted and not yet released."""
        ...

    @property
    def num_reserved(self) -> int:
        """Slots held for refused calls' hinted retries."""
        ...

    @property
    def events(self) -> Counter[str]:
        """What became of the promises to refused calls, by event (metrics.ReservationEvents reads it at scrape
        time): a live count, not a copy."""
        ...

    def decide(self, new: Commitment, now_ns: int) -> Decision:
        """Admit `new` now, or refuse it (with when to retry), or say no budget like it could ever be met."""
        ...

    def on_progress(self, key: str, num_generated: int) -> None:
        """The admitted call under `key` (call.py `admission_key`) has generated `num_generated` tokens."""
        ...

    def step_ended(self, ended_ns: int) -> None:
        """The engine ended a step at `ended_ns` and began the next if it has work: a call decided while that one
        runs joins only the step after it. May be called on the engine's thread."""
        ...

    def observe_finish(self, predicted_ns: int, actual_ns: int) -> None:
        """A call admitted with `predicted_ns` to go took `actual_ns`."""
        ...

    def started(self, key: str) -> None:
        """The call under `key`, held for a later start, has reached the engine with its KV blocks taken (where
        admission plans them, a held call takes them at its start): it runs as any admitted call from now."""
        ...

    def release(self, key: str) -> None:
        """The call under `key` is done (finished, cancelled or never started): its slot is free."""
        ...

    def due(self, now_ns: int) -> list[str]:
        """The admitted calls held for a later start (`Admit.start_ns`) that may start now, a slot having freed
        early: the service hands them to the engine at once instead of at their planned start. Call it after
        `release`."""
        ...

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """The tenants' weights in fair share, as the replica's serving policy now says."""
        ...
