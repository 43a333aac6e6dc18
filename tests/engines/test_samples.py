"""The simulated engines' sample store (``engines.simulated.samples``): which sample a request
is, shared by instances in one process (``LocalSamples``) or across a Ray cluster
(``RaySamples``). Everything here runs on virtual time or waits on events; the Ray test is
marked ``ray``."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from engines.protocols import Generation, SamplingParams
from engines.simulated import (
    Cut,
    LocalSamples,
    RaySamples,
    SampleBook,
    SampleStore,
    SimulatedGenerationEngine,
)
from engines.simulated.samples import Claim
from tests.engines.samples_host import SampleHost, make_engine
from tests.virtual_time import run_virtual

PROMPTS = [torch.tensor([5, i, 9, 11]) for i in range(12)]


def _engine(**kwargs: Any) -> SimulatedGenerationEngine:
    return make_engine(**kwargs)


def _tokens(gens: Sequence[Generation]) -> list[list[int]]:
    return [g.token_ids.tolist() for g in gens]


# -- the book ------------------------------------------------------------------------------


def test_claim_numbers_requests_per_prompt_and_seeded_calls_do_not_count() -> None:
    book = SampleBook()
    assert book.claim([b"a", b"a", b"b"]) == [0, 1, 0]
    assert book.claim([b"a", b"b"], count=False) == [0, 0]  # a call seed fixes its samples
    assert book.claim([b"b", b"a"]) == [1, 2]
    assert book.counts == {b"a": 3, b"b": 2}


def test_a_recorded_cut_is_continued_exactly_once() -> None:
    book = SampleBook()
    cut = Cut(key=b"p", index=7, natural=300, offset=100)
    book.record([(b"p+100", cut)])
    assert book.claim([b"p+100", b"p+100"]) == [cut, 0]  # the second is a fresh prompt
    assert book.cuts == {}


def test_the_oldest_cuts_are_forgotten_beyond_max_cuts() -> None:
    book = SampleBook(max_cuts=2)
    cuts = [(f"k{i}".encode(), Cut(b"p", i, 10, 5)) for i in range(3)]
    book.record(cuts[:2])
    book.record(cuts[2:])
    assert list(book.cuts) == [b"k1", b"k2"]


# -- engines sharing a store ---------------------------------------------------------------


def test_a_local_store_gives_the_samples_and_timing_of_shared_dicts() -> None:
    """``samples=LocalSamples()`` is the dicts behind one object: same tokens, and the call
    takes the same virtual time (its lookups never suspend)."""

    async def draw(**kwargs: Any) -> tuple[list[list[int]], float]:
        engines = [_engine(**kwargs), _engine(**kwargs)]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outs = await asyncio.gather(*(engines[k % 2].generate(PROMPTS, _PARAMS) for k in range(4)))
        return [t for out in outs for t in _tokens(out)], loop.time() - t0

    counts: dict[bytes, int] = {}
    dicts = run_virtual(draw(shared_counts=counts))
    store = run_virtual(draw(samples=LocalSamples()))
    assert store == dicts
    assert len({len(t) for t in store[0]}) > 4  # the draws differ from each other


_PARAMS = SamplingParams(max_new_tokens=150)


class _GatedStore:
    """A store whose lookups suspend (as a remote one does) and whose ``record`` waits until
    the test opens a gate."""

    def __init__(self) -> None:
        self.local = LocalSamples()
        self.gate = asyncio.Event()
        self.recording = asyncio.Event()

    async def claim(self, keys: Sequence[bytes], count: bool) -> list[Claim]:
        await asyncio.sleep(0)
        return await self.local.claim(keys, count)

    async def record(self, cuts: Sequence[tuple[bytes, Cut]]) -> None:
        self.recording.set()
        await self.gate.wait()
        await self.local.record(cuts)


def test_a_call_returns_only_once_its_cuts_are_recorded_then_continues_elsewhere() -> None:
    """Cut at a budget on one instance, a sample's continuation (prompt + tokens so far) on
    another instance sharing a suspending store is the same sample; and the first call does
    not return before its cuts are in the store (a continuation may follow at once)."""
    store = _GatedStore()
    assert isinstance(store, SampleStore)

    async def go() -> None:
        whole = await _engine(samples=LocalSamples()).generate(PROMPTS, _PARAMS)
        first, second = _engine(samples=store), _engine(samples=store)
        call = asyncio.ensure_future(first.generate(PROMPTS, SamplingParams(max_new_tokens=30)))
        await store.recording.wait()
        await asyncio.sleep(10.0)  # every request decodes to its end (virtual time)
        assert not call.done()  # finished decoding, its cuts not recorded yet
        store.gate.set()
        heads = await call
        cut = [i for i, h in enumerate(heads) if h.finish_reason == "length"]
        assert cut and len(cut) < len(PROMPTS)
        tails = await second.generate(
            [torch.cat([PROMPTS[i], heads[i].token_ids]) for i in cut],
            SamplingParams(max_new_tokens=120),
        )
        for i, tail in zip(cut, tails, strict=True):
            assert torch.equal(torch.cat([heads[i].token_ids, tail.token_ids]), whole[i].token_ids)
        assert not store.local.book.cuts  # every cut was continued

    run_virtual(go())


def test_a_cancelled_call_stops_recording_its_cuts() -> None:
    store = _GatedStore()

    async def go() -> None:
        call = asyncio.ensure_future(
            _engine(samples=store).generate(PROMPTS, SamplingParams(max_new_tokens=30))
        )
        await store.recording.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        store.gate.set()
        await asyncio.sleep(0)
        assert not store.local.book.cuts

    run_virtual(go())


def test_a_store_and_shared_dicts_together_are_refused() -> None:
    with pytest.raises(ValueError, match=r"samples=.*not both"):
        _engine(samples=LocalSamples(), shared_counts={})


def test_a_ray_store_pickles_by_name_without_its_handle() -> None:
    store = RaySamples("book", namespace="ns", timeout_s=5.0)
    store._handle = object()  # a handle looked up in this process
    again = pickle.loads(pickle.dumps(store))
    assert (again.name, again.namespace, again.timeout_s) == ("book", "ns", 5.0)
    assert again._handle is None


@pytest.mark.ray
def test_engines_in_two_actors_share_a_ray_store(ray_cluster: None) -> None:
    """Two engines in two actors, one book actor: a group split over them draws the samples
    one engine would, and a sample cut in one actor continues in the other."""
    import ray

    from engines.simulated import start_ray_samples

    host: Any = ray.remote(num_cpus=0)(SampleHost)
    whole = _tokens(asyncio.run(_engine(samples=LocalSamples()).generate(PROMPTS, _PARAMS)))
    store, book = start_ray_samples("test-samples-book")
    try:
        a, b = host.remote(store), host.remote(store)
        heads = ray.get(a.generate.remote(PROMPTS[:6], 30), timeout=120)
        heads += ray.get(b.generate.remote(PROMPTS[6:], 30), timeout=120)
        cut = [i for i, h in enumerate(heads) if len(h) == 30 and len(whole[i]) > 30]
        assert cut
        tails = ray.get(
            a.generate.remote([torch.cat([PROMPTS[i], torch.tensor(heads[i])]) for i in cut], 120),
            timeout=120,
        )
        for i, tail in zip(cut, tails, strict=True):
            assert heads[i] + tail == whole[i]
        assert ray.get(book.claim.remote([b"x"]), timeout=60) == [0]
    finally:
        ray.kill(book)
