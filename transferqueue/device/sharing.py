"""Handing a tensor's memory to another process on the same host, by a small handle.

The seam between "which bytes" and "how another process reaches them": a sharer ``export`` s a
tensor to a handle (a msgpack-able dict, a few hundred bytes), which travels in any control
message; the process that receives it ``open`` s the handle and gets a tensor over the *same*
memory (no copy). Two implementations:

| name   | memory                   | export                              | open                 |
|--------|--------------------------|-------------------------------------|----------------------|
| `cuda` | the tensor's own CUDA    | a CUDA IPC handle of its allocation | maps it (zero-copy,  |
|        | allocation               | (torch's ``_share_cuda_``)          | waits on its event)  |
| `file` | a shared-memory file     | copies the tensor into a fresh file | maps the file        |
|        | (``/dev/shm``)           | under ``/dev/shm``                  | (zero-copy)          |

``cuda`` is what GPUs use; ``file`` is the same protocol for host tensors (CPU machines, and
the tests of everything built on this seam). Lifetimes:

- **one export, one opener.** A CUDA handle carries one reference count of torch's IPC
  bookkeeping, which its opener gives back when it frees the tensor; export once per process
  that will open.
- The exporter calls :meth:`TensorSharer.retire` once the opener opened the handle (or is
  known to never open it). ``file``: unlinks the file (the opener's mapping keeps the pages);
  ``cuda``: nothing (torch frees the allocation once every opener freed its tensor and the
  exporter's ``collect`` ran).
- The exporter must outlive the openers' use of CUDA memory (its allocation dies with its
  process): a consumer of a dead producer's tensors has lost them.

Device identity: Ray and ``CUDA_VISIBLE_DEVICES`` number GPUs per process, so a handle names
its GPU by UUID and the opener finds that GPU among the ones it sees; one it does not see
raises :class:`SharingError` naming the fix.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = [
    "CudaSharer",
    "FileSharer",
    "Handle",
    "SharingError",
    "TensorSharer",
    "device_uuid",
    "make_sharer",
    "visible_gpus",
]

Handle = dict[str, Any]
"""A msgpack-able description of shared memory (``{"kind": "cuda" | "file", ...}``)."""
_SHM = Path("/dev/shm")
_FILE = re.compile(r"asyncflow-share-(\d+)-[0-9a-f]+\.bin")


class SharingError(RuntimeError):
    """A handle that cannot be exported or opened here (its GPU is not visible, its file is
    gone, its kind is not this sharer's)."""


class TensorSharer(Protocol):
    """Exports tensors as handles and opens handles as tensors (see the module doc)."""

    name: str

    def export(self, tensor: torch.Tensor) -> Handle:
        """A handle over ``tensor``'s memory, for one opener in another process. Called by the
        producer; the tensor must stay alive (referenced) until its opener opened it."""
        ...

    def open(self, handle: Handle) -> torch.Tensor:
        """The tensor behind ``handle`` (read it, never write it). Called once per handle, by
        a process other than the exporter."""
        ...

    def retire(self, handle: Handle) -> None:
        """The exporter's end of ``handle``: its opener has it (or never will)."""
        ...

    def collect(self) -> None:
        """Free what openers let go of (called by the exporter now and then)."""
        ...


def device_uuid(index: int) -> str:
    """The UUID of visible CUDA device ``index`` (stable across processes)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by index (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def _shape(t: torch.Tensor) -> list[int]:
    return [int(d) for d in t.shape]


class CudaSharer:
    """CUDA IPC handles of the tensors' own allocations (no copy at either end)."""

    name = "cuda"

    def export(self, tensor: torch.Tensor) -> Handle:
        if tensor.device.type != "cuda":
            raise SharingError(f"the cuda sharer exports CUDA tensors, got {tensor.device}")
        gpu = device_uuid(tensor.device.index or 0)
        meta = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": _shape(tensor)}
        if tensor.numel() == 0:  # nothing to map (an empty storage has no allocation)
            return {"kind": "cuda", "gpu": gpu, "empty": True, **meta}
        storage = tensor.untyped_storage()
        (
            device,
            handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
        return {
            "kind": "cuda",
            "gpu": device_uuid(int(device)),
            "handle": bytes(handle),
            "size_bytes": int(size_bytes),
            "offset_bytes": int(offset_bytes),
            "ref_handle": bytes(ref_handle),
            "ref_offset": int(ref_offset),
            "event_handle": None if event_handle is None else bytes(event_handle),
            "event_sync": bool(event_sync),
            **meta,
            "stride": [int(s) for s in tensor.stride()],
            "tensor_offset": int(tensor.storage_offset()),
        }

    def open(self, handle: Handle) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        _check_kind(handle, "cuda")
        gpus = visible_gpus()
        if handle["gpu"] not in gpus:
            raise SharingError(
                f"the tensor lives on GPU {handle['gpu']}, which this process does not see "
                f"(it sees {gpus or 'no GPU'}): CUDA IPC needs both processes to see that GPU "
                "(the same GPU, or CUDA_VISIBLE_DEVICES listing it); use a host path instead"
            )
        if handle.get("empty"):
            device = torch.device("cuda", gpus.index(handle["gpu"]))
            return torch.empty(handle["shape"], dtype=_dtype(handle["dtype"]), device=device)
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(handle["shape"]),
            tuple(handle["stride"]),
            int(handle["tensor_offset"]),
            torch.storage.TypedStorage,
            _dtype(handle["dtype"]),
            gpus.index(handle["gpu"]),
            handle["handle"],
            int(handle["size_bytes"]),
            int(handle["offset_bytes"]),
            False,
            handle["ref_handle"],
            int(handle["ref_offset"]),
            handle["event_handle"],
            bool(handle["event_sync"]),
        )

    def retire(self, handle: Handle) -> None:
        del handle  # torch's IPC reference counts free the allocation

    def collect(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


class FileSharer:
    """Host tensors through shared-memory files: ``export`` copies the tensor into a fresh
    file, ``open`` maps it. Where ``/dev/shm`` has too little room, the temp folder."""

    name = "file"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None

    def _folder(self, nbytes: int) -> Path:
        if self.directory is not None:
            return self.directory
        import shutil
        import tempfile

        if _SHM.is_dir() and os.access(_SHM, os.W_OK) and shutil.disk_usage(_SHM).free > 2 * nbytes:
            return _SHM
        return Path(tempfile.gettempdir())

    def export(self, tensor: torch.Tensor) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        path = self._folder(nbytes) / f"asyncflow-share-{os.getpid()}-{uuid.uuid4().hex}.bin"
        host = tensor.detach().to("cpu").contiguous()
        try:
            with open(path, "wb", buffering=0) as f:
                f.write(host.reshape(-1).view(torch.uint8).numpy().data if nbytes else b"")
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return {
            "kind": "file",
            "path": str(path),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": _shape(tensor),
        }

    def open(self, handle: Handle) -> torch.Tensor:
        _check_kind(handle, "file")
        dtype = _dtype(handle["dtype"])
        shape = tuple(int(d) for d in handle["shape"])
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        try:
            raw = torch.from_file(
                handle["path"], shared=False, size=numel * dtype.itemsize, dtype=torch.uint8
            )
        except (OSError, RuntimeError) as e:
            raise SharingError(f"shared file {handle['path']!r} cannot be mapped: {e}") from e
        return raw.view(dtype).view(shape)

    def retire(self, handle: Handle) -> None:
        Path(handle["path"]).unlink(missing_ok=True)

    def collect(self) -> None:
        pass

    @staticmethod
    def sweep(directory: str | os.PathLike[str] | None = None) -> list[str]:
        """Remove this user's shared files whose exporting process has exited."""
        import tempfile

        folders = [Path(directory)] if directory else [_SHM, Path(tempfile.gettempdir())]
        removed = []
        for folder in folders:
            if not folder.is_dir():
                continue
            for path in folder.glob("asyncflow-share-*.bin"):
                match = _FILE.fullmatch(path.name)
                try:
                    if match and path.stat().st_uid == os.getuid() and not _alive(int(match[1])):
                        path.unlink()
                        removed.append(str(path))
                except OSError:
                    continue
        return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise SharingError(f"unknown dtype {name!r} in a shared tensor's handle")
    return dtype


def _check_kind(handle: Handle, kind: str) -> None:
    if not isinstance(handle, dict) or handle.get("kind") != kind:
        got = handle.get("kind") if isinstance(handle, dict) else type(handle).__name__
        raise SharingError(f"a {kind!r} sharer cannot open a handle of kind {got!r}")


def make_sharer(name: str) -> TensorSharer:
    """The sharer called ``name`` (``cuda`` or ``file``)."""
    if name == "cuda":
        return CudaSharer()
    if name == "file":
        return FileSharer()
    raise ValueError(f"unknown sharer {name!r}; known: cuda, file")
