"""The vLLM worker side of asyncflow's weight updates: a weight-transfer backend on CPU and GPU.

vLLM 0.32 moves new weights into a running engine through its weight-transfer engine
(``vllm.distributed.weight_transfer``): the caller runs ``start_weight_update``, one or more
``update_weights(update_info)`` and ``finish_weight_update`` on the ``AsyncLLM``; each worker
hands them to the backend named by the engine argument ``weight_transfer_config``. The built-in
backends (``nccl``, ``ipc``, packed) need CUDA. This module adds one that runs everywhere:

| backend          | ``update_info``                  | the bytes                                  |
|------------------|----------------------------------|--------------------------------------------|
| ``asyncflow_shm``| ``{"path": str, "layout": list}``| one file packed on this host by the engine |
|                  |                                  | (:func:`engines.weights_io.pack_state`),   |
|                  |                                  | mapped by every worker zero-copy           |

Where it runs: only in vLLM's worker processes. vLLM imports the ``worker_extension_cls``
(:class:`VLLMWorkerExtension`, named by :meth:`engines.vllm_config.VLLMEngineConfig.engine_args`)
in each worker before it loads the model and builds its weight-transfer engine; importing this
module there is what registers the backend in that process's ``WeightTransferEngineFactory``
(the registry is per process). The caller's process never imports it.

One update, in a worker (the engine has paused generation):

1. ``start_weight_update``: vLLM's layerwise reload is armed (every layer's parameters are put
   on the meta device, the live tensors kept aside, weight loaders wrapped to buffer);
2. ``update_weights``: the layout is checked against the served checkpoint's headers (names,
   shapes, floating or not; a tied ``lm_head.weight`` must be named: vLLM's reload would keep
   the *old* head otherwise) and against the file's size. A layout that fails is refused
   before one tensor is loaded, and the armed reload is undone, so the worker serves its old
   weights unchanged (left armed, the next forward pass would meet meta tensors and kill the
   engine). Then the file's tensors go to ``model.load_weights`` (vLLM fuses q/k/v and
   gate/up and re-runs each layer's weight processing as soon as the layer is complete);
3. ``finish_weight_update``: layers without new tensors get their old ones back, attention
   layers are processed.

Outcome of the last update, per worker: :meth:`VLLMWorkerExtension.asyncflow_weight_update_status`
(``"refused"``: nothing changed; ``"partial"``: loading failed midway, some layers hold new
values; ``"loaded"``). The engine reads it after a failed ``update_weights``, because vLLM
reports a worker's exception as a plain string.

Why no trainer -> worker gloo backend (vLLM's ``nccl`` model, on CPU): asyncflow's generators
switch weights at their own micro-batch boundary, after the trainer has moved on (deferred
weight sync). A collective between the trainer and the vLLM workers would make the trainer
wait for every generator's boundary, and make a hung worker hang the trainer. So the bytes
cross hosts through :mod:`asyncflow.transport` into the generator host's memory, and only the
last hop (host memory -> this host's workers) runs through vLLM's weight-transfer engine.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.reload import layerwise

from engines.vllm_engine import EMBED_NAME, HEAD_NAME, WEIGHT_BACKEND
from engines.weights_io import TensorSpec, checkpoint_specs, mismatches, unpack_state

__all__ = ["ShmWeightTransferEngine", "VLLMWorkerExtension"]


class LayoutRefusedError(ValueError):
    """A packed layout that does not match the served model; nothing was loaded."""


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the file is named in every update."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One update: a file packed by :func:`engines.weights_io.pack_state` and its layout."""

    path: str
    layout: list[list[Any]] = field(default_factory=list)


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """The ``asyncflow_shm`` backend (see the module doc); one per vLLM worker."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.status: dict[str, Any] = {"state": "none", "error": None}
        self._expected: dict[str, TensorSpec] | None = checkpoint_specs(self.model_config.model)
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)
        if self._expected is not None and tied and EMBED_NAME in self._expected:
            # The tied head must be named in every update (vLLM's reload would keep the old
            # head otherwise), with the embedding's spec.
            self._expected[HEAD_NAME] = self._expected[EMBED_NAME]

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        """Nothing to connect: every update names its file."""

    def start_weight_update(self) -> None:
        """Arm vLLM's layerwise reload (called by the worker's ``start_weight_update``)."""
        self.status = {"state": "started", "error": None}
        layerwise.initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        """Check the layout, then load the file's tensors (called by ``update_weights``)."""
        try:
            self._check(update_info)
        except Exception as exc:
            self._disarm()
            self.status = {"state": "refused", "error": str(exc)}
            raise
        try:
            self.model.load_weights(unpack_state(update_info.path, update_info.layout))
        except Exception as exc:
            self._disarm()
            self.status = {"state": "partial", "error": repr(exc)}
            raise
        self.status = {"state": "loaded", "error": None}

    def finish_weight_update(self) -> None:
        """Finalize the reload: layers without new tensors get their old ones back."""
        layerwise.finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing to release."""

    def _check(self, info: ShmUpdateInfo) -> None:
        entries = []
        end = 0
        for name, dtype_name, shape, offset in info.layout:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise LayoutRefusedError(f"{name!r} has unknown dtype {dtype_name!r}")
            entries.append((str(name), [int(d) for d in shape], dtype))
            numel = 1
            for d in shape:
                numel *= int(d)
            end = max(end, int(offset) + numel * dtype.itemsize)
        size = os.path.getsize(info.path) if os.path.exists(info.path) else -1
        if size < end:
            raise LayoutRefusedError(
                f"weights file {info.path!r} has {size} bytes, its layout needs {end}"
            )
        if self._expected is not None:
            problem = mismatches(self._expected, entries)
            if problem is not None:
                raise LayoutRefusedError(f"update refused, nothing loaded: {problem}")

    def _disarm(self) -> None:
        """Undo an armed reload after a failure: buffered tensors are dropped and every layer
        not yet processed gets its previous tensors back (layers already processed keep their
        new values). Without this the next forward pass meets meta tensors."""
        with contextlib.suppress(Exception):  # the original error is the one to report
            for module in self.model.modules():
                info = layerwise.LAYERWISE_INFO.get(module)
                if info is not None and info.can_load():
                    info.loaded_weights.clear()
                    info.load_numel = 0
            layerwise.finalize_layerwise_reload(self.model, self.model_config)


class VLLMWorkerExtension:
    """Methods vLLM mixes into its worker class (``worker_extension_cls``); ``self`` is vLLM's
    ``Worker``. Resolving this class in a worker imports this module, which registers the
    ``asyncflow_shm`` backend there before the worker builds its weight-transfer engine."""

    def asyncflow_weight_update_status(self) -> dict[str, Any]:
        """The outcome of this worker's last update (see the module doc); called by the engine
        through ``collective_rpc`` after a failed ``update_weights``."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, ShmWeightTransferEngine):
            return {"state": "none", "error": f"backend is {type(engine).__name__}"}
        return dict(engine.status)


with contextlib.suppress(ValueError):  # ValueError: registered already (imported again)
    WeightTransferEngineFactory.register_engine(WEIGHT_BACKEND, ShmWeightTransferEngine)
