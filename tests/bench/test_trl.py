"""bench.trl without TRL: what both sides are given, the checks, the summaries, our runner."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncflow import load_config
from asyncflow.build import build_reward, build_tokenizer
from bench.trl import build_spec, check_equal, trl_args, unmatched
from bench.trl_match import (
    ids_digest,
    probe_completions,
    ratios,
    reward_function,
    rewards_digest,
    summarize_run,
    threshold_time,
)
from engines.hf.text import encode_prompts

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return build_spec("arithmetic", 300)[0]


def test_the_grpo_config_matches_the_demo_defaults(spec: dict[str, Any]) -> None:
    a = spec["trl_args"]
    assert (a["per_device_train_batch_size"], a["num_generations"]) == (64, 8)
    assert (a["max_completion_length"], a["temperature"], a["top_p"]) == (4, 0.7, 1.0)
    assert (a["learning_rate"], a["adam_beta2"], a["max_grad_norm"]) == (2e-4, 0.99, 1.0)
    assert (a["beta"], a["loss_type"], a["lr_scheduler_type"]) == (0.0, "grpo", "constant")
    assert a["shuffle_dataset"] is False and a["max_steps"] == 300 and a["num_iterations"] == 1
    # TRL's shipped bf16 autocast and gradient checkpointing are off: ours computes in fp32
    assert a["bf16"] is False and a["gradient_checkpointing"] is False
    # an override of ours moves TRL's side with it
    cfg = load_config(None, ["train.lr=1e-4", "rollout.group_size=4", "train.clip_eps_high=0.28"])
    b = trl_args(cfg, 10)
    assert (b["learning_rate"], b["num_generations"], b["epsilon_high"]) == (1e-4, 4, 0.28)
    assert b["per_device_train_batch_size"] == 32


def test_what_cannot_be_matched_is_listed_and_a_meaningless_pairing_refused() -> None:
    notes = unmatched(load_config(None, []))
    assert any(n.startswith("advantages") and "0.935x" in n for n in notes)
    assert any("is_cap=2.0" in n for n in notes)
    with pytest.raises(ValueError, match=r"train\.loss=tis"):
        unmatched(load_config(None, ["train.loss=decoupled"]))
    with pytest.raises(ValueError, match="lower --steps"):
        build_spec("arithmetic", 400)  # 400 x 8 prompts > the 2,400 given


def test_prompt_ids_equal_when_rendered_as_trl_renders_conversations(
    spec: dict[str, Any],
) -> None:
    tok = build_tokenizer(Path(spec["model_dir"]))
    ours = [t.tolist() for t in encode_prompts(tok, spec["prompts"])]
    convs = [[{"role": "user", "content": p}] for p in spec["prompts"]]
    theirs = tok.apply_chat_template(
        conversation=convs, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert len(ours) == 2400 and ids_digest(ours) == ids_digest(theirs)
    # a digest tells token splits apart
    assert ids_digest([[1, 2], [3]]) != ids_digest([[1], [2, 3]])


def test_the_trl_reward_wrapper_scores_as_our_reward_stage(spec: dict[str, Any]) -> None:
    probe = probe_completions(spec["columns"]["answer"])
    assert len(probe) >= 20_000
    ours = build_reward(load_config(None, []))(
        [""] * len(probe), [t for t, _ in probe], answer=[a for _, a in probe]
    )
    theirs = reward_function(spec)(
        [[{"role": "user", "content": ""}]] * len(probe),
        [[{"role": "assistant", "content": t}] for t, _ in probe],
        answer=[a for _, a in probe],
        completion_ids=[[0]] * len(probe),  # TRL passes more keywords; the wrapper drops them
    )
    assert rewards_digest(list(ours)) == rewards_digest(theirs)
    assert 0 < sum(x or 0.0 for x in theirs) < len(probe)  # both right and wrong answers
    assert rewards_digest([None]) == rewards_digest([math.nan]) != rewards_digest([0.0])


def test_differing_digests_fail_loudly() -> None:
    same = {"prompt_ids_digest": "a" * 64, "reward_probe_digest": "b" * 64}
    check_equal({"trl": [same], "k=0": [dict(same)]})
    with pytest.raises(RuntimeError, match="prompt_ids_digest of k=0"):
        check_equal({"trl": [same], "k=0": [{**same, "prompt_ids_digest": "c" * 64}]})


def _run(start: float, step_s: float, rewards: list[float], first: float) -> dict[str, Any]:
    times = [start + first + i * step_s for i in range(len(rewards))]
    return {"start": start, "step_times": times, "rewards": rewards, "train_s": first + 9 * step_s}


def test_summaries_rates_threshold_time_and_ratios() -> None:
    assert threshold_time([1, 2, 3, 4], [0.0, 0.5, 0.5, 0.9], 0.5, 2) == 3
    assert threshold_time([1, 2, 3], [0.9, 0.0, 0.9], 0.5, 2) is None  # no full window reaches it
    rewards = [0.1] * 5 + [0.6] * 5
    trl = summarize_run(_run(100.0, 0.2, rewards, first=5.0), 64, 0.5, 2)
    assert trl["samples_per_s"] == pytest.approx(64 / 0.2)  # steady: between first and last
    assert trl["first_step_s"] == pytest.approx(5.0)
    assert trl["threshold_s"] == pytest.approx(5.0 + 6 * 0.2)
    assert (trl["reward_first"], trl["reward_last"]) == (pytest.approx(0.1), pytest.approx(0.6))
    fast = summarize_run(_run(0.0, 0.1, rewards, first=4.0), 64, 0.5, 2)
    bad = summarize_run(_run(0.0, 0.1, [0.1] * 10, first=4.0), 64, 0.5, 2)
    out = ratios({"trl": [trl, trl], "k=1": [fast, fast], "k=0": [bad, bad]}, "trl")
    r = out["ratios"]["k=1"]
    assert r["samples_per_s"] == pytest.approx(2.0) and r["first_step"] == pytest.approx(0.8)
    assert r["reward_within_spread"] is True
    assert out["ratios"]["k=0"]["reward_within_spread"] is False
    assert out["ratios"]["k=0"]["threshold"] is None  # never reached
    one_seed = ratios({"trl": [trl], "k=1": [fast]}, "trl")["ratios"]["k=1"]
    assert one_seed["reward_within_spread"] is None  # one point is no spread
    with pytest.raises(ValueError, match="at least 2 steps"):
        summarize_run(_run(0.0, 0.1, [0.1], first=1.0), 64, 0.5, 2)


def test_our_runner_trains_a_few_steps_and_digests_its_inputs(
    spec: dict[str, Any], tmp_path: Path
) -> None:
    small = {**spec, "steps": 3}
    (tmp_path / "spec.json").write_text(json.dumps(small))
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "bench.trl_ours", str(tmp_path / "spec.json"), "0", "1", str(out)],
        cwd=REPO, env=env, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    res = json.loads(out.read_text())
    assert len(res["step_times"]) == len(res["rewards"]) == 3
    assert res["step_times"] == sorted(res["step_times"]) and res["train_s"] > 0
    tok = build_tokenizer(Path(spec["model_dir"]))
    assert res["prompt_ids_digest"] == ids_digest(
        [t.tolist() for t in encode_prompts(tok, spec["prompts"])]
    )
    s = summarize_run({**res, "start": res["step_times"][0] - 1.0}, 64, 0.4, 2)
    assert s["steps"] == 3 and s["samples_per_s"] > 0
