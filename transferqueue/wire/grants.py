"""Grants: the controller's signed word that a writer may create rows on a storage unit.

A storage unit must not hold rows the controller never allocated: a write naming row 2**27
would otherwise size the unit's row map for 2**27 rows, and rows nobody knows of are never
freed. So ``allocate`` hands the writer, per unit its rows went to, a grant (the rows of one
allocation on one unit are one contiguous index range), and a unit creates rows only under a
grant that covers them. Controller and units share a secret key; a grant is::

    unit int32 | lo int64 | hi int64 | expires float64 (wall clock)   28 bytes, little-endian
    mac  16 bytes: keyed BLAKE2b of the above

Rows ``[lo, hi)`` may be created on ``unit`` until ``expires`` (a put writes right after it
allocates; the expiry stops a stale grant from re-creating rows long freed). Checking one costs
about a microsecond. Writes that add fields to rows a unit holds need no grant.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time

import numpy as np

from transferqueue.errors import DeniedError

__all__ = ["GRANT_TTL_S", "Grants", "new_grant_key"]

GRANT_TTL_S = 600.0
_BODY = struct.Struct("<iqqd")
_MAC_BYTES = 16


def new_grant_key() -> bytes:
    return secrets.token_bytes(32)


class Grants:
    """Signs grants (the controller) and checks them (a storage unit) with one shared key."""

    def __init__(self, key: bytes, ttl_s: float = GRANT_TTL_S) -> None:
        if len(key) < 16:
            raise ValueError("a grant key needs at least 16 bytes")
        self._key = key
        self.ttl_s = ttl_s

    def _mac(self, body: bytes) -> bytes:
        return hashlib.blake2b(body, key=self._key, digest_size=_MAC_BYTES).digest()

    def sign(self, unit: int, lo: int, hi: int, expires: float | None = None) -> bytes:
        """A grant for rows ``[lo, hi)`` on ``unit``, good until ``expires`` (wall clock;
        default: ``ttl_s`` from now)."""
        when = time.time() + self.ttl_s if expires is None else expires
        body = _BODY.pack(unit, lo, hi, when)
        return body + self._mac(body)

    def check(self, grant: bytes | None, unit: int, indexes: np.ndarray) -> None:
        """Raise :class:`DeniedError` unless ``grant`` lets ``unit`` create rows ``indexes``."""
        if grant is None:
            raise DeniedError(
                f"a write creating rows on unit {unit} needs the grant the controller gave with "
                "their allocation; put rows through a client (which allocates them first)"
            )
        if len(grant) != _BODY.size + _MAC_BYTES or not hmac.compare_digest(
            self._mac(grant[: _BODY.size]), grant[_BODY.size :]
        ):
            raise DeniedError(f"the grant for unit {unit} was not signed by this service")
        g_unit, lo, hi, expires = _BODY.unpack_from(grant)
        if g_unit != unit:
            raise DeniedError(f"a grant for unit {g_unit} was sent to unit {unit}")
        if time.time() > expires:
            raise DeniedError(
                f"the grant for rows {lo}..{hi - 1} expired; rows are written right after they "
                "are allocated (put again)"
            )
        if indexes.size and (int(indexes.min()) < lo or int(indexes.max()) >= hi):
            raise DeniedError(
                f"the write names rows outside {lo}..{hi - 1}, the rows the controller "
                f"allocated on unit {unit} to this writer"
            )
