"""The Metering gRPC servicer: protobuf ⇄ billing domain, authentication and authorization, one unit of work
per call run off the event loop; server.py hosts it. Every error is a typed domain error mapped by
services/errors.py; the database's own errors become billing errors in billing.db.ledger_errors (outage:
UNAVAILABLE, refused value: INVALID_ARGUMENT).

Who may see what: a tenant key reaches its own tenant only. Whatever else it asks for (another tenant by
name, an invoice that is not its tenant's, an admin-only method) is PERMISSION_DENIED, decided before the
ledger is read for it and the same whether or not that thing exists, so a refusal never reveals another
tenant's data, or even that an invoice id is in use. NOT_FOUND is for what the key could have seen."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
import structlog
from sqlalchemy.orm import Session, sessionmaker
from zeroqueue.metering.v1 import metering_pb2 as pb
from zeroqueue.metering.v1 import metering_pb2_grpc

from billing import invoices, ledger
from billing.chargeback import GROUPINGS, chargeback_report
from billing.db import ledger_errors, unit_of_work
from billing.errors import (
    InvalidArgument,
    InvalidRecord,
    InvoiceNotFound,
    LedgerUnavailable,
    PermissionDenied,
    UnknownTenant,
)
from billing.invoices import check_invoice_id
from billing.period import now_us as clock_us
from billing.records import MAX_INT64, IdleRecord, UsageRecord, check_tenant_name, freeze_labels
from billing.serving_policy import read_serving_policy
from billing.tenants import Principal
from services.auth import Authenticator, bearer_key
from services.metering.policy_wire import SharedRead, policy_to_proto
from services.metering.report_wire import chargeback_to_pb, invoice_to_pb
from services.status import rpc_errors

log = structlog.get_logger(__name__)
T = TypeVar("T")
MAX_RECORDS_PER_CALL = 10_000
_STATUS = {
    ledger.IngestStatus.ACCEPTED: pb.RECORD_STATUS_ACCEPTED,
    ledger.IngestStatus.DUPLICATE: pb.RECORD_STATUS_DUPLICATE,
    ledger.IngestStatus.CONFLICT: pb.RECORD_STATUS_CONFLICT,
}


# --- protobuf ⇄ domain -----------------------------------------------------------------------------------------


def usage_from_pb(message: pb.UsageRecord) -> UsageRecord:
    """Validated domain record; raises billing.errors.InvalidRecord naming the field."""
    return UsageRecord(
        call_id=message.call_id,
        tenant=message.tenant,
        labels=dict(message.labels),
        model=message.model,
        device_kind=message.device_kind,
        device_id=message.device_id,
        unit=message.unit,
        num_units=message.num_units,
        unit_us=message.unit_us,
        prompt_tokens=message.prompt_tokens,
        completion_tokens=message.completion_tokens,
        received_at_us=message.received_at_us,
        dispatched_at_us=message.dispatched_at_us,
        first_token_at_us=message.first_token_at_us if message.HasField("first_token_at_us") else None,
        finished_at_us=message.finished_at_us,
        deadline_at_us=message.deadline_at_us,
        deadline_met=message.deadline_met,
        outcome=message.outcome,  # the wire's string: UsageRecord makes it an Outcome, or refuses it naming the field
        request_id=message.request_id,
        service_class=message.service_class,  # '' (a sender before classes): standard
        request_kind=message.request_kind,  # '' (a sender before kinds): plain; an unknown one is refused, named
        door=message.door,  # '' (a sender before doors): grpc; an unknown one is refused, named
        cached_prompt_tokens=message.cached_prompt_tokens,  # 0 from a sender before the cache; > prompt_tokens: refused
        weight_dtype=message.weight_dtype,  # '' (a sender before weight dtypes): unknown; a malformed one is refused
    )


def usage_to_pb(record: UsageRecord) -> pb.UsageRecord:
    fields = record.to_payload()
    if fields["first_token_at_us"] is None:
        del fields["first_token_at_us"]
    return pb.UsageRecord(**fields)


def idle_from_pb(message: pb.IdleRecord) -> IdleRecord:
    return IdleRecord(
        record_id=message.record_id,
        device_id=message.device_id,
        unit=message.unit,
        num_units=message.num_units,
        minute_start_us=message.minute_start_us,
        idle_unit_us=message.idle_unit_us,
        wall_unit_us=message.wall_unit_us,
    )


def idle_to_pb(record: IdleRecord) -> pb.IdleRecord:
    return pb.IdleRecord(**record.to_payload())


def _check_group_by(group_by: Sequence[str]) -> list[str]:
    for name in group_by:
        if name not in GROUPINGS:
            raise InvalidArgument(f"group_by: {name!r} is not one of {', '.join(GROUPINGS)}", field="group_by")
    if len(set(group_by)) != len(group_by):
        raise InvalidArgument("group_by: a grouping is repeated", field="group_by")
    return list(group_by)


# --- RecordUsage, as one transaction -----------------------------------------------------------------------------


def _invalid(record_id: str, error: InvalidRecord | UnknownTenant) -> pb.RecordResult:
    return pb.RecordResult(id=record_id, status=pb.RECORD_STATUS_INVALID, message=error.message)


def _ingest_usage(session: Session, messages: Sequence[pb.UsageRecord]) -> list[pb.RecordResult]:
    results: list[pb.RecordResult | None] = [None] * len(messages)
    valid: dict[int, UsageRecord] = {}
    for index, message in enumerate(messages):
        try:
            valid[index] = usage_from_pb(message)
        except InvalidRecord as error:
            results[index] = _invalid(message.call_id, error)
    while True:
        try:
            stored = ledger.ingest_usage(session, list(valid.values()))
            break
        except UnknownTenant as error:  # raised before anything is written: refuse that tenant's records, retry
            for index in [i for i, record in valid.items() if record.tenant == error.tenant]:
                results[index] = _invalid(messages[index].call_id, error)
                del valid[index]
    for index, result in zip(valid, stored, strict=True):
        results[index] = pb.RecordResult(id=result.record_id, status=_STATUS[result.status])
    return results  # type: ignore[return-value]


def _ingest_idle(session: Session, messages: Sequence[pb.IdleRecord]) -> list[pb.RecordResult]:
    results: list[pb.RecordResult | None] = [None] * len(messages)
    valid: dict[int, IdleRecord] = {}
    for index, message in enumerate(messages):
        try:
            valid[index] = idle_from_pb(message)
        except InvalidRecord as error:
            results[index] = _invalid(message.record_id, error)
    for index, result in zip(valid, ledger.ingest_idle(session, list(valid.values())), strict=True):
        results[index] = pb.RecordResult(id=result.record_id, status=_STATUS[result.status])
    return results  # type: ignore[return-value]


def record_usage(session: Session, request: pb.RecordUsageRequest) -> pb.RecordUsageResponse:
    """Store a batch idempotently (the duplicate check is the insert itself, in the caller's transaction).

    Public so that a replica hosting the ledger in its own process can ship without a network hop:
    `with unit_of_work(sessions) as s: record_usage(s, request)` answers exactly what the RPC answers.
    """
    if len(request.records) + len(request.idle) > MAX_RECORDS_PER_CALL:
        raise InvalidArgument(
            f"records: at most {MAX_RECORDS_PER_CALL} records and idle records per call, "
            f"got {len(request.records) + len(request.idle)}",
            field="records",
        )
    return pb.RecordUsageResponse(
        records=_ingest_usage(session, request.records), idle=_ingest_idle(session, request.idle)
    )


def _log_conflicts(principal: Principal, response: pb.RecordUsageResponse) -> None:
    for kind, results in (("usage", response.records), ("idle", response.idle)):
        conflicts = [r.id for r in results if r.status == pb.RECORD_STATUS_CONFLICT]
        if conflicts:
            log.error(
                "metering.conflict",
                record_kind=kind,
                record_ids=conflicts[:50],
                num_conflicts=len(conflicts),
                key_id=principal.key_id,
                hint="same id, different payload: stored copy kept, see usage_conflicts",
            )


# --- who may see what ------------------------------------------------------------------------------------------


def _read_scope(principal: Principal, requested: str) -> str | None:
    """The tenant a read covers: a tenant key's own (another's is PERMISSION_DENIED); admin: as asked, '' = all.
    A name no tenant could have is INVALID_ARGUMENT before anything else: it never reaches the database."""
    if requested:
        check_tenant_name("tenant", requested)
    if principal.is_admin:
        return requested or None
    if requested:
        principal.authorize(requested)
    return principal.tenant


def _write_scope(principal: Principal, requested: str) -> str:
    """The tenant an invoice is generated for: a tenant key's own; an admin key must name one."""
    if principal.is_admin:
        if not requested:
            raise InvalidArgument("tenant: an admin key must name the tenant", field="tenant")
        check_tenant_name("tenant", requested)
        return requested
    return _read_scope(principal, requested)  # type: ignore[return-value]


def _visible_invoice(session: Session, principal: Principal, invoice_id: int) -> invoices.InvoiceView:
    """The invoice, if the key may see it. For a tenant key the look-up itself is limited to its tenant, so an
    invoice of another tenant is never read: it is refused exactly like one that does not exist."""
    if principal.is_admin:
        return invoices.get_invoice(session, invoice_id)
    try:
        return invoices.get_invoice(session, invoice_id, tenant=principal.tenant)
    except InvoiceNotFound:
        raise PermissionDenied(
            f"invoice_id: invoice {invoice_id} is not an invoice of tenant {principal.tenant!r}", field="invoice_id"
        ) from None


def _serving_policy(session: Session) -> pb.ServingPolicy:
    return policy_to_proto(read_serving_policy(session, clock_us()))


class MeteringServicer(metering_pb2_grpc.MeteringServicer):
    def __init__(self, sessions: sessionmaker[Session], authenticator: Authenticator) -> None:
        self.sessions, self.authenticator = sessions, authenticator
        self._policy = SharedRead(lambda: self._transaction(_serving_policy))

    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        return await self.authenticator.authenticate(bearer_key(context.invocation_metadata()))

    async def _transaction(self, work: Callable[[Session], T]) -> T:
        """`work` in one unit of work on a worker thread; transient database failures become UNAVAILABLE."""
        return await asyncio.to_thread(self._run, work)

    def _run(self, work: Callable[[Session], T]) -> T:
        try:
            with ledger_errors(), unit_of_work(self.sessions) as session:
                return work(session)
        except LedgerUnavailable as error:
            log.warning("ledger_unavailable", error=(str(error.__cause__ or error).splitlines() or [""])[0])
            raise

    async def RecordUsage(self, request: pb.RecordUsageRequest, context) -> pb.RecordUsageResponse:
        async with rpc_errors(context, "RecordUsage"):
            principal = await self._principal(context)
            principal.require_admin("RecordUsage")
            response = await self._transaction(lambda s: record_usage(s, request))
            _log_conflicts(principal, response)
            return response

    async def QueryUsage(self, request: pb.QueryUsageRequest, context) -> pb.QueryUsageResponse:
        async with rpc_errors(context, "QueryUsage"):
            tenant = _read_scope(await self._principal(context), request.tenant)
            labels = freeze_labels(dict(request.labels))
            page = await self._transaction(
                lambda s: ledger.query_usage(
                    s,
                    start_us=request.start_us,
                    end_us=request.end_us or MAX_INT64,
                    tenant=tenant,
                    labels=labels,
                    model=request.model or None,
                    page_size=request.page_size or ledger.DEFAULT_PAGE_SIZE,
                    page_token=request.page_token or None,
                )
            )
            return pb.QueryUsageResponse(
                records=[usage_to_pb(r) for r in page.records], next_page_token=page.next_page_token or ""
            )

    async def CreateInvoice(self, request: pb.CreateInvoiceRequest, context) -> pb.Invoice:
        async with rpc_errors(context, "CreateInvoice"):
            tenant = _write_scope(await self._principal(context), request.tenant)
            view = await self._transaction(lambda s: invoices.create_or_refresh_draft(s, tenant, request.period))
            return invoice_to_pb(view)

    async def FinalizeInvoice(self, request: pb.FinalizeInvoiceRequest, context) -> pb.Invoice:
        async with rpc_errors(context, "FinalizeInvoice"):
            (await self._principal(context)).require_admin("FinalizeInvoice")
            check_invoice_id(request.invoice_id)
            return invoice_to_pb(await self._transaction(lambda s: invoices.finalize_invoice(s, request.invoice_id)))

    async def GetInvoice(self, request: pb.GetInvoiceRequest, context) -> pb.Invoice:
        async with rpc_errors(context, "GetInvoice"):
            principal = await self._principal(context)
            check_invoice_id(request.invoice_id)
            return invoice_to_pb(await self._transaction(lambda s: _visible_invoice(s, principal, request.invoice_id)))

    async def ListInvoices(self, request: pb.ListInvoicesRequest, context) -> pb.ListInvoicesResponse:
        async with rpc_errors(context, "ListInvoices"):
            tenant = _read_scope(await self._principal(context), request.tenant)
            views = await self._transaction(
                lambda s: invoices.list_invoices(s, tenant=tenant, period=request.period or None)
            )
            return pb.ListInvoicesResponse(invoices=[invoice_to_pb(view) for view in views])

    async def GetChargebackReport(self, request: pb.GetChargebackReportRequest, context) -> pb.ChargebackReport:
        async with rpc_errors(context, "GetChargebackReport"):
            tenant = _read_scope(await self._principal(context), request.tenant)
            group_by = _check_group_by(request.group_by)
            report = await self._transaction(lambda s: chargeback_report(s, request.period, group_by, tenant=tenant))
            return chargeback_to_pb(report)

    async def GetServingPolicy(self, request: pb.GetServingPolicyRequest, context) -> pb.ServingPolicy:
        async with rpc_errors(context, "GetServingPolicy"):
            (await self._principal(context)).require_admin("GetServingPolicy")
            return await self._policy.get()  # at most a second old: one ledger read serves every replica's poll

    async def WhoAmI(self, request: pb.WhoAmIRequest, context) -> pb.Principal:
        async with rpc_errors(context, "WhoAmI"):
            principal = await self._principal(context)
            return pb.Principal(tenant=principal.tenant or "", role=principal.role.value)
