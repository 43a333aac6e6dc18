"""How a batch read from several storage units is assembled, in the batch's order.

Called by :meth:`AsyncClient._get_data <transferqueue.client.async_client.AsyncClient>` as each
unit's rows arrive: dense columns are copied into the batch's tensors (:func:`place_dense`), ragged
pieces merged into one :class:`Ragged` (:func:`merge_ragged`; shaped pieces of large rows are
chained over the units' buffers instead, see there); :func:`empty_column` is a
field's column of no rows. A unit's column that does not match the field's spec the reader
knows is :class:`StaleSpecs` (the partition was cleared and written with other specs since).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from transferqueue.memcpy import copy_rows
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.shaped import Shaped
from transferqueue.slots import runs

__all__ = ["StaleSpecs", "check_objects", "conform", "empty_column", "merge_ragged", "place_dense"]

_MIN_CHUNK_BYTES = 256 << 10
"""A shaped read is left in the units' buffers (one chunk per run of rows) when its runs
average at least this much; smaller ones are gathered into one buffer, as ragged reads are
(a chunk costs a few microseconds on every later pass over the rows; a 256 KiB copy about
as much)."""


class StaleSpecs(Exception):
    """A unit's column does not match the spec the reader used: learn the specs again."""


def place_dense(out: Mapping[str, torch.Tensor], pos: np.ndarray, got: dict[str, Column]) -> None:
    """Copy one unit's dense columns (its rows at batch positions ``pos``) into the batch's
    tensors, and drop them from ``got``: views of a lent arena give it back once gone.

    ``np.copyto`` (:func:`copy_rows`), not ``Tensor.copy_``: torch's intra-op threads wait
    on each other when the cores are busy (here with the units' own copies), and a 4-unit
    read of the 302 MB batch spent 0.6 s in ``copy_`` that numpy does in about 0.05 s.
    """
    for f, dst in out.items():
        src = got.pop(f)
        if (
            not isinstance(src, torch.Tensor)
            or src.dtype != dst.dtype
            or src.shape[1:] != dst.shape[1:]
        ):
            raise StaleSpecs(f)
        if src.data_ptr() == dst[int(pos[0]) :].data_ptr() and src.shape[0] == pos.size:
            continue  # read straight into place
        k = 0
        for a, b in runs(pos):
            copy_rows(dst[a:b], src[k : k + b - a])
            k += b - a


def empty_column(spec: FieldSpec) -> Column:
    if spec.kind == "dense":
        return torch.empty((0, *spec.shape), dtype=spec.torch_dtype)
    if spec.kind == "shaped":
        shapes = torch.zeros((0, spec.ndim), dtype=torch.int64)
        values = torch.empty((0,), dtype=spec.torch_dtype)
        return Shaped(values, torch.zeros(1, dtype=torch.int64), shapes)
    if spec.kind == "ragged":
        return Ragged(
            torch.empty((0, *spec.shape), dtype=spec.torch_dtype), torch.zeros(1, dtype=torch.int64)
        )
    return []


def merge_ragged(
    parts: list[tuple[np.ndarray, Column]],
    n: int,
    spec: FieldSpec,
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> Ragged:
    """Assemble per-unit Ragged pieces (positions, rows) into one in batch order (Shaped
    pieces into one Shaped, their shapes in the same order). ``alloc(shape, dtype)`` gives
    the merged values' memory (the handle's warm result buffers: fresh memory costs a page
    fault per 4 KiB touched, the most of a large merge); default ``torch.empty``.

    Shaped pieces whose runs of rows are large (images: :data:`_MIN_CHUNK_BYTES`) are not
    copied: the result is a :meth:`Shaped.concat` of the runs, over the units' buffers (a
    four-unit read of 78 MB of images spent 20 ms of its 23 ms in this copy)."""
    shaped = spec.kind == "shaped"
    if shaped:  # (rows stored before their field was widened from dense come back dense)
        parts = [
            (pos, Shaped.from_dense(col))
            if isinstance(col, torch.Tensor) and col.dim() == spec.ndim + 1
            else (pos, col)
            for pos, col in parts
        ]
    for _, col in parts:
        if not isinstance(col, Ragged) or col.dtype != spec.torch_dtype:
            raise StaleSpecs(spec.describe())
        if col.inner_shape != spec.shape or isinstance(col, Shaped) != shaped:
            raise StaleSpecs(spec.describe())
        if isinstance(col, Shaped) and col.ndim != spec.ndim:
            raise StaleSpecs(spec.describe())
    if len(parts) == 1:
        col = parts[0][1]
        assert isinstance(col, Ragged)
        return col
    if shaped:
        chained = _chain_shaped(parts, alloc)
        if chained is not None:
            return chained
    lengths = np.zeros(n, dtype=np.int64)
    for pos, col in parts:
        assert isinstance(col, Ragged)
        lengths[pos] = col.lengths.numpy()
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    shape = (int(offsets[-1]), *spec.shape)
    values = alloc(shape, spec.torch_dtype) if alloc else torch.empty(shape, dtype=spec.torch_dtype)
    for pos, col in parts:
        assert isinstance(col, Ragged)
        src_off = col.offsets.numpy()
        for a, b in runs(pos):
            k0 = int(np.searchsorted(pos, a))
            k1 = k0 + (b - a)
            copy_rows(
                values[int(offsets[a]) : int(offsets[b])],
                col.values[int(src_off[k0]) : int(src_off[k1])],
            )
    if shaped:
        shapes = torch.empty((n, spec.ndim), dtype=torch.int64)
        for pos, col in parts:
            assert isinstance(col, Shaped)
            shapes[torch.from_numpy(pos)] = col.shapes
        return Shaped(values, torch.from_numpy(offsets), shapes)
    return Ragged(values, torch.from_numpy(offsets))


def _chain_shaped(
    parts: list[tuple[np.ndarray, Column]],
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None,
) -> Shaped | None:
    """The pieces' rows in batch order as one Shaped over their buffers (a chunk per run
    of consecutive batch positions; ``alloc`` gives the memory if it is ever gathered), or
    None when the runs are too small to be worth it."""
    chunks: list[tuple[int, Shaped]] = []
    nbytes = 0
    for pos, col in parts:
        assert isinstance(col, Shaped)
        nbytes += col.nbytes
        k = 0
        for a, b in runs(pos):
            chunks.append((a, col.slice(k, k + b - a)))
            k += b - a
    if nbytes < _MIN_CHUNK_BYTES * len(chunks):
        return None
    chunks.sort(key=lambda c: c[0])
    return Shaped.concat([c for _, c in chunks], alloc=alloc)


def conform(cols: dict[str, Column], specs: Mapping[str, FieldSpec]) -> dict[str, Column]:
    """One unit's read as the batch (no assembly): a shaped field's rows stored before it was
    widened from dense come back dense and are viewed as Shaped; a field the reader knows as
    dense that comes back otherwise is :class:`StaleSpecs`."""
    for f, col in cols.items():
        spec = specs.get(f)
        if spec is None:
            continue
        if spec.kind == "shaped" and isinstance(col, torch.Tensor):
            if col.dim() != spec.ndim + 1:
                raise StaleSpecs(spec.describe())
            cols[f] = Shaped.from_dense(col)
        elif spec.kind == "dense" and isinstance(col, Ragged):
            raise StaleSpecs(spec.describe())
    return cols


def check_objects(col: Column) -> list[object]:
    """An object field's piece (a list); anything else is :class:`StaleSpecs`."""
    if not isinstance(col, list):
        raise StaleSpecs(type(col).__name__)
    return col
