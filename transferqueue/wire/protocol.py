"""The base of every message kind: who may send it, which server answers, the reply's type.

A message kind (declared in :mod:`transferqueue.wire.messages`) subclasses
:class:`ControllerRequest` or :class:`UnitRequest` parametrized with its reply type; declaring
it registers it in :data:`KINDS` under its server *role* and its ``kind`` name. This module
also holds the field types kinds are built from (names, row arrays, waits, keys: each with its
bound from :mod:`transferqueue.limits`) and the dispatch from a kind to its handler
(:func:`handlers`).

TransferQueue's roles are ``controller`` and ``unit``. A package built on this wire declares
a role of its own the same way: a base ``class MyRequest(Request[R]): server = "my-role"``
(one table of kinds per role, so its kind names never clash with TransferQueue's), kinds
subclassing it, and an :class:`~transferqueue.wire.rpc.RpcServer` built with
``handlers("my-role", obj)`` (asyncflow's weight transports do: the ``weights`` role).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, get_args, get_origin
from typing import get_type_hints as _hints

import msgspec
import numpy as np
from msgspec import Meta

from transferqueue.errors import DeniedError
from transferqueue.limits import (
    MAX_INDEX,
    MAX_KEY_CHARS,
    MAX_KEYS,
    MAX_META_BYTES,
    MAX_NAME_CHARS,
    MAX_NAMES,
    MAX_OPTIONS,
    MAX_ROWS,
    MAX_WAIT_S,
)
from transferqueue.schema import FieldSpec
from transferqueue.wire.checks import Check, Columns, Ints, KeyList, MetaMaps

__all__ = [
    "KINDS",
    "TRUSTED",
    "Caller",
    "ControllerRequest",
    "Handler",
    "Request",
    "UnitRequest",
    "dispatch",
    "handlers",
]

R = TypeVar("R")
Server = str
"""A server role: ``controller`` and ``unit`` here, others declared by packages on top."""
Role = Literal["client", "admin", "service"]
_RANK = {"client": 0, "admin": 1, "service": 2}


@dataclass(frozen=True)
class Caller:
    """Who sent a request. ``identity``: the client's CURVE public key (z85), None when the
    service runs without keys. ``role``: ``client`` < ``admin`` < ``service`` (the servers of
    the service itself); without keys every caller is trusted as ``service``."""

    identity: str | None = None
    role: Role = "service"

    def may(self, needs: Role) -> bool:
        return _RANK[self.role] >= _RANK[needs]


TRUSTED = Caller()
"""The caller of an embedded deployment, and of a service without keys."""


# -- field types ---------------------------------------------------------------------------------
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Names = Annotated[list[Name], Meta(max_length=MAX_NAMES)]
Specs = Annotated[dict[Name, FieldSpec], Meta(max_length=MAX_NAMES)]
Count = Annotated[int, Meta(ge=0, le=MAX_ROWS)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
LeaseId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_INDEX)]
WaitS = Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)]  # (NaN fails every bound)
LeaseS = Annotated[float, Meta(gt=0.0, le=MAX_WAIT_S)]
Rows = Annotated[np.ndarray, Ints(1)]
PerRow = Annotated[np.ndarray, Ints(0, 1)]  # one value per row, or one for all rows
Options = Annotated[
    dict[Annotated[str, Meta(max_length=64)], int | float | str | bool | None],
    Meta(max_length=MAX_OPTIONS),
]
ArenaName = Annotated[str, Meta(max_length=64)]
Grant = Annotated[bytes, Meta(max_length=64)]
Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Keys = Annotated[list[Key], Meta(min_length=1, max_length=MAX_KEYS), KeyList()]
ColumnMap = Annotated[dict[Name, Any], Meta(max_length=MAX_NAMES), Columns()]
MetaList = Annotated[
    list[Annotated[bytes, Meta(max_length=MAX_META_BYTES)]], Meta(max_length=MAX_ROWS), MetaMaps()
]


# -- the base of every kind ----------------------------------------------------------------------
class Request(msgspec.Struct, Generic[R], array_like=True, forbid_unknown_fields=True):
    """Base of every message kind. A kind sets ``kind`` (its name on the wire, and the name of
    its handler method) and subclasses :class:`ControllerRequest` or :class:`UnitRequest`
    parametrized with its reply type."""

    kind: ClassVar[str]
    server: ClassVar[Server]
    needs: ClassVar[Role] = "client"
    """The least role that may send it (see :class:`Caller`)."""
    waits: ClassVar[bool] = False
    """Whether the server may hold it up to its ``timeout_s`` field. A client sends such a
    request in slices (``partial=False`` and a short ``timeout_s``: at the end of a slice the
    server answers None), so a server that dies is noticed within a slice."""
    reply: ClassVar[Any]
    """The type the reply decodes into (set from the class's ``Request[...]`` parameter)."""
    wire_reply: ClassVar[Any]
    """``reply``, or ``reply | None`` for a kind that ``waits`` (a slice that ran out)."""
    _checks: ClassVar[tuple[tuple[str, Check], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return  # an intermediate base (a role's, such as ControllerRequest)
        table = KINDS.setdefault(cls.server, {})
        if kind in table:
            raise TypeError(f"message kind {kind!r} of the {cls.server} is declared twice")
        table[kind] = cls
        cls.reply = _reply_type(cls)
        cls.wire_reply = cls.reply | None if cls.waits and cls.reply is not None else cls.reply
        cls._checks = _Pending  # resolved on first use (annotations are strings until then)

    def __post_init__(self) -> None:
        checks = type(self)._checks
        if checks is _Pending:
            checks = type(self)._checks = _collect_checks(type(self))
        for name, check in checks:
            setattr(self, name, check(getattr(self, name), name))


_Pending: Any = object()
KINDS: dict[Server, dict[str, type[Request[Any]]]] = {"controller": {}, "unit": {}}
"""Every declared kind, per server role: ``KINDS["controller"]["get_meta"] is GetMeta``."""


def _reply_type(cls: type) -> Any:
    for base in getattr(cls, "__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Request):
            (reply,) = get_args(base)
            return None if reply is type(None) else reply
    raise TypeError(
        f"{cls.__name__} must subclass ControllerRequest[R], UnitRequest[R] or another role's "
        "request base parametrized with its reply type"
    )


def _collect_checks(cls: type) -> tuple[tuple[str, Check], ...]:
    out = []
    for name, hint in _hints(cls, include_extras=True).items():
        for part in (hint, *get_args(hint)):  # (X | None) wraps the Annotated
            if get_origin(part) is Annotated:
                out += [(name, m) for m in part.__metadata__ if isinstance(m, Check)]
    return tuple(out)


class ControllerRequest(Request[R]):
    server = "controller"


class UnitRequest(Request[R]):
    server = "unit"


# -- dispatch ------------------------------------------------------------------------------------
Handler = Callable[[Any, Caller], Any]


def handlers(server: Server, *objects: object) -> dict[type[Request[Any]], Handler]:
    """Each declared kind of ``server`` -> the method named after it on the first of
    ``objects`` that has one: ``method(message, caller)`` returns the reply, or an awaitable
    of it. A kind without a handler is an error here, when the server is built."""
    if server not in KINDS:
        raise TypeError(f"no message kinds are declared for the server role {server!r}")
    table: dict[type[Request[Any]], Handler] = {}
    for kind, cls in KINDS[server].items():
        for obj in objects:
            method = getattr(obj, kind, None)
            if callable(method):
                table[cls] = method
                break
        else:
            raise TypeError(f"no handler for the {server} message kind {kind!r}")
    return table


async def dispatch(table: dict[type[Request[Any]], Handler], msg: Request[R], caller: Caller) -> R:
    """Run ``msg``'s handler in this process (the embedded deployment's link)."""
    if not caller.may(msg.needs):
        raise DeniedError(f"{msg.kind!r} needs the {msg.needs} key")
    result = table[type(msg)](msg, caller)
    if inspect.isawaitable(result):
        result = await result
    return result
