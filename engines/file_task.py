"""Prompts and reference answers read from files: the ``file`` task.

Reads a JSONL / JSON / Parquet / CSV file, or a Hugging Face ``datasets`` folder on a local
path, keeps only the columns the config names, and serves the rows as the items of a
:class:`engines.tasks.Task`, reshuffled every epoch:

| source                          | how it is read                           | needs           |
|---------------------------------|------------------------------------------|-----------------|
| ``*.jsonl`` (one object a line) | ``json`` line by line (exact values)     |                 |
| ``*.json`` (a list of objects)  | ``json``                                 |                 |
| ``*.parquet``                   | ``pyarrow.parquet`` (named columns only) | pyarrow         |
| ``*.csv``                       | ``pyarrow.csv``; every cell a string     | pyarrow         |
| a ``save_to_disk`` folder       | ``datasets.load_from_disk``              | datasets extra  |
| another folder (data files)     | ``datasets.load_dataset(path)``          | datasets extra  |

Item ``i`` is row ``perm_e[i mod N]`` of epoch ``e = i // N`` (``N`` rows), ``perm_e`` a
permutation drawn from ``(seed, e)`` (the identity with ``shuffle=False``). So, as for the
generated tasks, item ``i`` depends only on the file, the config, the seed and ``i``: a run
that resumes from item ``i`` sees what an uninterrupted one would, every row comes once per
epoch, and each epoch has its own order. With ``epochs`` set the task ends after that many
passes (``num_items() = epochs * N``) and asking for an item past it raises ``IndexError``.

The prompt column holds a text (one user turn) or chat messages (a list of ``{"role",
"content"}`` dicts, as in TRL's and verl's conversational datasets). The chat template is
applied where the prompts are encoded (:func:`engines.hf.text.encode_prompts`, whenever the
tokenizer has one), never here, so a prompt is templated exactly once.

Called by :func:`engines.tasks.make_task` (``make_task("file", path=..., prompt_key=...)``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.tasks import Prompt, Task, TaskItem

__all__ = ["DATA_FORMATS", "FileTask", "FileTaskConfig", "read_columns"]

DATA_FORMATS = ("jsonl", "json", "parquet", "csv", "hf")
"""Values of ``FileTaskConfig.format``."""
_SUFFIXES = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_RESERVED = ("prompt", "answer")  # the row's own column names; extra_keys may not reuse them
_DATASETS_HINT = "pip install 'asyncflow[datasets]'"


@dataclass(kw_only=True, frozen=True)
class FileTaskConfig:
    """Where the rows are and which columns are the prompt and the answer."""

    path: str
    """A data file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or a folder: one written by
    ``datasets``' ``save_to_disk``, or data files ``datasets.load_dataset`` reads."""
    format: str | None = None
    """One of ``jsonl json parquet csv hf``; default: from the file's suffix (``hf`` for a
    folder)."""
    split: str | None = None
    """Split of a ``datasets`` folder that has several (default: ``train``, or the only one)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a text, or chat messages (list of role/content dicts)."""
    answer_key: str | None = "answer"
    """Column holding the reference answer the rewards compare to (None: no answer column;
    the row's ``answer`` is None and answer-based rewards give no verdict)."""
    reference_key: str | None = None
    """Column holding a full correct completion (used by the tiny model's warm start);
    default: the answer as text."""
    extra_keys: Sequence[str] = ()
    """More columns handed to the reward as keyword arguments (e.g. ``[numbers]`` for the
    countdown reward)."""
    prompt_template: str | None = None
    """Text prompts only: a template with ``{prompt}``, e.g. ``"{prompt} Answer with a
    number."`` (default: the prompt as it is)."""
    system_prompt: str | None = None
    """A system turn put before every prompt (the prompt becomes chat messages)."""
    shuffle: bool = True
    """Reshuffle the rows every epoch (from the task's seed and the epoch)."""
    epochs: int | None = None
    """Passes over the rows the task gives (None: endless)."""
    max_rows: int | None = None
    """Keep only the first rows of the file (None: all)."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path must name a data file or folder, got {self.path!r}")
        if self.format is not None and self.format not in DATA_FORMATS:
            raise ValueError(f"format must be one of {list(DATA_FORMATS)}, got {self.format!r}")
        if isinstance(self.extra_keys, str) or not all(isinstance(k, str) for k in self.extra_keys):
            raise ValueError(f"extra_keys must be a list of column names, got {self.extra_keys!r}")
        object.__setattr__(self, "extra_keys", tuple(self.extra_keys))  # frozen: hashable
        clash = sorted(set(self.extra_keys) & set(_RESERVED))
        if clash:
            raise ValueError(
                f"extra_keys {clash} clash with the row's own columns {list(_RESERVED)}; "
                "name the prompt and answer columns with prompt_key and answer_key"
            )
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template must contain '{{prompt}}', got {self.prompt_template!r}"
            )
        for name in ("epochs", "max_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")

    def keys(self) -> dict[str, str]:
        """The columns read from the source, in order, each with the option that names it."""
        named = [
            (self.prompt_key, "prompt_key"),
            (self.answer_key, "answer_key"),
            (self.reference_key, "reference_key"),
            *((k, "extra_keys") for k in self.extra_keys),
        ]
        keys: dict[str, str] = {}
        for key, option in named:
            if key is not None:
                keys.setdefault(key, option)
        return keys


class FileTask(Task):
    """The rows of a file (or ``datasets`` folder) as task items, reshuffled every epoch."""

    name = "file"
    config_class = FileTaskConfig

    def __init__(self, config: FileTaskConfig, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config
        self.path = Path(config.path)
        self.columns_read = read_columns(
            self.path, config.keys(), format=config.format, split=config.split
        )
        rows = len(self.columns_read[config.prompt_key])
        if config.max_rows is not None:
            rows = min(rows, config.max_rows)
            self.columns_read = {k: v[:rows] for k, v in self.columns_read.items()}
        if rows == 0:
            raise ValueError(f"{self.path} has no rows")
        self.num_rows = rows
        self._prompts = [self._prompt(i) for i in range(rows)]  # bad prompts fail here, not late
        self._perms: dict[int, np.ndarray] = {}
        self._digest: str | None = None

    def num_items(self) -> int | None:
        epochs = self.config.epochs
        return None if epochs is None else epochs * self.num_rows

    def spec(self) -> dict[str, Any]:
        # The content digest makes caches keyed by the spec (the tiny model's warm start) see
        # an edited file as a new task.
        if self._digest is None:
            self._digest = _digest(self.path)
        config = {**asdict(self.config), "extra_keys": list(self.config.extra_keys)}
        return {"name": self.name, "seed": self.seed, "config": config, "sha256": self._digest}

    def row_index(self, index: int) -> int:
        """The row of the source that item ``index`` is."""
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        limit = self.num_items()
        if limit is not None and index >= limit:
            raise IndexError(
                f"item {index} is past the {self.config.epochs} epoch(s) of {self.num_rows} "
                f"rows of {self.path} ({limit} items); raise epochs or ask for fewer items"
            )
        epoch, position = divmod(index, self.num_rows)
        if not self.config.shuffle:
            return position
        return int(self._permutation(epoch)[position])

    def item(self, index: int) -> TaskItem:
        row = self.row_index(index)
        cfg = self.config
        cols = self.columns_read
        answer = None if cfg.answer_key is None else cols[cfg.answer_key][row]
        if cfg.reference_key is not None:
            reference = str(cols[cfg.reference_key][row])
        else:
            reference = "" if answer is None else str(answer)
        extra = {k: cols[k][row] for k in cfg.extra_keys}
        return TaskItem(prompt=self._prompts[row], answer=answer, reference=reference, extra=extra)

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        return ("answer", *config.extra_keys)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 4:  # readers move forward: keep the latest few epochs
                self._perms.pop(min(self._perms))
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perms[epoch] = perm
        return perm

    def _prompt(self, row: int) -> Prompt:
        cfg = self.config
        value = self.columns_read[cfg.prompt_key][row]
        where = f"{self.path} row {row}, column {cfg.prompt_key!r}"
        if isinstance(value, str):
            text = (
                value
                if cfg.prompt_template is None
                else cfg.prompt_template.replace("{prompt}", value)
            )
            if cfg.system_prompt is None:
                return text
            return [
                {"role": "system", "content": cfg.system_prompt},
                {"role": "user", "content": text},
            ]
        if not _is_messages(value):
            raise ValueError(
                f"{where}: a prompt must be a text or a list of {{role, content}} messages, "
                f"got {value!r:.200}"
            )
        if cfg.prompt_template is not None:
            raise ValueError(
                f"{where} holds chat messages; prompt_template applies to text prompts only"
            )
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in value]
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return messages


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value)
    )


# -- readers ------------------------------------------------------------------------------------
def read_columns(
    path: str | Path,
    keys: Sequence[str] | Mapping[str, str],
    *,
    format: str | None = None,
    split: str | None = None,
) -> dict[str, list[Any]]:
    """Columns ``keys`` of a data file or ``datasets`` folder, as Python lists of equal length.

    ``keys`` may map each column to the option that named it, for the error messages. Raises
    ``ValueError`` naming the path for a missing source, an unknown format, a malformed line,
    or a missing column (listing the columns the source has).
    """
    path = Path(path)
    if not isinstance(keys, Mapping):
        keys = {k: "" for k in keys}
    if not path.exists():
        raise ValueError(f"data path {str(path)!r} does not exist (relative to {Path.cwd()})")
    fmt = format or _format_of(path)
    if fmt == "jsonl":
        return _pick(_read_jsonl(path), keys, path)
    if fmt == "json":
        return _pick(_read_json(path), keys, path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        _check_keys(keys, names, path)
        table = pq.read_table(path, columns=list(keys))
        return {k: table.column(k).to_pylist() for k in keys}
    if fmt == "csv":
        import pyarrow as pa
        import pyarrow.csv as pcsv

        # Every cell as text: CSV has no types, and inference would turn "007" into 7.
        header = pcsv.open_csv(path).schema.names
        _check_keys(keys, header, path)
        table = pcsv.read_csv(
            path,
            convert_options=pcsv.ConvertOptions(
                include_columns=list(keys), column_types={k: pa.string() for k in keys}
            ),
        )
        return {k: table.column(k).to_pylist() for k in keys}
    return _read_hf(path, keys, split)


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "hf"
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its suffix; name it .jsonl, .json, "
            f".parquet or .csv, or set format to one of {list(DATA_FORMATS)}"
        )
    return fmt


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number} is not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number} must be a JSON object, got {row!r:.100}")
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path} must hold a JSON list of objects (for one object a line: .jsonl)")
    return data


def _pick(rows: list[dict[str, Any]], keys: Mapping[str, str], path: Path) -> dict[str, list[Any]]:
    if rows:
        _check_keys(keys, list(rows[0]), path)
    out: dict[str, list[Any]] = {k: [] for k in keys}
    for number, row in enumerate(rows):
        for k in keys:
            try:
                out[k].append(row[k])
            except KeyError:
                raise ValueError(
                    f"{path} row {number} has no column {k!r}; it has {sorted(row)}"
                ) from None
    return out


def _check_keys(keys: Mapping[str, str], names: Sequence[str], path: Path) -> None:
    missing = [f"{k!r}" + (f" ({keys[k]})" if keys[k] else "") for k in keys if k not in names]
    if missing:
        raise ValueError(
            f"{path} has no column {', '.join(missing)}; its columns are {list(names)}: name "
            "them with prompt_key, answer_key (null: none), reference_key, extra_keys"
        )


def _read_hf(path: Path, keys: Mapping[str, str], split: str | None) -> dict[str, list[Any]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path} is read with Hugging Face datasets, which is not installed; {_DATASETS_HINT}"
        ) from None
    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    if saved:
        loaded: Any = datasets.load_from_disk(str(path))
    else:  # a folder of data files, or a single file in a format only datasets reads
        loaded = datasets.load_dataset(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None:
            if "train" in names or len(names) == 1:
                split = "train" if "train" in names else names[0]
            else:
                raise ValueError(f"{path} has splits {names}; choose one with split")
        if split not in names:
            raise ValueError(f"{path} has no split {split!r}; its splits are {names}")
        loaded = loaded[split]
    _check_keys(keys, loaded.column_names, path)
    table = loaded.select_columns(list(keys)).to_dict()
    return {k: list(table[k]) for k in keys}


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
