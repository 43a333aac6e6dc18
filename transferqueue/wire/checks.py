"""Checks of request fields that msgspec's own constraints cannot express.

Each :class:`Check` is a field annotation of a message kind (``Annotated[T, Meta(...),
SomeCheck()]`` in :mod:`transferqueue.wire.messages`), applied after decoding and to messages a
client builds in-process; a failure is a ``ValueError`` or :class:`BadRequestError` that
names the field. :func:`encode_meta` checks and encodes one row's custom metadata.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import BadRequestError
from transferqueue.limits import (
    MAX_KEY_CHARS,
    MAX_KEYS,
    MAX_META_BYTES,
    MAX_META_REQUEST_BYTES,
    MAX_OBJECT_DEPTH,
    MAX_ROWS,
)
from transferqueue.ragged import Ragged

__all__ = ["Check", "Columns", "Ints", "KeyList", "MetaMaps", "check_plain", "encode_meta"]


# -- checks msgspec cannot express ---------------------------------------------------------------
class Check:
    """A field constraint applied after decoding (``Annotated[T, Meta(...), SomeCheck()]``)."""

    def __call__(self, value: Any, field: str) -> Any:
        return value


class Ints(Check):
    """A numpy integer array of ``ndim`` dimensions (0: one value for every row), as int64."""

    def __init__(self, *ndims: int) -> None:
        self.ndims = ndims or (1,)

    def __call__(self, value: Any, field: str) -> Any:
        if value is None:
            return None
        if (
            not isinstance(value, np.ndarray)
            or value.ndim not in self.ndims
            or value.dtype.kind not in "iu"
        ):
            got = f"{value.dtype} {value.ndim}-D array" if isinstance(value, np.ndarray) else value
            raise ValueError(f"{field} must be a {self.ndims}-D integer array, got {got!r:.80}")
        if value.size > MAX_ROWS:
            raise ValueError(f"{field} has {value.size} rows, more than {MAX_ROWS} in one request")
        return value if value.dtype == np.int64 else value.astype(np.int64)


class Columns(Check):
    """Column values: a tensor (dense), a :class:`Ragged`, or a list of plain msgpack values
    nested at most ``MAX_OBJECT_DEPTH`` deep (object)."""

    def __call__(self, value: Any, field: str) -> Any:
        for name, col in value.items():
            if isinstance(col, torch.Tensor | ChunkedTensor | Ragged):
                continue
            if not isinstance(col, list):
                raise ValueError(f"{field}[{name!r}] is a {type(col).__name__}, not a column")
            for row, v in enumerate(col):
                check_plain(v, f"{field}[{name!r}] row {row}")
        return value


_SCALARS = (type(None), bool, int, float, str, bytes)


def check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` is msgpack data (str-keyed maps) nested at most
    ``MAX_OBJECT_DEPTH`` deep: what an object field may hold."""
    if isinstance(value, _SCALARS):
        return
    if depth >= MAX_OBJECT_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_OBJECT_DEPTH}")
    if isinstance(value, list):
        for v in value:
            check_plain(v, where, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: map keys must be strings, got {k!r:.40}")
            check_plain(v, where, depth + 1)
    else:
        raise ValueError(f"{where}: a {type(value).__name__} is not an object value")


def encode_meta(meta: Any, where: str) -> bytes:
    """One row's custom metadata as msgpack, checked: a map with string keys of msgpack
    values, at most ``MAX_META_BYTES`` encoded (else :class:`BadRequestError`)."""
    if not isinstance(meta, dict):
        raise BadRequestError(f"{where}: custom meta must be a dict, got {type(meta).__name__}")
    try:
        check_plain(meta, where)
        raw = msgspec.msgpack.encode(meta)
    except (ValueError, TypeError, OverflowError) as e:
        raise BadRequestError(f"{where}: custom meta must be msgpack data: {e}") from None
    if len(raw) > MAX_META_BYTES:
        raise BadRequestError(
            f"{where}: custom meta is {len(raw)} bytes as msgpack, more than MAX_META_BYTES="
            f"{MAX_META_BYTES}; keep payload in fields (put), metadata small"
        )
    return raw


class MetaMaps(Check):
    """Custom metadata of rows: msgpack maps (see :func:`encode_meta`), at most
    ``MAX_META_REQUEST_BYTES`` in all; each must decode to a map of msgpack values."""

    def __call__(self, value: Any, field: str) -> Any:
        total = sum(len(raw) for raw in value)
        if total > MAX_META_REQUEST_BYTES:
            raise BadRequestError(
                f"{field}: {total} bytes of custom meta in one request, more than "
                f"MAX_META_REQUEST_BYTES={MAX_META_REQUEST_BYTES}; split the call"
            )
        for row, raw in enumerate(value):
            try:
                meta = msgspec.msgpack.decode(raw)
            except (msgspec.DecodeError, RecursionError):
                raise BadRequestError(f"{field} row {row}: not msgpack") from None
            if not isinstance(meta, dict):
                raise BadRequestError(f"{field} row {row}: custom meta must be a map")
            check_plain(meta, f"{field} row {row}")
        return value


class KeyList(Check):
    """Keys of the key-value calls: 1 to ``MAX_KEYS`` distinct non-empty strings of at most
    ``MAX_KEY_CHARS`` characters (msgspec bounds the decoded form; this also checks what a
    client builds in-process)."""

    def __call__(self, value: Any, field: str) -> Any:
        if value is None:  # (where a kind allows None: every key)
            return None
        if not isinstance(value, list) or not value or len(value) > MAX_KEYS:
            got = f"{len(value)} keys" if isinstance(value, list) else type(value).__name__
            raise BadRequestError(
                f"{field}: expected a list of 1..{MAX_KEYS} keys (MAX_KEYS), got {got}; "
                "split larger calls"
            )
        for i, key in enumerate(value):
            if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
                got = f"{len(key)} characters" if isinstance(key, str) else type(key).__name__
                raise BadRequestError(
                    f"{field}[{i}]: a key is a non-empty str of at most {MAX_KEY_CHARS} "
                    f"characters (MAX_KEY_CHARS), got {got}: {key!r:.60}"
                )
        if len(set(value)) != len(value):
            twice = [k for k, c in Counter(value).items() if c > 1][:5]
            raise BadRequestError(f"{field}: keys {twice} appear more than once; name each once")
        return value
