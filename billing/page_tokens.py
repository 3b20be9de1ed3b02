"""Page tokens of QueryUsage: a keyset position, tied to the query's filters and signed by the ledger.

A token is ``base64url(json) "." base64url(HMAC-SHA256(secret, json)[:16])``; the JSON holds a version, a
fingerprint of the filters it was issued for and the last row it returned.  Only a token this ledger signed
is read, so a client can neither forge a position (out-of-range integers that the database would refuse) nor
move a token to other filters.  Every failure is :class:`InvalidPageToken` (INVALID_ARGUMENT, field
``page_token``).

The secret lives in the ledger itself (table ``ledger_secrets``, row ``page_token``, 32 random bytes made
by migration 0003), not in a file beside one server: every Metering server on the same database accepts the
others' tokens and a restart keeps them valid, while a token from another ledger, from before 0003 or from
before the secret was replaced (an operator may UPDATE the row to rotate it) fails its signature, and the
client repeats its query from the start.  It is not made on first use: a read that is never committed would
sign with a secret nobody keeps.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json

from sqlalchemy import select
from sqlalchemy.orm import Session

from billing.errors import FailedPrecondition, InvalidPageToken
from billing.models import LedgerSecret
from billing.records import MAX_INT64

SECRET_NAME = "page_token"
VERSION = 2
TAG_BYTES = 16
MAX_TOKEN_CHARS = 512
_NOT_OURS = "is not a token this ledger issued; repeat the query without it"


def page_token_key(session: Session) -> bytes:
    """The ledger's signing key."""
    found = session.scalar(select(LedgerSecret.secret).where(LedgerSecret.name == SECRET_NAME))
    if found is None:
        raise FailedPrecondition(
            "page_token: the ledger has no page-token secret (made by revision 0003); run `zeroqueue migrate`",
            field="page_token",
        )
    return bytes.fromhex(found)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _tag(key: bytes, body: str) -> str:
    return _b64(hmac.new(key, body.encode(), hashlib.sha256).digest()[:TAG_BYTES])


def encode_page_token(key: bytes, fingerprint: str, finished_at_us: int, row_id: int) -> str:
    raw = json.dumps({"v": VERSION, "q": fingerprint, "after": [finished_at_us, row_id]}, separators=(",", ":"))
    body = _b64(raw.encode())
    return f"{body}.{_tag(key, body)}"


def decode_page_token(key: bytes, token: str, fingerprint: str) -> tuple[int, int]:
    """The (finished_at_us, id) after which the next page starts."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
        raise InvalidPageToken(_NOT_OURS)
    body, tag = token.split(".")
    if not hmac.compare_digest(tag.encode("utf-8", "replace"), _tag(key, body).encode()):
        raise InvalidPageToken(_NOT_OURS)
    try:
        raw = json.loads(_unb64(body))
        finished_at_us, row_id = raw["after"]
        version, issued_for = raw["v"], raw["q"]
    except (ValueError, KeyError, TypeError, binascii.Error) as error:
        raise InvalidPageToken(_NOT_OURS) from error
    if version != VERSION or not all(type(v) is int and 0 <= v <= MAX_INT64 for v in (finished_at_us, row_id)):
        raise InvalidPageToken(_NOT_OURS)
    if issued_for != fingerprint:
        raise InvalidPageToken("was issued for different filters; repeat the query that produced it")
    return finished_at_us, row_id
