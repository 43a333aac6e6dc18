"""The TransferQueue 0.1.11 tutorials: where to get them, how to compare what they print.

The tutorials are the peer's own files, taken unmodified from its wheel on PyPI (downloaded
into a cache directory the first time, never committed). What each prints on the peer is
recorded in ``expected/`` by :mod:`record_peer` (run it where the peer is installed).

Lines that legitimately differ are masked before comparing, each pattern with its reason:
random values the tutorial draws itself, and the way a tensor prints where the two stores
return a different (documented) container. What Ray workers print (tutorial 06's producers
and ranks, relayed by Ray as ``(name pid=N) line``) interleaves in an order no system
defines: those lines are compared as a sorted list after the driver's own lines, and the
rows each rank retrieved (which depend on which producer wrote first) are checked by
:func:`retrieved_by_worker` instead of by value.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

__all__ = [
    "EXPECTED",
    "RUNNABLE",
    "VERSION",
    "fetch_tutorials",
    "normalize",
    "retrieved_by_worker",
]

VERSION = "0.1.11"
EXPECTED = Path(__file__).resolve().parent / "expected"
RUNNABLE = (
    "01_core_components",
    "02_kv_interface",
    "03_metadata_concepts",
    "04_understanding_controller",
    "05_custom_sampler",
    "06_streaming_dataloader",
)
"""The tutorials that run on the facade: all six of the distribution."""

_MASKS: tuple[tuple[str, Any, str], ...] = (
    # (pattern, replacement, why)
    (r"'(uid|session_id)': '[0-9a-f]{4}'", r"'\1': '<hex>'", "uuid4 drawn by the tutorial"),
    (
        r"Retrieved (data samples|chunk data): .*",
        r"Retrieved \1: <TensorDict>",
        "torch.randint values; the peer returns dense fields as nested tensors, we as dense",
    ),
    (
        r"(Got samples.*|All sampled|Batch \d|Priority of sampled|high-priority indices): (.*)",
        lambda m: f"{m[1]}: " + re.sub(r"[\w.()]+", "<i>", m[2]),
        "random samplers (the tutorial's, unseeded): the count of rows is compared, not which",
    ),
    (
        r"Retrieved Data: .*",
        "Retrieved Data: <tensors>",
        "the peer returns dense fields as nested tensors (printed as such), we as dense",
    ),
)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_WORKER = re.compile(r"^\((\w+) pid=(\d+)(?:, ip=[^)]*)?\) ?(.*)$")
_RETRIEVED = re.compile(r"^\[Update Worker@(\d+)\]: dp_rank (\d+) retrieved samples: \[(.*)\]$")


def retrieved_by_worker(text: str) -> dict[tuple[int, int], list[list[int]]]:
    """Tutorial 06: per ``(rank, dp_rank)``, the sample ids of each step, in step order."""
    out: dict[tuple[int, int], list[list[int]]] = {}
    for raw in text.splitlines():
        m = _WORKER.match(_ANSI.sub("", raw).rstrip())
        hit = _RETRIEVED.match(m[3]) if m else None
        if hit:
            ids = [int(i) for i in hit[3].split(",") if i.strip()]
            out.setdefault((int(hit[1]), int(hit[2])), []).append(ids)
    return out


def normalize(text: str) -> list[str]:
    """The stdout lines that must match: non-empty, right-stripped, with the masks applied.
    A masked value printed over several lines (a TensorDict, a 2-D tensor) drops its
    continuation lines (indented 4 or more, or a closing brace). Ray workers' lines follow
    the driver's, sorted, without their pids (see the module)."""
    out: list[str] = []
    workers: list[str] = []
    skipping = False
    for raw in text.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        if not line.strip():
            continue
        worker = _WORKER.match(line)
        if worker:
            said = re.sub(r"retrieved samples: \[.*\]", "retrieved samples: <ids>", worker[3])
            workers.append(f"({worker[1]}) {said}")
            continue
        if skipping and line.startswith(("    ", "}")):
            continue
        skipping = False
        for pattern, repl, _ in _MASKS:
            new = re.sub(pattern, repl, line)
            skipping = skipping or (new != line and isinstance(repl, str) and repl.endswith(">"))
            line = new
        out.append(line)
    return out + (["-- Ray workers' lines, sorted --", *sorted(workers)] if workers else [])


def fetch_tutorials(cache: Path) -> Path:
    """The folder holding ``tutorial/*.py`` of the peer's wheel, downloaded from PyPI into
    ``cache`` the first time (``pip download --no-deps``)."""
    root = cache / f"transferqueue-{VERSION}"
    tutorials = root / "tutorial"
    if not (tutorials / f"{RUNNABLE[-1]}.py").exists():
        wheels = cache / "wheels"
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        subprocess.run(
            [*pip, f"transferqueue=={VERSION}", "-d", str(wheels)],
            check=True,
            timeout=600,
        )
        wheel = next(wheels.glob(f"transferqueue-{VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("tutorial/") and name.endswith(".py"):
                    zf.extract(name, root)  # only the tutorials: never the peer's package
    return root
