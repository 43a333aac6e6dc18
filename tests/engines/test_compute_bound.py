"""An engine's compute in the normal scheduling class inside a process put in ``SCHED_BATCH``
(:mod:`engines.sched`): the HF engines' generation and training on the real tiny model."""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from engines.hf import HFGenerationEngine, HFTrainingEngine
from engines.protocols import SamplingParams, TrainBatch
from engines.sched import compute_bound

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's SCHED_BATCH")


def _in_thread(fn: Callable[[], Any], batch: bool) -> tuple[Any, int]:
    """``fn()`` on a new thread (in ``SCHED_BATCH`` first when ``batch``): its result and the
    thread's class after it."""
    out: dict[str, Any] = {}

    def body() -> None:
        if batch:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        try:
            out["result"] = fn()
        except Exception as e:  # (handed to the test)
            out["error"] = e
        out["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=body)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if "error" in out:
        raise out["error"]
    return out["result"], out["after"]


def test_a_compute_bound_call_runs_in_the_normal_class_and_its_thread_goes_back() -> None:
    seen: list[int] = []

    @compute_bound
    def work(fail: bool = False) -> int:
        seen.append(os.sched_getscheduler(0))
        if fail:
            raise ValueError("inside")
        return 7

    assert _in_thread(work, batch=True) == (7, os.SCHED_BATCH)
    assert _in_thread(work, batch=False) == (7, os.SCHED_OTHER)  # left as it was
    with pytest.raises(ValueError, match="inside"):
        _in_thread(lambda: work(fail=True), batch=True)
    assert seen == [os.SCHED_OTHER] * 3


def _recording(model: torch.nn.Module, seen: list[int]) -> None:
    """Record the calling thread's class at every forward pass of ``model``."""
    model.register_forward_pre_hook(lambda *_: seen.append(os.sched_getscheduler(0)))


def test_the_hf_engines_generate_and_train_in_the_normal_class_from_a_batch_thread(
    tiny_model: PreTrainedModel,
) -> None:
    seen: list[int] = []
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), seed=0)
    _recording(gen.model, seen)
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    gens, after = _in_thread(
        lambda: gen.generate_sync(prompts, SamplingParams(max_new_tokens=3)), batch=True
    )
    assert len(gens) == 2 and after == os.SCHED_BATCH
    assert seen and set(seen) == {os.SCHED_OTHER}, seen

    seen.clear()
    trainer = HFTrainingEngine(copy.deepcopy(tiny_model))
    _recording(trainer.model, seen)
    batch = TrainBatch(
        prompt_ids=prompts,
        response_ids=[g.token_ids for g in gens],
        behaviour_logprobs=[g.logprobs for g in gens],
        advantages=torch.tensor([1.0, -1.0]),
        versions=torch.zeros(2, dtype=torch.int64),
    )
    metrics, after = _in_thread(lambda: trainer.forward_backward(batch, 1.0), batch=True)
    assert "loss" in metrics and after == os.SCHED_BATCH
    assert seen and set(seen) == {os.SCHED_OTHER}, seen
