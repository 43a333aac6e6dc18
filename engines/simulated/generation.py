"""A generation engine whose compute is a timed model of continuous batching.

:class:`SimulatedGenerationEngine` implements :class:`engines.protocols.GenerationEngine`. The
rollout adapter awaits ``generate`` once per micro-batch (several calls may be in flight); the
weight-sync watcher awaits ``update_weights`` after each train step. Nothing is computed: each
request gets a target length from a :class:`~engines.simulated.lengths.LengthModel`, and one
scheduler task per engine advances time the way a vLLM-style engine would, by sleeping
``time_scale`` real seconds per modelled second.

The model of one generation instance (:class:`DecodeLatency`)::

    waiting (FIFO)          running (at most max_batch)            one iteration
    r7 r8 r9 ...  --join-->  r1 r2 r3 r4 ...  b sequences  --->  every running sequence gains
                  at an                                          a token; t(b) = base_s +
                  iteration                                      per_seq_s * b, plus
                  boundary                                       prefill_s_per_token * prompt
                                                                 tokens of those joining now

A request whose sequence reaches its target leaves at the end of that iteration and its
``generate`` call returns once all of its requests have left, so a long request never holds
back short ones (continuous batching), and a full batch makes newcomers wait.

Scheduling cost does not grow with tokens: between events the batch is constant, so the
scheduler sleeps until the first running sequence will finish (``k`` iterations at once) and is
woken early only when a waiting request can join; it then advances to the end of the iteration
in progress. Times are kept on an ideal clock (``loop.time()``, i.e. ``time.monotonic``) so late
wake-ups do not accumulate; a scheduler more than ``max_lag_s`` behind (an overloaded machine:
choose a larger ``time_scale``) resynchronizes and counts the loss in ``stats.lag_s``.

Weight updates follow vLLM's ``pause_generation(mode="wait")``: new requests wait, running ones
finish on the old weights, then the engine sleeps ``sync_s`` (modelled weight load) and adopts
the version. The requests of one call that had not started when an update came run on the new
weights (as in vLLM), so samples of one call may carry different versions, each exact. With
``partial=True`` they follow ``mode="keep"`` instead (interruptible generation): the running
sequences stop at the end of the iteration in progress (a token boundary), the engine sleeps
``sync_s``, adopts the version, and they go on decoding where they stopped; each token records
the version that produced it (``Generation.token_versions``), so a sample may span versions.
The KV cache of the stopped sequences is modelled as recomputed within the load (vLLM's
``clear_cache=True`` recomputes it as part of the next prefill; not charged here).

Sample index (what makes the ``n`` samples of a prompt differ; a sample's length and tokens
depend only on its prompt and index, never on timing or weights version): with
``SamplingParams.seed`` it is derived from ``(seed, position in the call)``, like vLLM's
``seed + i``; without, from how many times the prompt was requested before, counted per engine
(mixed with the engine seed) or, with ``shared_counts``, across all the engines sharing that
dict. The same prompts then get the same samples whatever the micro-batch split, and with a
shared count whatever the routing, so schedules compared on one prompt stream do the same work.
Engines in several processes share the count (and the cut samples that continuations resume)
through a :class:`~engines.simulated.samples.SampleStore` (``samples=``): one lookup per
``generate`` call, before its requests are scheduled (:mod:`engines.simulated.samples`).
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engines.protocols import Generation, SamplingParams
from engines.simulated.hashing import hash64, prompt_key
from engines.simulated.lengths import LengthModel, LognormalLengths
from engines.simulated.samples import Claim, Cut, LocalSamples, SampleStore

__all__ = ["DecodeLatency", "GenerationStats", "SimulatedGenerationEngine"]

_MASK63 = (1 << 63) - 1


@dataclass(frozen=True, kw_only=True)
class DecodeLatency:
    """Iteration time of one continuous-batching generation instance.

    ``t(b) = base_s + per_seq_s * b`` for ``b`` running sequences; a sequence's prompt costs
    ``prefill_s_per_token`` per token in the iteration it joins (which also yields its first
    token). ``base_s`` is what an iteration costs regardless of batch (reading the weights,
    launching kernels), ``per_seq_s`` the marginal cost of one more sequence (its KV cache and
    activations). The defaults are SmolLM2-135M on vLLM (bf16, 2-core CPU) as recorded by
    ``bench/calibrate.py``.
    """

    base_s: float = 0.03975
    """Modelled seconds per iteration, independent of the batch."""
    per_seq_s: float = 0.001396
    """Modelled seconds per iteration per running sequence."""
    prefill_s_per_token: float = 0.0005788
    """Modelled seconds per prompt token, charged to the iteration a sequence joins in."""
    max_batch: int = 64
    """Most sequences running at once; later requests wait in FIFO order."""
    prefix_caching: bool = True
    """Charge a prompt's prefill once while a sequence with the same prompt is running or
    joins in the same iteration (vLLM's prefix cache; GRPO groups share prompts)."""

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_seq_s, self.prefill_s_per_token) < 0:
            raise ValueError(
                f"base_s, per_seq_s, prefill_s_per_token must be >= 0, got {self.base_s}, "
                f"{self.per_seq_s}, {self.prefill_s_per_token}"
            )
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def iteration_s(self, batch: int, prefill_tokens: int = 0) -> float:
        """Modelled seconds of one iteration with ``batch`` running sequences."""
        return self.base_s + self.per_seq_s * batch + self.prefill_s_per_token * prefill_tokens

    def tokens_per_s(self, batch: int) -> float:
        """Decode throughput at a steady batch of ``batch`` sequences (modelled tokens/s)."""
        t = self.iteration_s(batch)
        return batch / t if t > 0 else math.inf

    def scaled(self, speedup: float) -> DecodeLatency:
        """The same instance ``speedup`` times faster (e.g. a faster accelerator)."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        return replace(
            self,
            base_s=self.base_s / speedup,
            per_seq_s=self.per_seq_s / speedup,
            prefill_s_per_token=self.prefill_s_per_token / speedup,
        )


@dataclass
class GenerationStats:
    """Counters of one simulated engine, for a benchmark harness (modelled seconds)."""

    requests: int = 0
    """Requests (samples) finished."""
    tokens: int = 0
    """Tokens generated."""
    prefill_tokens: int = 0
    """Prompt tokens prefilled (prefix-cache hits excluded)."""
    iterations: int = 0
    """Decode iterations run; ``tokens / iterations`` is the mean running batch."""
    busy_s: float = 0.0
    """Modelled seconds with at least one sequence running."""
    updates: int = 0
    """Weight updates adopted."""
    sync_s: float = 0.0
    """Modelled seconds spent loading weights."""
    drain_s: float = 0.0
    """Modelled seconds updates waited for running requests to finish (``partial``: for the
    iteration in progress)."""
    interrupted: int = 0
    """Running sequences that updates interrupted and continued (``partial``)."""
    kept_tokens: int = 0
    """Tokens those sequences had when interrupted: what aborting them and generating them
    again would have thrown away."""
    lag_s: float = 0.0
    """Real seconds lost to late wake-ups beyond ``max_lag_s`` (nonzero: machine overloaded)."""


@dataclass(eq=False)
class _Request:
    prompt_len: int
    key: bytes
    index: int
    target: int
    truncated: bool
    future: asyncio.Future[Generation]
    natural: int = 0
    offset: int = 0
    budget: int = 0
    produced: int = 0
    version: int = -1  # weights version of its first token
    cancelled: bool = False
    switches: list[tuple[int, int]] = field(default_factory=list)  # (produced, new version)


@dataclass
class _State:
    """Per-event-loop state (an engine binds to the loop that uses it)."""

    loop: asyncio.AbstractEventLoop
    waiting: collections.deque[_Request] = field(default_factory=collections.deque)
    running: list[_Request] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    waiter: asyncio.Future[bool] | None = None  # set while the scheduler sleeps interruptibly
    drained: asyncio.Future[None] | None = None  # set while an update waits for running requests
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    paused: bool = False
    frozen: bool = False  # partial: running sequences stop at the next iteration boundary


class SimulatedGenerationEngine:
    """Continuous-batching generation simulated in time; see the module docstring.

    Args:
        latency: the instance's iteration-time model.
        lengths: response lengths; default :class:`LognormalLengths` (SmolLM2 fit).
        time_scale: real seconds per modelled second (0.01: a modelled minute takes 0.6 s).
        sync_s: modelled seconds to load new weights (the exposed part of a weight update);
            the default is SmolLM2's pause in ``VLLMGenerationEngine.update_weights``.
        vocab_size: token ids are drawn below it (use the harness tokenizer's size).
        eos_token_id: if given, responses that finish (not cut) end with it and no other
            token is it.
        seed: seeds the sample indexes of seed-less calls (without ``shared_counts``).
        version: weights version before the first update (-1: none yet).
        shared_counts: a dict shared by the instances of a run, counting requests per prompt,
            so that the k-th request of a prompt is the same sample on any instance (see the
            module docstring); None counts per engine.
        continuations: a dict shared by the instances of a run in which samples cut short by
            ``max_new_tokens`` are recorded, so that a request whose prompt is such a sample's
            prompt followed by its tokens continues that sample (on any instance sharing the
            dict) as a language model would; None records per engine.
        samples: instead of the two dicts, a store of both that instances in other processes
            share (:class:`~engines.simulated.samples.RaySamples`); sample numbers then count
            across its instances, as with ``shared_counts``.
        max_lag_s: real seconds the scheduler may fall behind its ideal clock and still catch
            up; beyond it resynchronizes (counted in ``stats.lag_s``).
        partial: interruptible generation: an update stops the running sequences at a token
            boundary and they continue on the new weights (see the module docstring).
    """

    def __init__(
        self,
        latency: DecodeLatency | None = None,
        lengths: LengthModel | None = None,
        *,
        time_scale: float = 1.0,
        sync_s: float = 0.7448,
        vocab_size: int = 32_000,
        eos_token_id: int | None = None,
        seed: int = 0,
        version: int = -1,
        shared_counts: dict[bytes, int] | None = None,
        continuations: dict[bytes, Any] | None = None,
        samples: SampleStore | None = None,
        max_lag_s: float = 0.02,
        partial: bool = False,
    ) -> None:
        if time_scale <= 0 or sync_s < 0 or max_lag_s < 0:
            raise ValueError(
                f"need time_scale > 0, sync_s >= 0, max_lag_s >= 0; got {time_scale}, "
                f"{sync_s}, {max_lag_s}"
            )
        if vocab_size < 2 or (eos_token_id is not None and not 0 <= eos_token_id < vocab_size):
            raise ValueError(
                f"need vocab_size >= 2 and 0 <= eos_token_id < vocab_size; got {vocab_size}, "
                f"{eos_token_id}"
            )
        self.latency = latency or DecodeLatency()
        self.lengths: LengthModel = lengths or LognormalLengths()
        self.time_scale = time_scale
        self.sync_s = sync_s
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.seed = seed
        self.max_lag_s = max_lag_s
        self.partial = partial
        self.stats = GenerationStats()
        self._version = version
        if samples is not None and (shared_counts is not None or continuations is not None):
            raise ValueError(
                "give samples= (a store shared across processes) or shared_counts=/"
                "continuations= (dicts shared in this process), not both"
            )
        self._shared = shared_counts is not None or samples is not None
        # prompt digest -> requests of it without a call seed so far, and digest of (prompt +
        # tokens so far) -> the cut sample a continuation resumes
        self._samples: SampleStore = samples or LocalSamples(shared_counts, continuations)
        self._state: _State | None = None
        self._closed = False

    # -- GenerationEngine -------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the weights the next request will start on."""
        return self._version

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """One response per prompt, returned when the last of them has finished decoding.

        The call's sample identities come from the sample store in one lookup before any of
        its requests is scheduled (with an in-process store the lookup never suspends, so
        scheduling is as without one); the samples it will cut are recorded there while they
        decode, and the call returns only once they are (their continuations may then be
        requested on any instance).
        """
        st = self._bind()
        keys = [self._key(i, p) for i, p in enumerate(prompts)]
        claims = await self._samples.claim(keys, params.seed is None)
        cuts: list[tuple[bytes, Cut]] = []
        requests = [
            self._request(st, i, p, k, c, params, cuts)
            for i, (p, k, c) in enumerate(zip(prompts, keys, claims, strict=True))
        ]
        recording = asyncio.ensure_future(self._samples.record(cuts)) if cuts else None
        st.waiting.extend(requests)
        self._kick(st)
        try:
            out = list(await asyncio.gather(*(r.future for r in requests)))
            if recording is not None:
                await recording  # a continuation may be requested as soon as this returns
            return out
        except BaseException:
            for r in requests:  # the scheduler drops them at the next iteration boundary
                r.cancelled = True
            if st.waiter is not None and not st.waiter.done():
                st.waiter.set_result(True)
            if recording is not None and not recording.done():
                recording.cancel()
            raise

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Wait for the running requests (``partial``: stop them at the end of the iteration in
        progress), sleep ``sync_s``, adopt ``version``; ``state`` unused.

        Requests arriving meanwhile (and those queued behind a full batch) start on the new
        weights; with ``partial`` the stopped ones go on with them. Concurrent updates are
        applied one after the other.
        """
        st = self._bind()
        async with st.update_lock:
            loop = st.loop
            started = loop.time()
            st.paused = True
            st.frozen = self.partial
            try:
                if st.running and st.task is not None and not st.task.done():
                    st.drained = loop.create_future()
                    if st.frozen and st.waiter is not None and not st.waiter.done():
                        st.waiter.set_result(True)  # stop at the iteration in progress
                    await st.drained
                drained = loop.time()
                await asyncio.sleep(self.sync_s * self.time_scale)
                self._version = version
                for r in st.running:  # stopped mid-sequence (partial): the rest is newer
                    if not r.cancelled:
                        r.switches.append((r.produced, version))
                        self.stats.interrupted += 1
                        self.stats.kept_tokens += r.produced
                self.stats.updates += 1
                self.stats.sync_s += self.sync_s
                self.stats.drain_s += (drained - started) / self.time_scale
            finally:
                st.paused = False
                st.frozen = False
                st.drained = None
                self._kick(st)

    # -- counters ---------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Sequences decoding now (for least-loaded routing)."""
        return 0 if self._state is None else sum(not r.cancelled for r in self._state.running)

    @property
    def drain_tokens(self) -> int:
        """How many more tokens the running requests are likely to need, as far as can be seen
        (0 if none): how long a weight update here would wait for them. Per request, the
        smaller of its remaining budget (``max_new_tokens``) and twice its tokens so far,
        counting those a continuation carries from before it migrated (long-tailed lengths:
        the longer a sample has run, the longer it is likely to go on, and a tail of runaway
        samples makes it longer still); the largest of these."""
        st = self._state
        if st is None:
            return 0
        return max(
            (
                min(r.budget - r.produced, 2 * (r.offset + r.produced))
                for r in st.running
                if not r.cancelled
            ),
            default=0,
        )

    @property
    def kept_tokens(self) -> int:
        """Tokens of running sequences that ``partial`` updates stopped and kept (what the
        weight-sync path reports per update)."""
        return self.stats.kept_tokens

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished (running or waiting): the instance's load."""
        return self.running + self.queued

    @property
    def queued(self) -> int:
        """Requests waiting to join the running batch."""
        return 0 if self._state is None else sum(not r.cancelled for r in self._state.waiting)

    def close(self) -> None:
        """Stop the scheduler (idempotent); calls in flight are cancelled."""
        self._closed = True
        st = self._state
        if st is not None and st.task is not None and not st.task.done():
            st.task.cancel()

    # -- internals --------------------------------------------------------------------------

    def _bind(self) -> _State:
        if self._closed:
            raise RuntimeError("SimulatedGenerationEngine is closed")
        loop = asyncio.get_running_loop()
        st = self._state
        if st is None or st.loop is not loop:
            if st is not None and not st.loop.is_closed() and st.loop.is_running():
                raise RuntimeError("the engine is in use by another running event loop")
            st = self._state = _State(loop=loop)
        return st

    @staticmethod
    def _key(position: int, prompt: torch.Tensor) -> bytes:
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"prompt {position} must be a non-empty 1-D token tensor, got shape "
                f"{tuple(prompt.shape)}"
            )
        return prompt_key(prompt)

    def _request(
        self,
        st: _State,
        position: int,
        prompt: torch.Tensor,
        key: bytes,
        claim: Claim,
        params: SamplingParams,
        cuts: list[tuple[bytes, Cut]],
    ) -> _Request:
        """The request for one prompt; appends to ``cuts`` the sample it will cut, if any."""
        if isinstance(claim, Cut):  # the continuation of a sample cut short: same sample
            cut = claim
            remaining = cut.natural - cut.offset
            target = min(remaining, params.max_new_tokens)
            return self._new_request(
                st,
                prompt,
                cut.key,
                cut.index,
                cut.natural,
                cut.offset,
                target,
                remaining,
                params.max_new_tokens,
                cuts,
            )
        if params.seed is not None:
            index = hash64("call", params.seed, position)
        elif self._shared:
            index = hash64("seen", claim)
        else:
            index = hash64("seen", self.seed, claim)
        natural = self.lengths.length(prompt, index)
        target = min(natural, params.max_new_tokens)
        return self._new_request(
            st, prompt, key, index, natural, 0, target, natural, params.max_new_tokens, cuts
        )

    def _new_request(
        self,
        st: _State,
        prompt: torch.Tensor,
        key: bytes,
        index: int,
        natural: int,
        offset: int,
        target: int,
        remaining: int,
        budget: int,
        cuts: list[tuple[bytes, Cut]],
    ) -> _Request:
        target = max(target, 1)
        cut_short = remaining > target
        if cut_short:  # record where a continuation (prompt + these tokens) resumes
            g = self._tokens(key, index, natural, offset, target)[0]
            cont = prompt_key(torch.cat([prompt.reshape(-1).to(torch.int64), g]))
            cuts.append((cont, Cut(key, index, natural, offset + target)))
        return _Request(
            prompt_len=int(prompt.numel()),
            key=key,
            index=index,
            target=target,
            truncated=cut_short or natural >= self.lengths.max_len,
            future=st.loop.create_future(),
            natural=natural,
            offset=offset,
            budget=budget,
        )

    def _joinable(self, st: _State) -> bool:
        return not st.paused and bool(st.waiting) and len(st.running) < self.latency.max_batch

    def _kick(self, st: _State) -> None:
        """Start the scheduler, or wake it early when a waiting request can join."""
        if st.task is None or st.task.done():
            resumable = not st.frozen and any(not r.cancelled for r in st.running)
            if self._joinable(st) or resumable:
                st.task = st.loop.create_task(self._schedule(st))
        elif st.waiter is not None and not st.waiter.done() and self._joinable(st):
            st.waiter.set_result(True)

    def _admit(self, st: _State) -> int:
        """Move waiting requests into free slots; returns the prompt tokens to prefill."""
        if st.paused:
            return 0
        room = self.latency.max_batch - len(st.running)
        cached = {r.key for r in st.running} if self.latency.prefix_caching else set()
        tokens = 0
        while room > 0 and st.waiting:
            r = st.waiting.popleft()
            if r.cancelled:
                continue
            r.version = self._version
            st.running.append(r)
            room -= 1
            if r.key not in cached:
                tokens += r.prompt_len
                if self.latency.prefix_caching:
                    cached.add(r.key)
        return tokens

    async def _schedule(self, st: _State) -> None:
        """Run iterations while sequences run; exit when none can (idle or paused)."""
        loop, lat, scale = st.loop, self.latency, self.time_scale
        clock = loop.time()  # ideal real time at which the next iteration starts
        try:
            while True:
                prefill = self._admit(st)
                st.running = [r for r in st.running if not r.cancelled]
                if not st.running or st.frozen:
                    break
                now = loop.time()
                if now - clock > self.max_lag_s:
                    self.stats.lag_s += now - clock
                    clock = now
                step = lat.iteration_s(len(st.running))
                first = step + lat.prefill_s_per_token * prefill
                k = min(r.target - r.produced for r in st.running)  # iterations to a finish
                n = k
                end = clock + (first + (k - 1) * step) * scale
                if k > 1 and await self._sleep(st, end):  # a waiting request can join
                    elapsed = (loop.time() - clock) / scale - first
                    n = 1 if elapsed <= 0 or step <= 0 else min(k, 1 + math.ceil(elapsed / step))
                    end = clock + (first + (n - 1) * step) * scale
                    await asyncio.sleep(max(end - loop.time(), 0.0))
                elif k == 1:
                    await asyncio.sleep(max(end - loop.time(), 0.0))
                clock = end
                self._advance(st, n, prefill, first + (n - 1) * step)
        except BaseException as exc:
            for r in [*st.running, *st.waiting]:
                if not r.future.done():
                    if isinstance(exc, asyncio.CancelledError):
                        r.future.cancel()
                    else:
                        r.future.set_exception(exc)
            st.running.clear()
            st.waiting.clear()
            raise
        finally:
            stopped = not st.running or st.frozen
            if st.drained is not None and not st.drained.done() and stopped:
                st.drained.set_result(None)

    async def _sleep(self, st: _State, deadline: float) -> bool:
        """Sleep until ``deadline`` (loop time); True if woken early by :meth:`_kick`."""
        waiter: asyncio.Future[bool] = st.loop.create_future()
        handle = st.loop.call_at(deadline, _resolve, waiter)
        st.waiter = waiter
        try:
            return await waiter
        finally:
            handle.cancel()
            st.waiter = None

    def _advance(self, st: _State, n: int, prefill: int, modelled_s: float) -> None:
        """Account ``n`` iterations and hand finished requests their results."""
        stats = self.stats
        stats.iterations += n
        stats.tokens += n * len(st.running)
        stats.prefill_tokens += prefill
        stats.busy_s += modelled_s
        still: list[_Request] = []
        for r in st.running:
            r.produced += n
            if r.produced < r.target:
                still.append(r)
                continue
            stats.requests += 1
            if not r.future.done():
                r.future.set_result(self._generation(r))
        st.running = still

    def _tokens(
        self, key: bytes, index: int, natural: int, offset: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``offset .. offset + n`` of a sample and their negative log-probs.

        The whole sample is drawn from its (prompt, index) hash, so a continuation yields
        exactly the tokens the uncut sample would have had; the last token of a sample that
        ends before ``max_len`` is the eos.
        """
        g = torch.Generator().manual_seed(hash64(key, index) & _MASK63)
        total, eos = max(natural, 1), self.eos_token_id
        high = self.vocab_size - (0 if eos is None else 1)
        tokens = torch.randint(0, high, (total,), generator=g)
        logprobs = -(torch.empty(total).exponential_(1.0, generator=g) + 1e-3)
        if eos is not None:
            tokens += (tokens >= eos).long()  # skip the eos id
            if natural < self.lengths.max_len:
                tokens[-1] = eos
        return tokens[offset : offset + n], logprobs[offset : offset + n].float()

    def _generation(self, r: _Request) -> Generation:
        """Deterministic tokens and negative log-probs for a finished request, each token with
        the version that produced it."""
        tokens, logprobs = self._tokens(r.key, r.index, r.natural, r.offset, r.target)
        versions = torch.full((r.target,), r.version, dtype=torch.int64)
        for at, version in r.switches:
            versions[at:] = version
        return Generation(
            token_ids=tokens.clone(),
            logprobs=logprobs.clone(),
            finish_reason="length" if r.truncated else "stop",
            token_versions=versions,
        )


def _resolve(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
