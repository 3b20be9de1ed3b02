"""The status of every refusal stays small: at most twenty field violations listed and the rest counted, and a
final cap on the whole google.rpc.Status whatever an error holds (services/status.py)."""

from __future__ import annotations

import base64
import urllib.parse

from google.rpc import error_details_pb2, status_pb2

from services import errors
from services.errors import FieldViolation
from services.status import MAX_STATUS_BYTES, status_for, to_grpc_status
from tests.inference.test_input_bounds import SOFT_METADATA_LIMIT


def test_many_violations_list_twenty_and_count_the_rest():
    status = status_for(errors.InvalidArgument([FieldViolation(f"f{i}", "bad") for i in range(50)]))
    (bad,) = [d for d in status.details if d.DESCRIPTOR.name == "BadRequest"]
    assert len(bad.field_violations) == 21 and bad.field_violations[-1].description == "and 30 more not listed"
    assert status.message.endswith("; and 30 more")


def test_the_final_cap_holds_for_any_error():
    """The safety net in to_grpc_status: huge descriptions, fields, messages and metadata still fit."""
    cases = [
        errors.InvalidArgument([FieldViolation("f" * 10_000, "d" * 10_000) for _ in range(30)]),
        errors.InvalidArgument([FieldViolation(f"f{i}", "é" * 300) for i in range(20)]),
        errors.NotServing("m" * 100_000, {f"k{i}": "v" * 10_000 for i in range(50)}),
        errors.MalformedRequest("T", FieldViolation("x" * 5000, "y" * 5000)),
    ]
    for error in cases:
        converted = to_grpc_status(status_for(error))
        blob = dict(converted.trailing_metadata)["grpc-status-details-bin"]
        proto = status_pb2.Status.FromString(blob)
        assert proto.ByteSize() <= MAX_STATUS_BYTES and len(converted.details.encode()) <= 512
        assert proto.details and proto.code == error.code.value[0]
        assert len(urllib.parse.quote(converted.details)) + len(base64.b64encode(blob)) < SOFT_METADATA_LIMIT
    # what the safety net drops is still counted: listed + "and N more" = all 30
    blob = dict(to_grpc_status(status_for(cases[0])).trailing_metadata)["grpc-status-details-bin"]
    bad = error_details_pb2.BadRequest()
    next(d for d in status_pb2.Status.FromString(blob).details if d.Unpack(bad))
    *listed, more = bad.field_violations
    assert all(len(v.field) <= 129 for v in listed) and more.field == ""
    assert len(listed) + int(more.description.split()[1]) == 30
