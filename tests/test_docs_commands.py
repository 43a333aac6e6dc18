"""Every `asyncflow run` / `asyncflow config` command that README.md and docs/ show resolves
with `asyncflow config` (the same check `run` makes before it starts), so a documented
command cannot drift from the config it drives.

A command that needs more than a config check (a checkpoint to resume, a Ray cluster's
address, a server) carries ``(not checked in CI: REASON)`` in the comment on its line in the
docs. One that names an optional extra not installed here passes when the only complaint is
that extra's ``pip install`` line (the extra's own tier checks the rest). Files the docs'
commands name (``prompts.jsonl``, ``my.yaml``), and the modules a page shows whole (a python
block opening with ``# mygame/io.py``), are made in the temporary folder the commands run in.
The example files' own commands run, shortened, in tests/examples/.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncflow import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_CHECKED = "not checked in CI"
SHELL_OPERATORS = {"&", "&&", ";", "|", "||", ">", ">>", "2>&1"}
# files the documented commands name, made where the commands run
FIXTURES = {
    "prompts.jsonl": '{"prompt": "What is 2 + 3?", "answer": "5"}\n'
    '{"prompt": "What is 4 + 1?", "answer": "5"}\n',
    "p.jsonl": '{"q": "What is 2 + 3?", "answer": "5"}\n',
    "my.yaml": "train:\n  steps: 10\n",
}
# a python block that opens with ``# PATH.py`` is a file the docs ask the reader to write
DOC_FILE = re.compile(r"^# ([\w/]+\.py)\n")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    words: tuple[str, ...]  # after `asyncflow`
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def documented_commands(pages: list[Path] = PAGES, root: Path = ROOT) -> list[Command]:
    """Each `asyncflow run|config` line of the pages' shell blocks, continuations joined."""
    found = []
    for page in pages:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            if fence.group(1) not in ("bash", "sh", "console", "shell"):
                continue
            first = text.count("\n", 0, fence.start(2)) + 1
            lines = fence.group(2).splitlines()
            i = 0
            while i < len(lines):
                start, joined = i, lines[i]
                while joined.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    joined = joined[:-1] + " " + lines[i].strip()
                i += 1
                if NOT_CHECKED in joined:
                    continue
                words = shlex.split(joined, comments=True)
                for end, word in enumerate(words):  # the command ends at a shell operator
                    if word in SHELL_OPERATORS:
                        words = words[:end]
                        break
                if not words or Path(words[0]).name != "asyncflow" or len(words) < 2:
                    continue
                if words[1] not in ("run", "config"):
                    continue
                found.append(
                    Command(str(page.relative_to(root)), first + start, tuple(words[1:]), joined)
                )
    return found


def documented_files(pages: list[Path] = PAGES) -> dict[str, str]:
    """The files the docs show whole (``# mygame/io.py`` on a python block's first line)."""
    files = {}
    for page in pages:
        for fence in FENCE.finditer(page.read_text()):
            named = DOC_FILE.match(fence.group(2))
            if fence.group(1) == "python" and named:
                files[named.group(1)] = fence.group(2)
    return files


def check(command: Command, capsys: pytest.CaptureFixture[str]) -> str | None:
    """None when the command resolves; else why not."""
    words = [w for w in command.words[1:] if not (w.startswith("[") and w.endswith("]"))]
    if words == ["--help"]:
        with pytest.raises(SystemExit) as exit_:
            cli.main([command.words[0], "--help"])
        capsys.readouterr()
        return None if exit_.value.code == 0 else f"--help exited {exit_.value.code}"
    rc = cli.main(["config", *words])
    err = capsys.readouterr().err.strip()
    if rc == 0:
        return None
    if "pip install" in err and ("needs" in err or "not installed" in err):
        return None  # only an optional extra missing here: its own tier covers it
    return err or f"exit {rc}"


def test_every_documented_command_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, body in {**FIXTURES, **documented_files()}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))  # the docs' own modules (mygame.io)
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    commands = documented_commands()
    assert len(commands) >= 25, commands  # the parser still finds the docs' commands
    failures = [f"{c}\n    -> {why}" for c in commands if (why := check(c, capsys)) is not None]
    assert not failures, "documented commands that do not resolve:\n" + "\n".join(failures)


def test_a_broken_documented_command_fails_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nasyncflow run train.steps=30 \\\n  train.no_such_field=1   # typo\n"
        "asyncflow run --resume runs/ck   # (not checked in CI: needs the run above)\n```\n"
    )
    commands = documented_commands([page], tmp_path)
    assert [c.line for c in commands] == [2]  # the continuation joined; the marked one skipped
    why = check(commands[0], capsys)
    assert why is not None and "no_such_field" in why
