"""The layout rules of the four packages, read from their source with ``ast`` (nothing imported).

- Arrows point down: ``transferqueue`` imports none of ``engines``, ``adapters``,
  ``asyncflow``; ``engines`` none of ``transferqueue``, ``adapters``, ``asyncflow``;
  ``adapters`` not ``asyncflow``.
- Inside ``transferqueue``, folders by role, imports one way: the shared modules at the top
  import no folder; ``wire`` imports only the top; ``storage`` the top and ``wire``;
  ``controller`` and ``client`` the top, ``wire`` and ``storage``, never each other;
  ``deploy`` anything. No module of the package imports the package itself (its
  ``__init__`` is the user's door, not a module's).
- At most 15 Python files directly in ``transferqueue/``.
- No module over 700 lines; no class with more than 25 public methods, counting those it
  inherits from classes of these packages (properties are attributes, not methods).
- ``tqcompat`` (the ``transfer_queue`` facade) is its own room: it imports ``transferqueue``
  through the package's public names only (``import transferqueue``, ``from transferqueue
  import X``) and the documented Ray entry (``transferqueue.deploy.ray``), never another
  module inside it; nothing else imports ``tqcompat``.
- No import cycle between modules: every import counts, in a function or under
  ``TYPE_CHECKING`` too (a cycle there is still two modules that cannot be read apart).
- No two test modules share a file name (pytest imports them by name).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transferqueue", "asyncflow", "engines", "adapters", "tqcompat")
MAX_LINES = 700
MAX_PUBLIC_METHODS = 25
MAX_TOP_FILES = 15
# what each package may import of the others
MAY_IMPORT = {
    "transferqueue": set(),
    "engines": set(),
    "adapters": {"transferqueue", "engines"},
    "asyncflow": {"transferqueue", "engines", "adapters"},
    "tqcompat": {"transferqueue"},
}
# what each folder of transferqueue may import ("" = the shared modules at the top)
TQ_LAYERS = {
    "": {""},
    "wire": {"", "wire"},
    "storage": {"", "wire", "storage"},
    "controller": {"", "wire", "storage", "controller"},
    "device": {"", "device"},
    "client": {"", "wire", "storage", "device", "client"},
    "deploy": {"", "wire", "storage", "controller", "device", "client", "deploy"},
}


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = _module_name(path)
            mods[name] = Module(name, path, ast.parse(path.read_text(encoding="utf-8")))
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                mod.imports.update(_owner(a.name, mods) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    mod.imports.add(sub if sub in mods else _owner(base, mods))
        mod.imports = {i for i in mod.imports if i and i != mod.name}
    return mods


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.name.split(".")
    if mod.path.name != "__init__.py":
        parts.pop()
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _owner(name: str, mods: dict[str, Module]) -> str:
    """The longest prefix of ``name`` that is one of our modules ('' if none)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return ""


MODULES = _modules()


def _folder(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_packages_import_only_downwards() -> None:
    bad = [
        f"{m.name} imports {i}"
        for m in MODULES.values()
        for i in sorted(m.imports)
        if (top := i.split(".")[0]) != m.name.split(".")[0]
        and top not in MAY_IMPORT[m.name.split(".")[0]]
    ]
    assert not bad, "\n".join(bad)


def test_transferqueue_folders_import_one_way() -> None:
    bad = []
    for m in MODULES.values():
        if not m.name.startswith("transferqueue.") and m.name != "transferqueue":
            continue
        for i in sorted(m.imports):
            if not i.startswith("transferqueue"):
                continue
            if i == "transferqueue" and m.name != "transferqueue":
                bad.append(f"{m.name} imports the package transferqueue (import the module)")
            elif m.name != "transferqueue" and _folder(i) not in TQ_LAYERS[_folder(m.name)]:
                bad.append(f"{m.name} ({_folder(m.name) or 'top'}) imports {i}")
    assert not bad, "\n".join(bad)


def test_tqcompat_uses_only_the_public_api_of_transferqueue() -> None:
    bad = [
        f"{m.name} imports {i} (use the names of the package transferqueue)"
        for m in MODULES.values()
        if m.name.split(".")[0] == "tqcompat"
        for i in sorted(m.imports)
        if i.startswith("transferqueue.") and i != "transferqueue.deploy.ray"
    ]
    assert not bad, "\n".join(bad)


def test_few_files_at_the_top_of_transferqueue() -> None:
    top = sorted(p.name for p in (ROOT / "transferqueue").glob("*.py"))
    assert len(top) <= MAX_TOP_FILES, top


def test_no_module_over_700_lines() -> None:
    long = {
        m.name: n
        for m in MODULES.values()
        if (n := len(m.path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


def _classes() -> Iterator[tuple[str, ast.ClassDef, Module]]:
    for m in MODULES.values():
        for node in m.tree.body:
            if isinstance(node, ast.ClassDef):
                yield f"{m.name}.{node.name}", node, m


def _public_methods(node: ast.ClassDef) -> set[str]:
    def is_property(f: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        return any(
            (isinstance(d, ast.Name) and d.id in ("property", "cached_property"))
            or (isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "getter"))
            for d in f.decorator_list
        )

    return {
        f.name
        for f in node.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
        and not f.name.startswith("_")
        and not is_property(f)
    }


def _bases(node: ast.ClassDef, mod: Module, classes: dict[str, ast.ClassDef]) -> list[str]:
    """The qualified names of ``node``'s bases that are classes of these packages."""
    imported: dict[str, str] = {}
    for n in ast.walk(mod.tree):
        if isinstance(n, ast.ImportFrom):
            base = _absolute(mod, n)
            for a in n.names:
                imported[a.asname or a.name] = f"{base}.{a.name}"
    out = []
    for b in node.bases:
        target = b.value if isinstance(b, ast.Subscript) else b
        name = ast.unparse(target)
        qual = imported.get(name, f"{mod.name}.{name}")
        if qual in classes:
            out.append(qual)
    return out


def test_no_class_over_25_public_methods() -> None:
    by_name = {q: n for q, n, _ in _classes()}
    mods = {q: m for q, _, m in _classes()}

    def methods(qual: str, seen: set[str]) -> set[str]:
        if qual in seen:
            return set()
        seen.add(qual)
        node = by_name[qual]
        out = _public_methods(node)
        for b in _bases(node, mods[qual], by_name):
            out |= methods(b, seen)
        return out

    big = {q: len(ms) for q in by_name if len(ms := methods(q, set())) > MAX_PUBLIC_METHODS}
    assert not big, big


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {name: sorted(i for i in m.imports if i in MODULES) for name, m in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles() -> None:
    assert not _cycles()


@pytest.mark.parametrize("pkg", PACKAGES)
def test_the_checker_sees_every_package(pkg: str) -> None:
    """The rules above read real modules: each package has modules with imports in the map."""
    names = [m for m in MODULES if m.split(".")[0] == pkg]
    assert len(names) > 3
    assert any(MODULES[n].imports for n in names)


def test_the_light_entry_points_import_no_tensor_library() -> None:
    """``import transferqueue`` / ``import asyncflow`` load their public names on first use,
    and the coordinator actor's module imports no engine, adapter or tensor library: every
    Ray stage host's start waits on the coordinator, and torch plus transformers cost seconds
    of CPU per process on the 2-core machine. Checked in a fresh interpreter."""
    code = (
        "import sys, transferqueue, transferqueue.aio, asyncflow, asyncflow.deploy.coordinator\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'adapters', 'engines', 'numpy')"
        " if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "", f"imported on start: {out.stdout.strip()}"
    # and the lazy names still resolve
    import asyncflow
    import transferqueue

    assert callable(transferqueue.connect) and callable(asyncflow.run)
    assert transferqueue.BatchMeta.__module__ == "transferqueue.meta"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        transferqueue.nope  # noqa: B018
    import asyncflow.deploy

    assert {"Deployment", "LocalDeployment"} <= set(dir(asyncflow.deploy))
    assert "start" in dir(transferqueue) and "Workflow" in dir(asyncflow)
    with pytest.raises(AttributeError, match=r"'asyncflow\.deploy' has no attribute 'nope'"):
        asyncflow.deploy.nope  # noqa: B018


def test_stage_hosts_without_a_model_import_no_model_code() -> None:
    """The Ray stage hosts' module, the adapters and ``engines.hf``'s text helpers import
    neither transformers nor the HF engines: the rollout's dispatcher and a reward worker
    (which builds only a tokenizer) start without seconds of model code per process. The
    engines' names still resolve on first use. Checked in a fresh interpreter."""
    code = (
        "import sys, asyncflow.deploy.ray_hosts, adapters, engines.hf, engines.hf.text\n"
        "from asyncflow import load_config\n"
        "from asyncflow.threads import intra_op_threads\n"
        "intra_op_threads(load_config(None, []), cores=1, ray_host=True)  # as a host does\n"
        "heavy = sorted(m for m in ('transformers', 'engines.hf.generation', "
        "'engines.hf.training', 'engines.hf.loading') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
        "import engines.hf\n"
        "assert engines.hf.HFGenerationEngine.__module__ == 'engines.hf.generation'\n"
        "assert 'HFTrainingEngine' in dir(engines.hf)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"imported on start: {out.stdout.strip()}"


def test_a_run_reads_its_config_without_torch() -> None:
    """Reading a config (every check of it) and reaching ``asyncflow.run`` import no torch,
    transformers or engine code: a run that starts its own Ray cluster starts it while those
    import (``asyncflow.deploy.ray_start``), so they must come after the config. The
    ``engines`` package's names still resolve on first use. Checked in a fresh interpreter."""
    code = (
        "import sys\n"
        "from asyncflow import load_config, run\n"
        "import asyncflow.launch, asyncflow.deploy.ray_start\n"
        "cfg = load_config(None, ['deploy.mode=ray', 'train.loss=decoupled'])\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'engines.protocols', "
        "'engines.loss', 'transferqueue.schema') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
        "import engines\n"
        "assert engines.Generation.__module__ == 'engines.protocols'\n"
        "assert 'TrainingEngine' in dir(engines)\n"
        "from engines.loss import OBJECTIVES\n"
        "assert 'decoupled' in OBJECTIVES\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"imported with the config: {out.stdout.strip()}"


def test_no_two_test_modules_share_a_name() -> None:
    """The test folders are not packages: pytest imports each test module by its file name,
    and a second module of the same name fails the whole run's collection ("import file
    mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"test modules sharing a name (rename one): {twice}"
