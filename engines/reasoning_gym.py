"""reasoning-gym as a task: its procedural datasets' rows, scored by their own ``score_answer``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates 100+ kinds of
problems with verifiable answers, each dataset with its own scorer. Task ``reasoning_gym``
serves one dataset, or a weighted mix of several (the library's ``composite`` dataset), built by
``reasoning_gym.create_dataset(name, size=, seed=, **config)``. How its entries map here:

| reasoning-gym                       | here                                                      |
|-------------------------------------|-----------------------------------------------------------|
| ``entry["question"]``               | ``prompt`` (through ``prompt_template``)                  |
| ``entry["answer"]``                 | ``answer`` (a correct answer: the warm start's reference) |
| the dataset (name, config, size,    | ``rg_spec`` (JSON, one per row) and ``rg_index``: the     |
| seed) and the entry's index         | reward rebuilds the entry from them, metadata included    |
| ``dataset.score_answer(answer,      | reward ``reasoning_gym``: the score of the answer         |
| entry)``                            | extracted from the completion (never re-implemented)      |

Item ``i`` is entry ``i mod size`` of the dataset: the task is endless, cycling over ``size``
entries, and the same for the same options and seed (the library seeds each entry from the
dataset's seed and its index). An evaluation (``eval.every_steps``) builds the same task with
``eval.seed``: held-out entries.

**Answer extraction** (``extract``): ``tag`` (default) takes the text inside the last
``<answer>...</answer>`` of the completion, else its last non-empty line; ``last_line`` the
last non-empty line; ``full`` the whole completion, stripped; or an import path
``module.path:function`` of ``(completion: str) -> str | None``. What is extracted goes to
``score_answer`` as the answer.

**Cut-off completions** (``finish_reason`` ``length``: the model was still writing at
``rollout.max_new_tokens``) have no answer (``None`` to the scorer: 0 from the library's
scorers) unless one was closed in an ``<answer>`` tag before the cut (extraction ``tag``):
their last line is a fragment, not an answer. Many scorers give partial credit to an answer
that contains the right one (``basic_arithmetic``: ``len(oracle) / len(answer)``, 0.25 for
``"1117"`` against ``"7"``), so scoring fragments pays a policy for filling every completion
with digits: a tiny model starting near 10% correct earns about as much that way as by
answering, and a run could settle there (every completion cut off, the reward flat at 0.1).

The library is an optional extra, imported only when the task or its reward is built:
without it, naming the task fails before the run starts with the line to type
(:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engines.imports import import_path
from engines.names import unknown_name
from engines.tasks import Task, TaskItem

__all__ = [
    "INSTALL_HINT",
    "ReasoningGymConfig",
    "ReasoningGymReward",
    "ReasoningGymTask",
    "extract_answer",
    "require",
]

INSTALL_HINT = "pip install 'asyncflow[reasoning-gym]' (or: pip install reasoning-gym)"
"""The line a missing library's error names."""

EXTRACTORS = ("tag", "last_line", "full")
"""The built-in answer extractions (or an import path of your own)."""

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def require() -> Any:
    """The ``reasoning_gym`` module; ``ImportError`` naming :data:`INSTALL_HINT` without it."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError(f"task reasoning_gym needs the reasoning-gym library: {INSTALL_HINT}")
    import reasoning_gym

    return reasoning_gym


@dataclass(kw_only=True, frozen=True)
class ReasoningGymConfig:
    """Options of task ``reasoning_gym``: one dataset (``dataset`` + ``config``) or a mix
    (``datasets``)."""

    dataset: str | None = None
    """A reasoning-gym dataset name, e.g. ``basic_arithmetic``, ``chain_sum``, ``leg_counting``."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword options of ``dataset`` (its config class's fields), e.g. ``{max_terms: 2}``."""
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A weighted mix instead: name -> ``{weight: w, config: {...}}`` (both optional; weight
    1), drawn by the library's ``composite`` dataset."""
    size: int = 1000
    """Entries of the dataset; item ``i`` is entry ``i mod size``."""
    extract: str = "tag"
    """How the answer is taken from a completion: ``tag``, ``last_line``, ``full``, or an
    import path ``module.path:function`` (see the module docstring)."""
    prompt_template: str = "{question}"
    """The prompt; ``{question}`` is the entry's question."""

    def __post_init__(self) -> None:
        if (self.dataset is None) == (not self.datasets):
            raise ValueError(
                "task reasoning_gym needs exactly one of options.dataset (a name, e.g. "
                "basic_arithmetic) and options.datasets (a mix: {name: {weight: 1, config: "
                f"{{}}}}}}), got dataset={self.dataset!r}, datasets={self.datasets!r}"
            )
        if self.dataset is None and self.config:
            raise ValueError("options.config goes with options.dataset; a mix sets each config")
        for name, spec in self.datasets.items():
            unknown = sorted(set(spec) - {"weight", "config"})
            if unknown:
                raise ValueError(
                    f"options.datasets.{name}: unknown keys {unknown}; expected weight, config"
                )
            weight = spec.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
                raise ValueError(f"options.datasets.{name}.weight must be > 0, got {weight!r}")
        if self.size < 1:
            raise ValueError(f"options.size must be >= 1, got {self.size}")
        if self.extract not in EXTRACTORS and ":" not in self.extract:
            raise ValueError(
                f"options.extract must be one of {list(EXTRACTORS)} or an import path "
                f"'module.path:function', got {self.extract!r}"
            )
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"options.prompt_template must contain '{{question}}', got {self.prompt_template!r}"
            )


class ReasoningGymTask(Task):
    """Rows of a reasoning-gym dataset (see the module docstring)."""

    name = "reasoning_gym"
    config_class = ReasoningGymConfig
    default_reward = "reasoning_gym"

    def __init__(self, config: ReasoningGymConfig, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config
        self._spec = json.dumps(
            {
                "dataset": config.dataset,
                "config": config.config,
                "datasets": config.datasets,
                "size": config.size,
                "seed": seed,
                "extract": config.extract,
            },
            sort_keys=True,
        )
        self.dataset = build_dataset(self._spec)  # fails here, before the run, without it
        if config.extract not in EXTRACTORS:
            _extractor(config.extract)  # a bad import path fails before the run too

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "config": asdict(self.config)}

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        return ("answer", "rg_spec", "rg_index")

    def item(self, index: int) -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        i = index % self.config.size
        entry = self.dataset[i]
        answer = str(entry["answer"])
        return TaskItem(
            prompt=self.config.prompt_template.format(question=entry["question"]),
            answer=answer,
            reference=answer,
            extra={"rg_spec": self._spec, "rg_index": i},
        )


@functools.lru_cache(maxsize=32)
def build_dataset(spec: str) -> Any:
    """The reasoning-gym dataset of a task's ``rg_spec`` (cached: every row of a task carries
    the same spec, and entries are generated on access).

    ``ValueError`` naming the option for an unknown dataset name (with the closest names the
    library has) or a config the library refuses, whatever it raises (its configs check
    themselves with ``assert``): ``options.config: reasoning-gym dataset 'gcd' refused it:
    max_value must be > min_value``.
    """
    rg = require()
    s = json.loads(spec)
    from reasoning_gym.factory import DATASETS

    if s["dataset"] is not None:
        if s["dataset"] not in DATASETS:
            raise ValueError(
                f"options.dataset: {unknown_name('reasoning-gym dataset', s['dataset'], DATASETS)}"
            )
        try:
            return rg.create_dataset(s["dataset"], size=s["size"], seed=s["seed"], **s["config"])
        except Exception as e:  # the library checks its configs with assert, any type
            raise ValueError(
                f"options.config: reasoning-gym dataset {s['dataset']!r} refused it: {_message(e)}"
            ) from e
    from reasoning_gym.composite import DatasetSpec

    for name in sorted(s["datasets"]):
        if name not in DATASETS:
            raise ValueError(
                f"options.datasets: {unknown_name('reasoning-gym dataset', name, DATASETS)}"
            )
    specs = [
        DatasetSpec(name, float(d.get("weight", 1.0)), dict(d.get("config", {})))
        for name, d in sorted(s["datasets"].items())
    ]
    try:
        return rg.create_dataset("composite", size=s["size"], seed=s["seed"], datasets=specs)
    except Exception as e:  # as above
        raise ValueError(f"options.datasets: reasoning-gym refused the mix: {_message(e)}") from e


def _message(e: BaseException) -> str:
    """An exception's own message in one line; its type where the message says little (an
    ``assert`` without text, a ``KeyError``'s bare key)."""
    text = " ".join(str(e).split())
    if not text or isinstance(e, KeyError):
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def extract_answer(completion: str, how: str = "tag") -> str | None:
    """The answer in ``completion`` by extraction ``how`` (see the module docstring); None
    when there is nothing to take."""
    if how == "full":
        return completion.strip() or None
    if how == "tag":
        tags = _TAG.findall(completion)
        if tags:
            return str(tags[-1]).strip()
    elif how != "last_line":
        got: str | None = _extractor(how)(completion)
        return got
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.lru_cache(maxsize=8)
def _extractor(path: str) -> Callable[[str], str | None]:
    fn = import_path(path, "answer extraction", target="function", example="mypkg.parse:answer")
    if not callable(fn):
        raise ValueError(f"answer extraction {path!r} is a {type(fn).__name__}, not callable")
    extract: Callable[[str], str | None] = fn
    return extract


class ReasoningGymReward:
    """Reward ``reasoning_gym``: each completion's extracted answer scored by its dataset's
    own ``score_answer(answer, entry)`` (a float in [0, 1]; an empty extraction, or a cut-off
    completion without a closed tag, goes to the scorer as None). Reads the ``rg_spec`` and
    ``rg_index`` columns of task ``reasoning_gym`` and the rollout's ``finish_reason`` (where
    a caller passes none, every completion counts as finished)."""

    rollout_columns = ("finish_reason",)
    """The rollout's columns read besides the row's (``engines.rewards.rollout_columns``)."""

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        specs, indexes = columns.get("rg_spec"), columns.get("rg_index")
        if specs is None or indexes is None:
            raise ValueError(
                "reward reasoning_gym reads the columns rg_spec and rg_index of task "
                f"reasoning_gym; the rows have {sorted(columns)}"
            )
        finished = columns.get("finish_reason") or ["stop"] * len(completions)
        out: list[float | None] = []
        for completion, spec, index, reason in zip(
            completions, specs, indexes, finished, strict=True
        ):
            dataset = build_dataset(str(spec))
            entry = dataset[int(index)]
            how = _spec_extract(str(spec))
            if reason == "length":  # cut off: only a closed tag holds a whole answer
                tags = _TAG.findall(completion) if how == "tag" else []
                answer = str(tags[-1]).strip() if tags else None
            else:
                answer = extract_answer(completion, how)
            out.append(float(dataset.score_answer(answer, entry)))
        return out


@functools.lru_cache(maxsize=32)
def _spec_extract(spec: str) -> str:
    extract: str = json.loads(spec)["extract"]
    return extract
