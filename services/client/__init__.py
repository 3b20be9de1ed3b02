"""zeroqueue client SDK: deadline-aware Generate calls that retry rejections the way the server asks.

    from zeroqueue.client import Client, AsyncClient, Rejected   # the zeroqueue-client wheel (no torch)
    from services.client import Client, AsyncClient, Rejected    # the same code, inside the server's tree

The client wheel (distribution/, `make client-wheel`) installs these files as `zeroqueue.client`, beside the
generated stubs, so the SDK imports only the standard library, grpc, protobuf, google.rpc, the stubs and
itself (relatively): never the server's `services`, billing or torch (tests/client/test_imports.py).
"""

from .aio import AsyncClient, AsyncGeneration
from .client import Client, Generation
from .errors import (
    DeadlineExceeded,
    DeadlineInfeasible,
    InvalidRequest,
    PermissionDenied,
    QuotaExceeded,
    Rejected,
    RequestIdInUse,
    ServerError,
    Unauthenticated,
    Unavailable,
    ZeroQueueError,
)
from .failure import Failure, FieldViolation, QuotaViolation
from .request import Message
from .results import (
    Admission,
    AttemptRecord,
    CallReport,
    Chunk,
    ClassOffer,
    IncompleteOutput,
    ModelInfo,
    Result,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .retry import Retrier, RetryConfig

__all__ = [
    "Admission",
    "AsyncClient",
    "AsyncGeneration",
    "AttemptRecord",
    "CallReport",
    "Chunk",
    "ClassOffer",
    "Client",
    "DeadlineExceeded",
    "DeadlineInfeasible",
    "Failure",
    "FieldViolation",
    "Generation",
    "IncompleteOutput",
    "InvalidRequest",
    "Message",
    "ModelInfo",
    "PermissionDenied",
    "QuotaExceeded",
    "Rejected",
    "RequestIdInUse",
    "QuotaViolation",
    "Result",
    "RetryConfig",
    "Retrier",
    "ServerError",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "ZeroQueueError",
]
