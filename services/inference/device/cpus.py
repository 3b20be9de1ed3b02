"""Which cores the engine process and the server process run on (`zeroqueue serve --pin-cpus`). No torch here.

Pinned, the engine's threads have cores of their own and the server's threads share the rest, so no server
thread is ever scheduled into the middle of an engine step. Off by default: on the 2-core machine the server
then has one core for gRPC, admission and relaying tokens, and under 2-4x overload it fell behind
(BENCHMARKS.md, "Pulse"); with cores to spare for the server it is the layout to try.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def engine_threads(requested: int, allowed: Sequence[int]) -> int:
    """The engine's CPU threads: as requested, else every allowed core but one (left to the server)."""
    return requested or max(1, len(allowed) - 1)


def split_cpus(allowed: Sequence[int], num_engine_threads: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(engine cores, server cores): the engine takes the last `num_engine_threads` of the allowed cores, the
    server the others. None when there are not more cores than engine threads: nothing to keep apart."""
    cores = tuple(sorted(allowed))
    if num_engine_threads < 1 or len(cores) <= num_engine_threads:
        return None
    return cores[-num_engine_threads:], cores[:-num_engine_threads]


def allowed_cpus() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def pin(cpus: Sequence[int]) -> None:
    """Every thread of this process runs on `cpus` only (threads started later inherit it). Linux sets
    affinity per thread, so each existing thread is set, not just the caller."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
