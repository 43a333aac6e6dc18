"""``Specs``: the field specs a client knows, per partition, shared by its writes and reads.

Specs are fixed per partition (the same field name may have another spec in another
partition, and a partition that held no rows takes new ones). A put registers the specs of
the fields it writes (once per spec and partition: the controller answers with the registered
ones, and a spec that disagrees with a registered one is its
:class:`~transferqueue.errors.SchemaError`); a read asks the controller for the specs of
fields it has not seen (written by other clients). What is known here is a cache: it may be
stale after another client cleared a partition and wrote other specs to it, so a put whose
columns disagree with the cache asks the controller again (:meth:`Specs.refresh`), and so does
a read whose rows come back with another spec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transferqueue.client.links import ControllerLink
from transferqueue.errors import SchemaError, UnknownFieldError
from transferqueue.schema import Column, FieldSpec, normalize_columns
from transferqueue.wire import messages as m

__all__ = ["Specs"]


class Specs:
    """The specs of the fields this client has written or read, per partition (a cache of
    the controller's)."""

    def __init__(self, controller: ControllerLink) -> None:
        self._ctl = controller
        self._known: dict[str, dict[str, FieldSpec]] = {}

    def known(self, partition: str) -> dict[str, FieldSpec]:
        """The specs of ``partition`` known here (a copy)."""
        return dict(self._known.get(partition, {}))

    def forget(self, partition: str | None = None) -> None:
        """Drop what is known of ``partition`` (None: of every partition): it was cleared."""
        if partition is None:
            self._known.clear()
        else:
            self._known.pop(partition, None)

    async def register(
        self, specs: Mapping[str, FieldSpec], partition: str, *, again: bool = False
    ) -> None:
        """Register ``specs`` of ``partition`` with the controller: those not known here yet
        (``again``: all, for a cache that may predate a reset of the store)."""
        mine = self._known.get(partition, {})
        new = dict(specs) if again else {k: v for k, v in specs.items() if mine.get(k) != v}
        if new:
            msg = m.RegisterFields(specs=new, partition=partition)
            registered: dict[str, FieldSpec] = await self._ctl.call(msg)
            if any(mine.get(k, v) != v for k, v in registered.items()):
                mine = {}  # (the partition had forgotten its specs: so does the cache)
            mine.update(registered)
            self._known[partition] = mine

    async def refresh(self, partition: str) -> dict[str, FieldSpec]:
        """Every spec the controller has for ``partition`` (the cache replaced; a copy)."""
        registered: dict[str, FieldSpec] = await self._ctl.call(m.GetSpecs(partition=partition))
        self._known[partition] = dict(registered)
        return dict(registered)

    async def of(
        self, names: Sequence[str], partition: str, *, refresh: bool = False
    ) -> dict[str, FieldSpec]:
        """The specs of fields ``names`` of ``partition``, asked of the controller for those
        not known here (``refresh``: asked again); a field never written there is an
        :class:`UnknownFieldError`."""
        mine = self._known.get(partition, {})
        if refresh or any(f not in mine for f in names):
            mine = await self.refresh(partition)
            missing = [f for f in names if f not in mine]
            if missing:
                raise UnknownFieldError(
                    f"fields {missing} have never been written to partition {partition!r}; "
                    f"its fields: {sorted(mine)}"
                )
        return {f: mine[f] for f in names}

    async def normalize(
        self,
        data: Mapping[str, Any],
        partition: str,
        declared: Mapping[str, FieldSpec] | None = None,
        *,
        keep_device: bool = False,
    ) -> tuple[dict[str, Column], dict[str, FieldSpec], int]:
        """``data`` as canonical columns of ``partition`` (see
        :func:`~transferqueue.schema.normalize_columns`), against the specs known there and
        ``declared``. Columns that disagree with the cache are checked against the
        controller's specs, then inferred from the data alone: registering them is then
        what decides (the controller's :class:`SchemaError` names the field, the partition
        and both specs; a partition without rows takes the new ones)."""
        known = self.known(partition)
        known.update(declared or {})
        try:
            return normalize_columns(data, known, keep_device=keep_device)
        except SchemaError as first:
            if not any(n in self._known.get(partition, {}) for n in data):
                raise
            error = first
        fresh = await self.refresh(partition)
        fresh.update(declared or {})
        for specs in (fresh, dict(declared or {})):
            try:
                return normalize_columns(data, specs, keep_device=keep_device)
            except SchemaError:
                pass
        raise error
