"""Alembic revisions of the ledger (a package so that non-editable installs ship them)."""
