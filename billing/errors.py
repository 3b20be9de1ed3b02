"""Typed billing errors.

Each error belongs to one category base class; ``services/errors.py`` maps the
categories to gRPC status codes in one place.  ``field`` names the offending
request field (for google.rpc.BadRequest) and ``reason`` is a stable
UPPER_SNAKE code (for google.rpc.ErrorInfo).
"""

from __future__ import annotations


class BillingError(Exception):
    reason = "BILLING_ERROR"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


# Categories: one gRPC code each.
class InvalidArgument(BillingError):
    reason = "INVALID_ARGUMENT"


class NotFound(BillingError):
    reason = "NOT_FOUND"


class AlreadyExists(BillingError):
    reason = "ALREADY_EXISTS"


class FailedPrecondition(BillingError):
    reason = "FAILED_PRECONDITION"


class Unauthenticated(BillingError):
    reason = "UNAUTHENTICATED"


class PermissionDenied(BillingError):
    reason = "PERMISSION_DENIED"


class Unavailable(BillingError):
    """The ledger could not be used just now; nothing was committed, and the same call may be retried."""

    reason = "UNAVAILABLE"


# Concrete errors.
class InvalidRecord(InvalidArgument):
    reason = "INVALID_RECORD"


class InvalidPeriod(InvalidArgument):
    reason = "INVALID_PERIOD"

    def __init__(self, period: object, *, field: str = "period") -> None:
        super().__init__(f"{field} must be a calendar month 'YYYY-MM', got {period!r}", field=field)


class InvalidPageToken(InvalidArgument):
    reason = "INVALID_PAGE_TOKEN"

    def __init__(self, detail: str) -> None:
        super().__init__(f"page_token {detail}", field="page_token")


class InvalidPrice(InvalidArgument):
    reason = "INVALID_PRICE"


class DataRejected(InvalidArgument):
    """The database refused a value the domain checks let through (out of a column's range, NUL in text, a
    CHECK constraint): the request is wrong, not the ledger. Made from the driver's error by billing.db."""

    reason = "DATA_REJECTED"


class LedgerUnavailable(Unavailable):
    """The ledger database refused or dropped the connection, timed out, or a transaction lost a lock race."""

    reason = "LEDGER_UNAVAILABLE"


class LedgerConflict(AlreadyExists):
    """A concurrent writer stored the same unique key first (the database's unique constraint decided)."""

    reason = "LEDGER_CONFLICT"


class LedgerRefused(FailedPrecondition):
    """A ledger rule in the database (append-only tables, finalized invoices) refused the change."""

    reason = "LEDGER_REFUSED"


class AmountOutOfRange(FailedPrecondition):
    """A total of usage or money does not fit the ledger's signed 64-bit columns (see billing.aggregate)."""

    reason = "AMOUNT_OUT_OF_RANGE"


class UnknownTenant(NotFound):
    reason = "UNKNOWN_TENANT"

    def __init__(self, tenant: str, *, field: str = "tenant") -> None:
        super().__init__(f"{field}: no tenant named {tenant!r}", field=field)
        self.tenant = tenant


class TenantExists(AlreadyExists):
    reason = "TENANT_EXISTS"

    def __init__(self, tenant: str) -> None:
        super().__init__(f"name: tenant {tenant!r} already exists", field="name")
        self.tenant = tenant


class InvoiceNotFound(NotFound):
    reason = "INVOICE_NOT_FOUND"

    def __init__(self, invoice_id: int) -> None:
        super().__init__(f"invoice_id: no invoice {invoice_id}", field="invoice_id")
        self.invoice_id = invoice_id


class ApiKeyNotFound(NotFound):
    reason = "API_KEY_NOT_FOUND"

    def __init__(self, key_id: int) -> None:
        super().__init__(f"key_id: no API key {key_id}", field="key_id")


class PriceExists(AlreadyExists):
    reason = "PRICE_EXISTS"


class MissingPrice(FailedPrecondition):
    reason = "MISSING_PRICE"

    def __init__(self, model: str, unit: str, at_us: int, service_class: str = "") -> None:
        of_class = f" class {service_class!r} (nor a generic one)" if service_class else ""
        super().__init__(
            f"model: no price for model {model!r} unit {unit!r}{of_class} in force at {at_us} µs", field="model"
        )
        self.model, self.unit, self.at_us, self.service_class = model, unit, at_us, service_class


class CurrencyMismatch(FailedPrecondition):
    reason = "CURRENCY_MISMATCH"


class InvoiceFinalized(FailedPrecondition):
    """A write to a finalized (or void) invoice; corrections go through credit notes."""

    reason = "INVOICE_FINALIZED"

    def __init__(self, invoice_id: int, status: str) -> None:
        super().__init__(f"invoice_id: invoice {invoice_id} is {status} and cannot be changed", field="invoice_id")
        self.invoice_id, self.status = invoice_id, status


class InvoiceState(FailedPrecondition):
    """An invoice lifecycle step not allowed from the invoice's current status."""

    reason = "INVOICE_STATE"


class CreditExceedsInvoice(FailedPrecondition):
    reason = "CREDIT_EXCEEDS_INVOICE"


# Classes of service and tenant policies (billing/service_classes.py).
class InvalidClass(InvalidArgument):
    reason = "INVALID_CLASS"


class UnknownClass(NotFound):
    reason = "UNKNOWN_CLASS"

    def __init__(self, name: str, *, field: str = "service_class") -> None:
        super().__init__(f"{field}: no class of service named {name!r}", field=field)
        self.name = name


class ClassExists(AlreadyExists):
    reason = "CLASS_EXISTS"

    def __init__(self, name: str) -> None:
        super().__init__(f"name: a class of service named {name!r} already exists", field="name")
        self.name = name


class ClassRuleFixed(FailedPrecondition):
    """A class's name and credit rule never change (they decide money already billed); a new rule is a new class."""

    reason = "CLASS_RULE_FIXED"


class InvalidPolicy(InvalidArgument):
    reason = "INVALID_POLICY"
