"""Which cores the engine process and the server process run on (`zeroqueue serve --pin-cpus`), and how the
server yields the CPU to the engine (`--server-nice`). No torch here.

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
        except ProcessLookupError:          # a thread that ended meanwhile
            pass


# The server's niceness above its CPU engine's when `zeroqueue serve` is not told: under 4x overload on the
# 2-core VM it raised goodput from 88 to 101 req/s in the same schedule (BENCHMARKS.md, "Pulse").
CPU_SERVER_NICENESS = 10


def server_niceness(requested: int | None, engine_process: bool, engine_on_cpu: bool) -> int:
    """How much lower than the engine's this process's priority is: as requested, else CPU_SERVER_NICENESS
    when a CPU engine runs in its own process (its steps compete with this process's gRPC threads for the
    same cores), else 0 (in one process they are the same threads' priority; a GPU step is not CPU-bound)."""
    if requested is not None:
        return requested
    return CPU_SERVER_NICENESS if engine_process and engine_on_cpu else 0


def lower_priority(niceness: int) -> None:
    """Every thread of this process becomes `niceness` nicer (threads started later inherit it from the
    thread that starts them). Linux sets niceness per thread, so each existing thread is set, as pin does."""
    if niceness <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + niceness, 19))
        except ProcessLookupError:          # a thread that ended meanwhile
            pass
