"""The prompt feeder's admission with dynamic sampling, over a real registry and an embedded
TransferQueue: filtered groups free their count, replacements are admitted under the bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

import transferqueue
from asyncflow.feeder import PromptFeeder
from asyncflow.registry import Registry
from engines.tasks import make_task
from engines.tiny import build_tokenizer
from transferqueue.aio import within

BOUND_S = 30.0


async def _until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await within(poll(), BOUND_S)


class _Waits(Registry):
    """The registry, counting the feeder's waits (each one follows a decision not to admit)."""

    waits = 0

    async def wait_changed(self, seen: int, timeout_s: float) -> tuple[int, int, int]:
        self.waits += 1
        return await super().wait_changed(seen, timeout_s)


def _feeder(client: transferqueue.AsyncClient, reg: Registry, **kw: object) -> PromptFeeder:
    options: dict[str, object] = {
        "group_size": 2,
        "groups_per_step": 2,
        "max_staleness": 0,
        "total_groups": 4,
        "dynamic_sampling": True,
        **kw,
    }
    task = options.pop("task", make_task("arithmetic", seed=0))
    return PromptFeeder(client, task, build_tokenizer(), reg, **options)  # type: ignore[arg-type]


def test_each_filtered_group_admits_one_replacement_under_the_bound() -> None:
    """B = 2, k = 0, two steps. Version 0 admits groups 0 and 1 (counted 0, 1). Group 1 is
    filtered: group 2 is admitted as the second counted group of step 0 (min_gen_version 0);
    group 2 is filtered: group 3 likewise. Version 1: groups 4 and 5 are counted 2 and 3, step
    1's (min_gen_version 1). Then the run has its four trained groups: nothing more."""

    async def go(tq: transferqueue.TransferQueue) -> dict[int, int]:
        client = tq.async_client()
        await client.declare_tasks(["rollout"], partition="train")
        reg = _Waits(0)
        feeder = _feeder(client, reg)
        job = asyncio.create_task(feeder.run())
        try:
            await _until(lambda: feeder.admitted == 2)
            await reg.filter_groups([1])
            await _until(lambda: feeder.admitted == 3)
            await reg.filter_groups([2])
            await _until(lambda: feeder.admitted == 4)
            await reg.publish(1)
            await _until(lambda: feeder.admitted == 6)
            waits = reg.waits
            await reg.publish(2)  # the run's groups are all counted: no more admitted
            await _until(lambda: reg.waits > waits)
            assert feeder.admitted == 6
            assert not job.done()  # it stays for replacements until the driver ends it
        finally:
            job.cancel()
        assert [j for j, _ in feeder.admission_log] == list(range(6))
        meta = await client.get_meta(
            "rollout", ["min_gen_version"], batch_size=12, partition="train", timeout_s=5
        )
        col = (await client.get_data(meta, ["min_gen_version"]))["min_gen_version"]
        assert isinstance(col, torch.Tensor)
        return dict(zip(meta.groups.tolist(), col.tolist(), strict=True))

    with transferqueue.start(num_units=1) as tq:
        required = asyncio.run(go(tq))
    assert required == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1}


def test_a_finite_task_that_runs_out_fails_naming_the_options() -> None:
    class _Three:
        """The arithmetic task cut to three prompts."""

        def __init__(self) -> None:
            self.inner = make_task("arithmetic", seed=0)

        def num_items(self) -> int:
            return 3

        def item(self, index: int) -> object:
            assert index < 3
            return self.inner.item(index)

    async def go(tq: transferqueue.TransferQueue) -> None:
        client = tq.async_client()
        await client.declare_tasks(["rollout"], partition="train")
        reg = Registry(0)
        feeder = _feeder(client, reg, task=_Three(), total_groups=2)
        job = asyncio.create_task(feeder.run())
        await _until(lambda: feeder.admitted == 2)
        await reg.filter_groups([0])
        await _until(lambda: feeder.admitted == 3)
        await reg.filter_groups([1])
        with pytest.raises(RuntimeError, match=r"task\.options\.epochs"):
            await within(job, BOUND_S)

    with transferqueue.start(num_units=1) as tq:
        asyncio.run(go(tq))


def test_admission_counts_from_the_published_version_and_demands_it() -> None:
    """B = 2, k = 0, one on_demand generator holding version 0 and busy (so it takes newer
    weights only when they are demanded). Version 0 admits step 0's two groups and no more.
    Once version 1 is published, step 1's groups are admitted at once, before any generator
    holds version 1 (their rows require it: the rollout routes them only to a generator that
    does), and the feeder demands version 1, which lets the busy generator update."""

    async def go(tq: transferqueue.TransferQueue) -> None:
        client = tq.async_client()
        await client.declare_tasks(["rollout"], partition="train")
        reg = _Waits(0, policy="on_demand")
        await reg.register("gen0", 0)
        await reg.report("gen0", in_flight=3)  # busy: no update without a demand
        feeder = _feeder(client, reg, dynamic_sampling=False)
        job = asyncio.create_task(feeder.run())
        try:
            await _until(lambda: feeder.admitted == 2)
            waits = reg.waits
            await _until(lambda: reg.waits > waits)  # it looked again and waits: the bound
            assert feeder.admitted == 2
            assert await reg.wait_update("gen0", timeout_s=0.05) is None  # nothing published
            await reg.publish(1)
            await _until(lambda: feeder.admitted == 4)
            assert await reg.newest_generator_version() == 0  # admitted before any load
            assert feeder.admission_log == [(0, 0), (1, 0), (2, 1), (3, 1)]
            # the feeder's demand lets the busy generator take version 1
            assert await reg.wait_update("gen0", timeout_s=5.0) == 1
        finally:
            job.cancel()
        meta = await client.get_meta(
            "rollout", ["min_gen_version"], batch_size=8, partition="train", timeout_s=5
        )
        col = (await client.get_data(meta, ["min_gen_version"]))["min_gen_version"]
        assert isinstance(col, torch.Tensor)
        got = dict(zip(meta.groups.tolist(), col.tolist(), strict=True))
        assert got == {0: 0, 1: 0, 2: 1, 3: 1}

    with transferqueue.start(num_units=1) as tq:
        asyncio.run(go(tq))


def test_prefetch_is_one_step_when_synchronous_and_never_with_refills() -> None:
    """``train.prefetch_steps`` resolved: 1 at ``max_staleness=0``, 0 when the stages overlap,
    0 where groups are refilled (a prefetched group bound to the next step's weights would
    stand before a replacement the current step needs: the run would wait for weights that
    come only after the step), and an explicit prefetch there is refused, naming the field."""
    from asyncflow import load_config

    assert load_config(None, ["train.max_staleness=0"]).prefetch_steps() == 1
    assert load_config(None, ["train.max_staleness=2"]).prefetch_steps() == 0
    assert (
        load_config(None, ["train.max_staleness=1", "train.prefetch_steps=2"]).prefetch_steps() == 2
    )
    refilled = ["train.max_staleness=0", "train.dynamic_sampling=true"]
    assert load_config(None, refilled).prefetch_steps() == 0
    assert load_config(None, ["train.max_staleness=0", "task=tool_use"]).prefetch_steps() == 0
    with pytest.raises(ValueError, match=r"train\.prefetch_steps needs groups that are never"):
        load_config(None, [*refilled, "train.prefetch_steps=1"])
