"""The ledger and billing: usage records, prices, invoices and chargeback.

Domain functions take a SQLAlchemy ``Session`` and never commit; the caller
opens a unit of work with :func:`billing.db.unit_of_work`, which is the only
place that commits.
"""
