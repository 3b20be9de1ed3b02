"""When recent engine steps began, to tell how many steps an admitted call waited before it first ran.

"Joins the very next step" is the product's promise: a call admitted while a step runs waits for that step
(0 steps waited), never for another. (Counted from the admission decision: a step that begins while the
decision is being made could not have taken the call; the time from receipt is the queue-time metric.) Queue time in
ms cannot show this on its own: a call more likely arrives
during a long step than a short one, so its mean wait is E[S²]/2E[S], above half a mean step.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque


class StepLog:
    """Start times (ns) of the last `capacity` steps that ran, appended in order by the step observer (the
    engine's thread or the event loop) and read on the event loop; a lock keeps the two apart."""

    def __init__(self, capacity: int = 4096) -> None:
        self._began_ns: deque[int] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, began_ns: int) -> None:
        with self._lock:
            self._began_ns.append(began_ns)

    def steps_began_between(self, after_ns: int, before_ns: int) -> int:
        """Steps that began strictly after `after_ns` and strictly before `before_ns` (bisect indexes the deque
        directly: a lookup is O(n/64) there, a dozen of them per call)."""
        with self._lock:
            return max(bisect.bisect_left(self._began_ns, before_ns) - bisect.bisect_right(self._began_ns, after_ns), 0)
