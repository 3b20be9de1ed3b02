"""The serving policy on a replica: the book that holds the latest ServingPolicy (billing/policy.py) read from the
ledger or the metering service in the background, and each tenant's weight in fair share (book.py); the class of
service a call gets from the class it names and its budget, and tenants' quotas at admission: monthly caps and calls
per second (gate.py); whose prefix cache a call may share (gate.py). Calls only read the book's frozen
policy, on the event loop, with no I/O. It may import the standard library, billing/policy.py (the policy's plain
data), services/errors.py and the call's shapes (call.py); the ledger and the metering protocol only inside the
readers that need them; no torch, nothing of the engine, the device or admission (admission is told the weights, it
never reads the book).

The book, the gate and the class rule are re-exported here, so callers write `from services.inference.policy
import PolicyBook, QuotaGate, class_of`.
"""

from .book import DEFAULT_REFRESH_S, PolicyBook, ledger_reader, remote_reader, weights_of
from .gate import PrefixCachePolicy, QuotaGate, class_of

__all__ = [
    "DEFAULT_REFRESH_S",
    "PolicyBook",
    "PrefixCachePolicy",
    "QuotaGate",
    "class_of",
    "ledger_reader",
    "remote_reader",
    "weights_of",
]
