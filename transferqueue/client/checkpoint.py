"""Store checkpoints: ``client.save(path)`` writes partitions to a directory of Arrow IPC
files, ``client.load(path)`` puts them into another store (any deployment). ``Checkpoints`` is
a part of :class:`~transferqueue.client.async_client.AsyncClient`, which (and the blocking
``Client``) offers its calls.

What a loaded store serves is what the saved one served: the same rows (new indexes; data,
headers and custom metadata bit-exact), the same fields ready, and per task the same rows
consumed and the rest queued in the same order. Rows *leased* at save time count as not
consumed: after a load they come first in their task's queue, as they would once their lease
expired. Tasks are recreated with their fields, sampler and options; declared task names and
the finished flag come back too.

**Consistency.** A save is a snapshot of the partitions' *committed* rows at one controller
instant (one ``export_state`` message): producers and consumers may go on. Rows allocated but
not committed then are not saved; fields committed later are not saved; an ack after the
instant does not count. Rows the controller frees while the save reads them stay on their
units until the save ends (a hold of ``hold_s``, renewed as the save goes). A row lost with a
storage unit during the save fails it (:class:`~transferqueue.errors.RowsLostError`).

**Memory.** Saving and loading stream ``batch_rows`` rows of one field at a time; only the
row headers (about 40 bytes a row plus a bit per field and a byte per task) are held whole.

Layout (format version 1)::

    DIR/manifest.json     format, version, features (what a loader must understand), fields'
                          specs, per partition: name, dir, rows, batches, declared, finished,
                          tasks (name, fields, sampler, options, column), field files
    DIR/pNNNN/rows.arrow  one row per saved row, in index order, record batch k = rows
                          [k*batch_rows, (k+1)*batch_rows): index (in the saved store), group,
                          version, length int64 | custom binary (msgpack map; null: none) |
                          key large_string (the row's string key, null: none; only in a
                          partition with keys: feature ``keys``) | ready:FIELD bool |
                          consumed:tN bool | queue:tN int64 (serve rank, -1: not queued) |
                          leased:tN int64 (rank in the task's open leases at save time,
                          lease by lease; the manifest has their sizes)
    DIR/pNNNN/fNNNN.arrow one field, record batch k = that field's rows in row batch k: row
                          int64 (position in rows.arrow) | value (dense: primitive or
                          fixed-size lists; ragged: large_list; object: msgpack binary;
                          bfloat16 as its int16 bits)

The manifest is written last: a directory without one is an incomplete save. A loader
refuses a higher ``version`` and any ``features`` entry it does not know
(:class:`~transferqueue.errors.CheckpointError`), so later additions extend the format
without older loaders misreading it (``keys``: string keys of rows, see the key-value calls;
a save lists it only when a partition has keys, so older loaders read the rest).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from transferqueue.client.links import ControllerLink, Read
from transferqueue.client.put import Writer
from transferqueue.client.specs import Specs
from transferqueue.errors import CheckpointError
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.schema import Column, FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.replies import (
    DONE,
    QUEUED,
    PartitionExport,
    StoreExport,
    TaskExport,
    TaskImport,
)

__all__ = ["FEATURES", "FORMAT", "FORMAT_VERSION", "Checkpoints", "Progress"]

FORMAT = "transferqueue-store"
FORMAT_VERSION = 1
FEATURES: frozenset[str] = frozenset({"keys"})
"""What this version can load; a save lists those it uses (``keys``: rows with string keys,
the ``key`` column of ``rows.arrow``)."""
"""Optional parts of the format this loader understands (none yet)."""
BATCH_ROWS = 8192
HOLD_S = 600.0

Progress = Callable[[str, int, int], None]
"""Called as a save or load goes: (partition, rows done, rows of the partition)."""


class Checkpoints:
    """``save`` and ``load``."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        specs: Specs,
        writer: Writer,
        read: Read,
    ) -> None:
        self._io = io
        self._ctl = controller
        self._specs = specs
        self._writer = writer
        self._read = read

    async def save(
        self,
        path: str | os.PathLike[str],
        partitions: Sequence[str] | None = None,
        *,
        batch_rows: int = BATCH_ROWS,
        progress: Progress | None = None,
    ) -> dict[str, int]:
        """Write ``partitions`` (all if None) to the new or empty directory ``path``: a
        snapshot of their committed rows at one instant (see
        :mod:`transferqueue.client.checkpoint`). Returns the rows saved per partition."""
        return await self._io.run_async(self._save(Path(path), partitions, batch_rows, progress))

    async def load(
        self, path: str | os.PathLike[str], *, progress: Progress | None = None
    ) -> dict[str, int]:
        """Put every partition of the save at ``path`` into this store, with its tasks'
        consumption state. A partition the store has already is a
        :class:`~transferqueue.errors.PartitionExistsError` (nothing of it is loaded).
        A load that fails half way leaves the partition it was loading refusing puts and
        consumers (:class:`~transferqueue.errors.BadRequestError` saying so) until it is
        cleared (``clear(partition)``, then load again). Returns the rows loaded per
        partition."""
        return await self._io.run_async(self._load(Path(path), progress))

    # -- save --------------------------------------------------------------------------------
    async def _save(
        self,
        path: Path,
        partitions: Sequence[str] | None,
        batch_rows: int,
        progress: Progress | None,
    ) -> dict[str, int]:
        if not isinstance(batch_rows, int) or batch_rows < 1:
            raise ValueError(f"batch_rows must be a positive int, got {batch_rows!r}")
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise CheckpointError(f"{path} exists and is not an empty directory; save elsewhere")
        names = None if partitions is None else list(partitions)
        snap: StoreExport = await self._ctl.call(m.ExportState(partitions=names, hold_s=HOLD_S))
        try:
            path.mkdir(parents=True, exist_ok=True)
            renewed = [time.monotonic()]
            entries = []
            for k, part in enumerate(snap.partitions):
                entries.append(
                    await self._save_partition(
                        path, f"p{k:04d}", part, snap, batch_rows, progress, renewed
                    )
                )
            manifest = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "features": ["keys"] if any(p.keys for p in snap.partitions) else [],
                "created_unix_s": time.time(),
                "batch_rows": batch_rows,
                # (of every partition, for loaders that predate specs per partition; each
                # partition's own are in its entry)
                "fields": {
                    f: msgspec.to_builtins(s)
                    for specs in snap.specs.values()
                    for f, s in specs.items()
                },
                "partitions": entries,
            }
            tmp = path / "manifest.json.tmp"
            tmp.write_text(json.dumps(manifest, indent=1))
            tmp.replace(path / "manifest.json")  # (last: its presence marks a complete save)
        finally:
            if snap.snapshot_id:
                await self._ctl.call(m.HoldExport(snapshot_id=snap.snapshot_id, hold_s=0.0))
        return {p.name: int(p.indexes.size) for p in snap.partitions}

    async def _save_partition(
        self,
        path: Path,
        sub: str,
        part: PartitionExport,
        snap: StoreExport,
        batch_rows: int,
        progress: Progress | None,
        renewed: list[float],
    ) -> dict[str, Any]:
        from transferqueue.client import arrow_files as af  # (pyarrow loads only when asked for)

        d = path / sub
        d.mkdir()
        n = int(part.indexes.size)
        batches = max(1, -(-n // batch_rows))
        fields = [f for f, r in part.ready.items() if r.any()]
        specs = {f: snap.specs[part.name][f] for f in fields}
        tasks = [(f"t{k}", t) for k, t in enumerate(part.tasks)]
        ranks = {col: _ranks(t, n) for col, t in tasks}
        with af.Writers(d, part, specs, tasks) as out:
            for b in range(batches):
                lo, hi = b * batch_rows, min(n, (b + 1) * batch_rows)
                consumed = {col: t.states[lo:hi] == DONE for col, t in tasks}
                out.write_rows(
                    lo,
                    hi,
                    consumed,
                    {c: r[0][lo:hi] for c, r in ranks.items()},
                    {c: r[1][lo:hi] for c, r in ranks.items()},
                )
                for f in fields:
                    pos = lo + np.flatnonzero(part.ready[f][lo:hi])
                    cols: dict[str, Column] = {}
                    if pos.size:
                        meta = BatchMeta(
                            part.indexes[pos],
                            part.units[pos],
                            part.groups[pos],
                            part.versions[pos],
                            part.lengths[pos],
                            partition=part.name,
                        )
                        cols = await self._read(meta, [f])
                    out.write_field(f, pos, cols.get(f))
                await self._renew(snap.snapshot_id, renewed)
                if progress is not None:
                    progress(part.name, hi, n)
        return {
            "name": part.name,
            "dir": sub,
            "rows": n,
            "batches": batches,
            "declared": part.declared,
            "finished": part.finished,
            "tasks": [
                {
                    "name": t.name,
                    "column": col,
                    "fields": t.fields,
                    "sampler": t.sampler,
                    "options": t.options,
                    "consumed": int((t.states == DONE).sum()),
                    "leases": [int(rows.size) for rows in t.leases],
                }
                for col, t in tasks
            ],
            "fields": {
                f: {
                    "file": out.files[f],
                    "rows": int(part.ready[f].sum()),
                    "spec": msgspec.to_builtins(specs[f]),
                }
                for f in fields
            },
        }

    async def _renew(self, snapshot_id: int, renewed: list[float]) -> None:
        if snapshot_id and time.monotonic() - renewed[0] > HOLD_S / 4:
            await self._ctl.call(m.HoldExport(snapshot_id=snapshot_id, hold_s=HOLD_S))
            renewed[0] = time.monotonic()

    # -- load --------------------------------------------------------------------------------
    async def _load(self, path: Path, progress: Progress | None) -> dict[str, int]:
        from transferqueue.client import arrow_files as af

        manifest = read_manifest(path)
        shared = manifest["fields"]  # (saves that predate specs per partition have only these)
        loaded = {}
        for entry in manifest["partitions"]:
            name = entry["name"]
            specs = {
                f: msgspec.convert(e.get("spec", shared.get(f)), FieldSpec)
                for f, e in entry["fields"].items()
            }
            if specs:
                # (always sent: this client's cache of specs may predate a reset of the store)
                await self._specs.register(specs, name, again=True)
            with af.Readers(path / entry["dir"], entry) as src:
                new = np.empty(int(entry["rows"]), dtype=np.int64)  # saved position -> index
                queues: dict[str, list[np.ndarray]] = {t["column"]: [] for t in entry["tasks"]}
                leased: dict[str, list[np.ndarray]] = {t["column"]: [] for t in entry["tasks"]}
                consumed: dict[str, list[np.ndarray]] = {t["column"]: [] for t in entry["tasks"]}
                done = 0
                for b in range(int(entry["batches"])):
                    rows = src.rows(b)
                    meta: BatchMeta = await self._ctl.call(
                        m.ImportRows(
                            partition=name,
                            groups=rows.groups,
                            versions=rows.versions,
                            lengths=rows.lengths,
                            first=b == 0,
                            keys=rows.keys,
                            key_rows=rows.key_pos,
                        )
                    )
                    lo = done
                    new[lo : lo + len(meta)] = meta.indexes
                    for f in entry["fields"]:
                        pos, col = src.field(f, b, specs[f])
                        if pos.size:
                            sub = meta.select(pos - lo)
                            sub.grants = meta.grants
                            missed = await self._writer.write_units(
                                sub, {f: col}, {f: specs[f]}, create=True
                            )
                            commit = m.Commit(
                                indexes=sub.indexes,
                                fields=[f],
                                dropped=missed,
                                copies=sub.replica_units,
                            )
                            await self._ctl.call(commit)
                    if rows.custom_pos.size:
                        msg = m.SetCustomMeta(
                            indexes=meta.indexes[rows.custom_pos], metas=rows.custom
                        )
                        await self._ctl.call(msg)
                    for col_name in queues:
                        queues[col_name].append(rows.queue[col_name])
                        leased[col_name].append(rows.leased[col_name])
                        consumed[col_name].append(lo + np.flatnonzero(rows.consumed[col_name]))
                    done += len(meta)
                    if progress is not None:
                        progress(name, done, int(entry["rows"]))
            tasks = []
            for t in entry["tasks"]:
                c = t["column"]
                took = np.concatenate(consumed[c]) if consumed[c] else np.empty(0, np.int64)
                cuts = np.cumsum(t.get("leases", []))[:-1]
                tasks.append(
                    TaskImport(
                        name=t["name"],
                        fields=list(t["fields"]),
                        sampler=t["sampler"],
                        options=dict(t["options"]),
                        consumed=new[took],
                        queue=new[_order(queues[c])],
                        leases=[new[p] for p in np.split(_order(leased[c]), cuts) if p.size],
                    )
                )
            await self._ctl.call(
                m.ImportTasks(
                    partition=name,
                    tasks=tasks,
                    declared=entry["declared"],
                    finished=bool(entry["finished"]),
                )
            )
            loaded[name] = int(entry["rows"])
        return loaded


def _ranks(task: TaskExport, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's place (-1: none) in the task's queue (serve order; queued rows the
    sampler did not order follow, by index) and in its open leases (lease by lease)."""
    queued = np.flatnonzero(task.states == QUEUED)
    if task.queue is not None:
        queued = np.concatenate([task.queue, np.setdiff1d(queued, task.queue)])
    leased = np.concatenate(task.leases) if task.leases else np.empty(0, dtype=np.int64)
    out = []
    for rows in (queued, leased):
        rank = np.full(n, -1, dtype=np.int64)
        rank[rows] = np.arange(rows.size, dtype=np.int64)
        out.append(rank)
    return out[0], out[1]


def _order(ranks: list[np.ndarray]) -> np.ndarray:
    """Positions of the rows with a rank (>= 0), by rank."""
    rank = np.concatenate(ranks) if ranks else np.empty(0, dtype=np.int64)
    has = np.flatnonzero(rank >= 0)
    return has[np.argsort(rank[has], kind="stable")]


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the save at ``path``, checked; :class:`CheckpointError` says what is
    wrong (missing, incomplete, another format, a newer version, unknown features)."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; give the directory a save wrote")
    mf = path / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(
            f"{path} has no manifest.json: not a TransferQueue save, or one that did not "
            "finish; save again"
        )
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mf} is not readable JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{mf}: format must be {FORMAT!r}, got {got!r}")
    version = manifest.get("version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"{mf}: format version {version!r}; this TransferQueue reads versions 1.."
            f"{FORMAT_VERSION}. Load it with the TransferQueue that saved it (or a newer one)"
        )
    unknown = sorted(set(manifest.get("features", [])) - FEATURES)
    if unknown:
        raise CheckpointError(
            f"{mf}: the save uses features {unknown} this TransferQueue does not know "
            f"(known: {sorted(FEATURES)}); load it with a newer TransferQueue"
        )
    for key in ("fields", "partitions"):
        if key not in manifest:
            raise CheckpointError(f"{mf}: no {key!r} entry; the save is damaged")
    return manifest
