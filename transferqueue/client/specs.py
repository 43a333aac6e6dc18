"""``Specs``: the field specs a client knows, shared by its writes and reads.

A put registers the specs of the fields it writes (once per spec: the controller answers
with the registered ones, and a spec that disagrees with a registered one is its
:class:`~transferqueue.errors.SchemaError`); a read asks the controller for the specs of
fields it has not seen (written by other clients).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transferqueue.client.links import ControllerLink
from transferqueue.errors import UnknownFieldError
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m

__all__ = ["Specs"]


class Specs:
    """The specs of the fields this client has written or read (a cache of the
    controller's)."""

    def __init__(self, controller: ControllerLink) -> None:
        self._ctl = controller
        self._known: dict[str, FieldSpec] = {}

    def known(self) -> dict[str, FieldSpec]:
        """The specs known here (a copy)."""
        return dict(self._known)

    async def register(self, specs: Mapping[str, FieldSpec], *, again: bool = False) -> None:
        """Register ``specs`` with the controller: those not known here yet (``again``: all,
        for a cache that may predate a reset of the store)."""
        new = dict(specs) if again else {k: v for k, v in specs.items() if self._known.get(k) != v}
        if new:
            registered: dict[str, FieldSpec] = await self._ctl.call(m.RegisterFields(specs=new))
            self._known.update(registered)

    async def fetch(self) -> dict[str, FieldSpec]:
        """Every spec the controller has (learnt here too; a copy)."""
        registered: dict[str, FieldSpec] = await self._ctl.call(m.GetSpecs())
        self._known.update(registered)
        return dict(self._known)

    async def of(self, names: Sequence[str]) -> dict[str, FieldSpec]:
        """The specs of fields ``names``, asked of the controller for those not known here;
        a field never written is an :class:`UnknownFieldError`."""
        if any(f not in self._known for f in names):
            await self.fetch()
            missing = [f for f in names if f not in self._known]
            if missing:
                raise UnknownFieldError(
                    f"fields {missing} have never been written; known: {sorted(self._known)}"
                )
        return {f: self._known[f] for f in names}
