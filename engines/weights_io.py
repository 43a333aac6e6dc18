"""Hand a whole state dict to another process on the same host in one shared-memory file.

A weight update must reach the inference engine's worker processes without one message per
parameter and without pickle. The sender packs every tensor into a single memory-mapped file
(under ``/dev/shm`` when it has room, so the "file" never touches a disk); the receiver maps the
same file and gets zero-copy views. Only the small layout travels in the control message.

| bytes of the file               | content                                        |
|---------------------------------|------------------------------------------------|
| ``[offset_i, offset_i + n_i)``  | tensor i, C-contiguous, its own dtype          |
| gaps                            | zero padding so every offset is 64-byte aligned |

Layout entry ``i``: ``[name, dtype, shape, offset]`` (plain lists/str/int, msgpack-able).
Tensors that share storage (tied embeddings) are written once and listed under each name.

Ownership: the sender creates the file and removes it with :meth:`PackedState.unlink` once the
receivers have returned; receivers must not keep views past their call (they copy into their
parameters).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PackWriter",
    "PackedState",
    "StatePlan",
    "StateSpec",
    "TensorSpec",
    "checkpoint_shapes",
    "checkpoint_specs",
    "mismatches",
    "pack_state",
    "plan_specs",
    "plan_state",
    "unpack_buffer",
    "unpack_state",
]

_ALIGN = 64
_SHM = Path("/dev/shm")
LayoutEntry = list[Any]  # [name: str, dtype: str, shape: list[int], offset: int]


@dataclass(frozen=True)
class PackedState:
    """A state dict packed into one file; pass ``path`` and ``layout`` to the receiver."""

    path: str
    layout: list[LayoutEntry]
    nbytes: int

    def unlink(self) -> None:
        """Remove the file (idempotent)."""
        Path(self.path).unlink(missing_ok=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a packed weights layout")
    return dtype


def _pick_directory(nbytes: int, directory: str | os.PathLike[str] | None) -> Path:
    if directory is not None:
        return Path(directory)
    # /dev/shm is RAM-backed; containers often cap it at 64 MiB, so check the room first.
    writable = _SHM.is_dir() and os.access(_SHM, os.W_OK)
    if writable and shutil.disk_usage(_SHM).free > 2 * nbytes:
        return _SHM
    return Path(tempfile.gettempdir())


@dataclass(frozen=True)
class StatePlan:
    """Where each tensor of a state dict goes in the packed image; no bytes copied yet.

    ``pieces`` lists every distinct tensor once (tied names share one piece), in offset order,
    as ``(tensor, dtype, offset)``: ``tensor`` is the caller's own (not copied), ``dtype`` the
    dtype it takes in the image. ``nbytes`` is the image size (0 for an empty state).
    """

    layout: list[LayoutEntry]
    nbytes: int
    pieces: list[tuple[torch.Tensor, torch.dtype, int]]


def plan_state(
    state: Mapping[str, torch.Tensor], *, float_dtype: torch.dtype | None = None
) -> StatePlan:
    """Lay ``state`` out as :func:`pack_state` would, without copying (see :class:`StatePlan`).

    Used by :func:`pack_state` and by senders that stream the image in pieces instead of
    writing one file (``asyncflow.transport``). Raises ``TypeError`` for a value that is not a
    tensor and ``ValueError`` for a tensor on the meta device.
    """
    layout: list[LayoutEntry] = []
    pieces: list[tuple[torch.Tensor, torch.dtype, int]] = []
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], int] = {}
    total = 0
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type == "meta":
            raise ValueError(f"state[{name!r}] is on the meta device and has no values to send")
        cast = float_dtype is not None and tensor.is_floating_point()
        dtype = float_dtype if cast and float_dtype is not None else tensor.dtype
        key = (
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(int(d) for d in tensor.shape),
            dtype,
        )
        if tensor.numel() and key in seen:  # the same values under a second name (tied weights)
            layout.append([name, _dtype_name(dtype), list(tensor.shape), seen[key]])
            continue
        offset = -(-total // _ALIGN) * _ALIGN
        seen[key] = offset
        layout.append([name, _dtype_name(dtype), list(tensor.shape), offset])
        pieces.append((tensor, dtype, offset))
        total = offset + tensor.numel() * dtype.itemsize
    return StatePlan(layout=layout, nbytes=total, pieces=pieces)


def pack_state(
    state: Mapping[str, torch.Tensor],
    *,
    directory: str | os.PathLike[str] | None = None,
    float_dtype: torch.dtype | None = None,
) -> PackedState:
    """Copy ``state`` into one fresh memory-mapped file.

    Args:
        state: name -> tensor, on any device (copied to host memory).
        directory: where to create the file; ``None`` picks ``/dev/shm`` when it has room for
            twice the payload, else the system temporary directory.
        float_dtype: cast floating-point tensors to this dtype while packing (e.g. the
            receiver's compute dtype, which halves the bytes moved for bf16 engines).
    """
    plan = plan_state(state, float_dtype=float_dtype)
    nbytes = max(plan.nbytes, 1)
    folder = _pick_directory(nbytes, directory)
    path = folder / f"asyncflow-weights-{os.getpid()}-{uuid.uuid4().hex}.bin"
    try:
        # Sequential write() calls: ~3 GB/s into tmpfs, where copying into a fresh shared
        # mapping page-faults every 4 KiB page (~5x slower). Casts and device copies go through
        # one reused staging buffer for the same reason (a fresh tensor per cast page-faults).
        largest = max((t.numel() * d.itemsize for t, d, _ in plan.pieces), default=0)
        staging = torch.empty(largest, dtype=torch.uint8)
        with open(path, "wb", buffering=0) as file:
            position = 0
            for tensor, dtype, offset in plan.pieces:
                if tensor.numel() == 0:
                    continue
                if offset > position:
                    file.write(bytes(offset - position))
                source = tensor.detach()
                if source.dtype == dtype and source.device.type == "cpu":
                    host = source.contiguous()
                else:
                    host = _view(staging, dtype, source.shape, 0).copy_(source)
                raw = host.reshape(-1).view(torch.uint8).numpy()
                file.write(raw.data)
                position = offset + raw.nbytes
            if position < nbytes:
                file.write(bytes(nbytes - position))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return PackedState(path=str(path), layout=plan.layout, nbytes=nbytes)


@dataclass(frozen=True)
class StateSpec:
    """One tensor of a state that arrives later (a bucket at a time): its names (tied
    weights share one entry), its shape and dtype."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def plan_specs(specs: Sequence[StateSpec]) -> tuple[list[LayoutEntry], list[int], int]:
    """The packed layout of a state described by ``specs`` (what :func:`plan_state` gives
    for the same tensors in the same order): layout entries for every name, each spec's
    offset, and the image size."""
    layout: list[LayoutEntry] = []
    offsets: list[int] = []
    total = 0
    for spec in specs:
        if not spec.names:
            raise ValueError("a StateSpec needs at least one name")
        offset = -(-total // _ALIGN) * _ALIGN
        offsets.append(offset)
        for name in spec.names:
            layout.append([name, _dtype_name(spec.dtype), list(spec.shape), offset])
        total = offset + spec.nbytes
    return layout, offsets, total


class PackWriter:
    """Writes a state that arrives a bucket at a time into one fresh file, in the layout of
    :func:`plan_specs` (what :func:`pack_state` writes for the whole state): each tensor is
    copied to host and written as it comes, so the writer holds one tensor at a time.

    ``write`` each bucket in order, then ``finish`` (or ``abort`` to remove the file).
    """

    def __init__(
        self, specs: Sequence[StateSpec], *, directory: str | os.PathLike[str] | None = None
    ) -> None:
        self.specs = list(specs)
        self.layout, self._offsets, total = plan_specs(self.specs)
        self.nbytes = max(total, 1)
        folder = _pick_directory(self.nbytes, directory)
        self.path = folder / f"asyncflow-weights-{os.getpid()}-{uuid.uuid4().hex}.bin"
        self._file = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed by finish/abort)
        self._next = 0  # index of the next spec expected
        self._position = 0

    def write(self, bucket: Mapping[str, torch.Tensor]) -> None:
        """Write the tensors of ``bucket`` (the next specs, in order, under every name).
        Raises ``ValueError`` for a tensor out of order or of another shape or dtype."""
        names = set(bucket)
        while names and self._next < len(self.specs):
            spec = self.specs[self._next]
            first = spec.names[0]
            if first not in bucket:
                raise ValueError(
                    f"bucket holds {sorted(names)[:3]} but the next tensor is {first!r}: "
                    "buckets must follow the specs' order"
                )
            tensor = bucket[first]
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"{first!r} is {tuple(tensor.shape)} {tensor.dtype}, its spec says "
                    f"{spec.shape} {spec.dtype}"
                )
            offset = self._offsets[self._next]
            if offset > self._position:
                self._file.write(bytes(offset - self._position))
            if tensor.numel():
                host = tensor.detach().to("cpu").contiguous()
                self._file.write(host.reshape(-1).view(torch.uint8).numpy().data)
            self._position = offset + spec.nbytes
            names.difference_update(spec.names)
            self._next += 1
        if names:
            raise ValueError(f"bucket holds tensors beyond the specs: {sorted(names)[:3]}")

    def finish(self) -> PackedState:
        """Close the file once every spec was written; the packed state to hand out."""
        if self._next < len(self.specs):
            self.abort()
            raise ValueError(
                f"only {self._next} of {len(self.specs)} tensors arrived; the next was "
                f"{self.specs[self._next].names[0]!r}"
            )
        if self._position < self.nbytes:
            self._file.write(bytes(self.nbytes - self._position))
        self._file.close()
        return PackedState(path=str(self.path), layout=self.layout, nbytes=self.nbytes)

    def abort(self) -> None:
        """Close and remove the file (idempotent)."""
        self._file.close()
        self.path.unlink(missing_ok=True)


def _view(
    buffer: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], offset: int
) -> torch.Tensor:
    numel = _numel(shape)
    raw = buffer[offset : offset + numel * dtype.itemsize]
    size = tuple(int(s) for s in shape)
    return raw.view(dtype).view(size) if numel else torch.empty(size, dtype=dtype)


def unpack_state(path: str, layout: Sequence[Sequence[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy ``(name, tensor)`` views of a file written by :func:`pack_state`.

    The views are read-only in spirit (the mapping is private: writes never reach the file) and
    valid while the file exists; copy them before the sender unlinks it.
    """
    if not layout:
        return
    size = os.path.getsize(path)
    buffer = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    yield from unpack_buffer(buffer, layout, source=f"packed weights {path!r}")


def unpack_buffer(
    buffer: torch.Tensor, layout: Sequence[Sequence[Any]], *, source: str = "packed weights"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Zero-copy ``(name, tensor)`` views of a packed image held in a 1-D uint8 ``buffer``.

    Names listed at one offset (tied weights) get views of the same bytes. ``source`` names the
    buffer in errors.
    """
    size = int(buffer.numel())
    for name, dtype_name, shape, offset in layout:
        dtype = _parse_dtype(dtype_name)
        end = int(offset) + _numel(shape) * dtype.itemsize
        if end > size:
            raise ValueError(f"{source}: {name!r} ends at byte {end} but the image has {size}")
        yield name, _view(buffer, dtype, shape, int(offset))


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel


@dataclass(frozen=True)
class TensorSpec:
    """Shape and safetensors dtype (``"F32"``, ``"BF16"``, ``"I64"``...) of a checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))  # F16, F32, F64, BF16, F8_*


def checkpoint_specs(folder: str | os.PathLike[str]) -> dict[str, TensorSpec] | None:
    """Tensor name -> :class:`TensorSpec` of a safetensors checkpoint folder, from the headers.

    Returns None when ``folder`` is not a local folder of ``*.safetensors`` files (a hub name,
    or another format): then there is nothing to check an update against.
    """
    root = Path(folder)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                piece = handle.get_slice(name)
                shape = tuple(int(d) for d in piece.get_shape())
                specs[name] = TensorSpec(shape=shape, dtype=str(piece.get_dtype()))
    return specs


def checkpoint_shapes(folder: str | os.PathLike[str]) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of a safetensors checkpoint folder (see :func:`checkpoint_specs`)."""
    specs = checkpoint_specs(folder)
    return None if specs is None else {name: spec.shape for name, spec in specs.items()}


def mismatches(
    expected: Mapping[str, TensorSpec],
    entries: Sequence[tuple[str, Sequence[int], torch.dtype]],
    *,
    aliases: Mapping[str, str] | None = None,
) -> str | None:
    """What keeps ``entries`` (``(name, shape, dtype)``) from replacing the checkpoint
    ``expected`` tensor for tensor, or None when they can.

    They can when every checkpoint tensor is present once under its name, every name is a
    checkpoint name (or an ``aliases`` key: a name that takes the spec of another, such as a
    tied ``lm_head.weight`` -> ``model.embed_tokens.weight``), shapes are equal, and floating
    tensors replace floating ones (any float dtype: loaders cast) and others keep their dtype.
    Called before loading anything, by the engine on the state and by the vLLM workers on the
    packed layout, so that a bad update is refused while the old weights are intact.
    """
    aliases = aliases or {}
    problems: list[str] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for name, shape, dtype in entries:
        spec = expected.get(name) or expected.get(aliases.get(name, ""))
        if spec is None:
            unknown.append(name)
            continue
        seen.add(name)
        got = tuple(int(d) for d in shape)
        if got != spec.shape:
            problems.append(f"{name!r} has shape {got}, the served model has {spec.shape}")
        elif dtype.is_floating_point != spec.floating or (
            not spec.floating and _dtype_name(dtype) != _SAFETENSORS_INTS.get(spec.dtype)
        ):
            problems.append(f"{name!r} has dtype {dtype}, the served model has {spec.dtype}")
    missing = sorted(set(expected) - seen)
    if unknown or missing:
        problems.append(
            f"unknown: {_few(unknown)} ({len(unknown)}), missing: {_few(missing)} "
            f"({len(missing)}); send every tensor of the served checkpoint under its "
            "transformers name (a full model.state_dict())"
        )
    return "; ".join(problems[:4]) + (" ..." if len(problems) > 4 else "") if problems else None


_SAFETENSORS_INTS = {
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "BOOL": "bool",
}


def _few(names: Sequence[str]) -> str:
    return f"{list(names[:3])}{'...' if len(names) > 3 else ''}"
