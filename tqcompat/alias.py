"""The opt-in that makes ``import transfer_queue`` resolve to this facade.

Nothing happens on import of :mod:`tqcompat`. Each of these switches the name:

    import tqcompat; tqcompat.install()          # this process; then: import transfer_queue
    python -m tqcompat your_script.py [args]     # runs it with the name switched
    python -m tqcompat -m package.module [args]  # the same for a module
    export PYTHONPATH="$(python -m tqcompat --shim-path)${PYTHONPATH:+:$PYTHONPATH}"
                                                 # every process of this environment, Ray
                                                 # workers included (tqcompat/shim)

If the real TransferQueue (PyPI ``transferqueue``, which provides ``transfer_queue``) is
installed too, ``install()`` refuses and says how to pick: ``install(force=True)`` to use
this store, or do not call it to keep the real one. A ``transfer_queue`` already imported is
never replaced. ``TQ_COMPAT_FORCE=1`` in the environment is ``force=True`` for ``python -m``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["NAME", "SHIM_PATH", "install", "install_from_shim", "installed", "uninstall"]

NAME = "transfer_queue"
SHIM_PATH = str(Path(__file__).resolve().parent / "shim")
"""The folder to put on ``PYTHONPATH`` for the name in every process (see the module)."""
# The peer's module paths that users import, each to the facade module that holds its names
# (the peer's sampler/, dataloader/ and utils/ packages are one module each here).
_SUBMODULES = {
    "": "tqcompat",
    "metadata": "tqcompat.metadata",
    "sampler": "tqcompat.sampler",
    "sampler.base": "tqcompat.sampler",
    "sampler.grpo_group_n_sampler": "tqcompat.sampler",
    "sampler.rank_aware_sampler": "tqcompat.sampler",
    "sampler.seqlen_balanced_sampler": "tqcompat.sampler",
    "sampler.sequential_sampler": "tqcompat.sampler",
    "client": "tqcompat.client",
    "interface": "tqcompat.interface",
    "dataloader": "tqcompat.dataloader",
    "dataloader.streaming_dataset": "tqcompat.dataloader",
    "dataloader.streaming_dataloader": "tqcompat.dataloader",
    "utils": "tqcompat.utils",
    "utils.logging_utils": "tqcompat.utils",
}
_PACKAGES = {name.rpartition(".")[0] for name in _SUBMODULES if name}
"""The peer's names with submodules above: given a ``__path__`` so that those import."""


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Maps ``transfer_queue[.sub]`` to the facade's modules (the same module objects)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NAME and not fullname.startswith(NAME + "."):
            return None
        sub = fullname[len(NAME) + 1 :]
        if sub not in _SUBMODULES:
            return None
        is_pkg = sub in _PACKAGES
        return importlib.util.spec_from_loader(fullname, self, is_package=is_pkg)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        target = _SUBMODULES[spec.name[len(NAME) + 1 :]]
        return importlib.import_module(target)

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported."""


_finder = _Finder()


def _real_one() -> Any:
    """The spec of an installed real ``transfer_queue`` (None: none)."""
    if _finder in sys.meta_path:
        return None
    return importlib.util.find_spec(NAME)


def installed() -> bool:
    """Whether ``transfer_queue`` resolves to this facade in this process."""
    return _finder in sys.meta_path


def install(*, force: bool = False) -> None:
    """Make ``import transfer_queue`` (and its ``metadata``, ``sampler`` modules) give this
    facade. Refuses (``RuntimeError``) if the real one is installed, unless ``force``."""
    if installed():
        return
    loaded = sys.modules.get(NAME)
    if loaded is not None and not getattr(loaded, "__tq_compat__", False):
        raise RuntimeError(
            f"transfer_queue is already imported from {getattr(loaded, '__file__', '?')}: "
            "call tqcompat.install() before the first import of transfer_queue"
        )
    real = _real_one()
    if real is not None and not force:
        raise RuntimeError(
            f"the real TransferQueue is installed ({real.origin}); `import transfer_queue` "
            "imports it. To run on this store instead, call tqcompat.install(force=True) (or "
            "TQ_COMPAT_FORCE=1 python -m tqcompat script.py); to keep the real one, do not "
            "install the alias"
        )
    if real is not None:
        print(
            f"tqcompat: transfer_queue -> tqcompat (the real one at {real.origin} is hidden "
            "in this process)",
            file=sys.stderr,
        )
    sys.meta_path.insert(0, _finder)


def install_from_shim(shim_file: str) -> ModuleType:
    """Called by the shim package when ``import transfer_queue`` finds it: install the alias
    and return the facade (which the shim puts in its place). A real TransferQueue further
    on the path is named on stderr."""
    shim_dir = str(Path(shim_file).resolve().parent.parent)
    rest = [p for p in sys.path if str(Path(p or ".").resolve()) != shim_dir]
    real = importlib.machinery.PathFinder.find_spec(NAME, rest)
    if real is not None:
        print(
            f"tqcompat: transfer_queue -> tqcompat through {shim_dir} on PYTHONPATH (the real "
            f"one at {real.origin} is hidden; drop that path to use it)",
            file=sys.stderr,
        )
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = importlib.import_module("tqcompat")
    return module


def uninstall() -> None:
    """Undo :func:`install` (modules already imported under the name are dropped)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == NAME or n.startswith(NAME + ".")]:
        del sys.modules[name]
