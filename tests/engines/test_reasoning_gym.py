"""Task ``reasoning_gym``: rows and scores equal the library's own for the same seed, mixes
included; answer extraction; a held-out seed; the missing extra fails before the run."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from asyncflow import load_config
from asyncflow.config import ConfigError
from asyncflow.config.check import check_config
from engines import reasoning_gym as rgt
from engines.rewards import make_reward
from engines.tasks import make_task, task_columns

rg = pytest.importorskip("reasoning_gym", reason="needs the reasoning-gym extra")

ONE = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
MIX: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"weight": 1, "config": {"max_terms": 2}},
    "chain_sum": {"weight": 3, "config": {"min_terms": 2, "max_terms": 2}},
}


def test_rows_are_the_librarys_entries_for_the_same_seed() -> None:
    task = make_task("reasoning_gym", seed=7, dataset="basic_arithmetic", config=ONE, size=20)
    theirs = rg.create_dataset("basic_arithmetic", size=20, seed=7, **ONE)
    for i in range(20):
        item, entry = task.item(i), theirs[i]
        assert item.prompt == entry["question"] and item.answer == str(entry["answer"])
        assert item.reference == item.answer and item.row()["rg_index"] == i
        assert task.item(i + 20) == item  # endless: round and round the entries
    again = make_task("reasoning_gym", seed=7, dataset="basic_arithmetic", config=ONE, size=20)
    assert [again.item(i) for i in range(20)] == task.items(20)  # deterministic by seed
    held_out = make_task("reasoning_gym", seed=8, dataset="basic_arithmetic", config=ONE, size=20)
    assert [it.prompt for it in held_out.items(20)] != [it.prompt for it in task.items(20)]
    assert task_columns("reasoning_gym", dataset="chain_sum") == task.columns()


def test_scores_are_the_datasets_own_score_answer() -> None:
    task = make_task("reasoning_gym", seed=3, dataset="basic_arithmetic", config=ONE, size=8)
    theirs = rg.create_dataset("basic_arithmetic", size=8, seed=3, **ONE)
    reward = make_reward("reasoning_gym")
    rows = [task.item(i).row() for i in range(8)]
    for completion_of in (
        lambda e: str(e["answer"]),  # right, as the last line
        lambda e: f"let me think\n<answer> {e['answer']} </answer>\nbye",  # right, in the tag
        lambda e: f"{e['answer']}\n17",  # the last line wins: wrong unless it is 17
        lambda e: "no idea",
        lambda e: "",
    ):
        completions = [completion_of(theirs[i]) for i in range(8)]
        scores = reward(
            [r["prompt"] for r in rows],
            completions,
            answer=[r["answer"] for r in rows],
            rg_spec=[r["rg_spec"] for r in rows],
            rg_index=[r["rg_index"] for r in rows],
        )
        expected = [
            theirs.score_answer(rgt.extract_answer(c), theirs[i]) for i, c in enumerate(completions)
        ]
        assert scores == expected
    right = [str(theirs[i]["answer"]) for i in range(8)]
    assert all(
        s == 1.0
        for s in reward([""] * 8, right, rg_spec=[r["rg_spec"] for r in rows], rg_index=range(8))
    )


def test_a_weighted_mix_is_the_librarys_composite() -> None:
    from reasoning_gym.composite import DatasetSpec

    task = make_task("reasoning_gym", seed=5, datasets=MIX, size=30)
    theirs = rg.create_dataset(
        "composite",
        size=30,
        seed=5,
        datasets=[DatasetSpec(n, float(d["weight"]), d["config"]) for n, d in sorted(MIX.items())],
    )
    sources = set()
    reward = make_reward("reasoning_gym")
    for i in range(30):
        item, entry = task.item(i), theirs[i]
        assert item.prompt == entry["question"] and item.answer == str(entry["answer"])
        sources.add(entry["metadata"]["source_dataset"])
        row = item.row()
        [score] = reward([item.prompt], ["0"], rg_spec=[row["rg_spec"]], rg_index=[row["rg_index"]])
        assert score == theirs.score_answer("0", entry)
    assert sources == set(MIX)


def test_answer_extraction() -> None:
    assert rgt.extract_answer("a\n<answer>1</answer> then <answer> 42 </answer>\nz") == "42"
    assert rgt.extract_answer("work\n\n  41  \n") == "41"
    assert rgt.extract_answer("<answer>9</answer>\n7", "last_line") == "7"
    assert rgt.extract_answer("  x y  ", "full") == "x y"
    assert rgt.extract_answer("   ") is None
    assert rgt.extract_answer("ab", "tests.engines.test_reasoning_gym:first_char") == "a"
    with pytest.raises(ValueError, match=r"options\.extract"):
        make_task("reasoning_gym", dataset="chain_sum", extract="regex")
    with pytest.raises(ValueError, match="exactly one of"):
        make_task("reasoning_gym")
    with pytest.raises(
        ValueError, match=r"options\.config: reasoning-gym dataset .* refused it: .*no_such_option"
    ):
        make_task("reasoning_gym", dataset="chain_sum", config={"no_such_option": 1})


def first_char(completion: str) -> str | None:
    return completion[:1] or None


def test_a_run_config_takes_its_reward_and_fails_early_without_the_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = load_config(
        None,
        [
            "task.name=reasoning_gym",
            "task.options.dataset=chain_sum",
            "task.options.config={min_terms: 2, max_terms: 2}",
            "task.options.size=50",
        ],
    )
    assert cfg.reward_functions() == ["reasoning_gym"]
    task = check_config(cfg)
    assert (
        task.item(0).prompt
        == rg.create_dataset("chain_sum", size=50, seed=cfg.task.seed, min_terms=2, max_terms=2)[0][
            "question"
        ]
    )
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if it were not installed
    rgt.build_dataset.cache_clear()
    with pytest.raises(ConfigError, match=r"pip install") as e:
        check_config(cfg)
    assert "\n" not in str(e.value) and "task=reasoning_gym" in str(e.value)
    rgt.build_dataset.cache_clear()


def test_a_cut_off_completion_has_no_answer_unless_a_tag_closed() -> None:
    one_digit = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = make_task("reasoning_gym", seed=0, dataset="basic_arithmetic", config=one_digit)
    item = next(it for it in task.items(50) if len(it.answer) == 1)
    oracle = item.answer
    sprayed = f"11{oracle}1"  # the right digit among others: the library's partial credit
    completions = [sprayed, sprayed, f"<answer>{oracle}</answer>1", oracle]
    n = len(completions)
    columns = {"rg_spec": [item.extra["rg_spec"]] * n, "rg_index": [item.extra["rg_index"]] * n}
    reward = make_reward("reasoning_gym")
    finished = ["stop", "length", "length", "stop"]
    assert reward([item.prompt] * n, completions, finish_reason=finished, **columns) == [
        0.25,  # finished: scored by the dataset as written
        0.0,  # cut off at the token limit: a fragment, no answer
        1.0,  # cut off after a closed tag: that answer
        1.0,
    ]
    # a caller without the rollout's column: every completion counts as finished
    assert reward([item.prompt] * n, completions, **columns)[:2] == [0.25, 0.25]


def test_the_reward_stage_passes_the_rollouts_finish_reason() -> None:
    from adapters import RewardAdapter
    from asyncflow import graph
    from engines.rewards import MathAnswerReward, WeightedReward, rollout_columns

    cfg = load_config(None, ["task.name=reasoning_gym", "task.options.dataset=basic_arithmetic"])
    alone = make_reward("reasoning_gym")
    mixed = WeightedReward([(MathAnswerReward(), 1.0), (alone, 0.5), (alone, 0.5)])
    assert rollout_columns(alone) == rollout_columns(mixed) == ("finish_reason",)
    assert rollout_columns(MathAnswerReward()) == ()
    for fn in (alone, mixed):
        stage = graph.reward_adapter(RewardAdapter, fn, None, cfg)
        assert stage.input_fields == (
            "prompt",
            "response_ids",
            "answer",
            "rg_spec",
            "rg_index",
            "finish_reason",
        )
