"""HF transformers generation engine: batched sampling with a KV cache and behaviour log-probs.

Implements :class:`engines.protocols.GenerationEngine`; called by the rollout adapter
(``generate``) and the weight-sync path (``update_weights``).

Why a hand-written sampling loop rather than ``model.generate``: the behaviour log-probs must be
computed from exactly the logits the token was drawn from, in the convention the trainer and
the scoring engine use. Here each step draws from ``softmax(logits / temperature)`` and records
``log_softmax(logits / temperature)[token]``, which is what
:func:`engines.hf.batching.response_logprobs` computes at the same temperature (tests check
agreement). Conventions:

- ``temperature == 0`` is greedy; the recorded log-probs are then those of the untempered
  (temperature 1) distribution.
- ``top_k`` / ``top_p`` truncate the distribution *sampled from*, but the recorded log-probs
  stay those of the full temperature-scaled softmax, the policy the trainer models. Under
  truncation they are therefore approximate behaviour log-probs: lower than those of the
  truncated distribution by ``-log(kept mass)``, and the loss treats the samples as drawn
  from the untruncated policy.

Concurrency: the blocking torch work runs on one dedicated worker thread per engine, so the
event loop is never blocked and calls run one at a time in arrival order. Concurrent
``generate`` calls are not merged into one batch. A lock additionally guards the model against
direct use of the blocking methods from other threads. What a weight update does to the call
running when it arrives depends on ``partial``:

- ``partial=False`` (default): ``update_weights`` is queued behind the calls before it (a call
  boundary), so every token of a ``Generation`` comes from one version.
- ``partial=True`` (interruptible generation, ``rollout.partial``): the update is handed to the
  running call, which loads it at its next token boundary (between two decode steps), then
  recomputes the KV cache of every sequence (prompt and tokens so far) with the new weights
  and goes on decoding. Tokens sampled before keep their log-probs and their version, those
  after get the new ones (``Generation.token_versions``), so each recorded log-prob is exactly
  ``log p_v(token | prefix)`` for the version ``v`` that drew it. With no call running the
  update loads at once. Either way ``update_weights`` returns once the weights are in use.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from transformers import PreTrainedModel

from engines.hf.batching import prefill_shared
from engines.hf.loading import ModelSource, eos_token_ids, load_model, load_weights
from engines.protocols import Generation, SamplingParams
from engines.sched import compute_bound

__all__ = ["INLINE_LOAD_BYTES", "HFGenerationEngine", "sample_tokens"]


INLINE_LOAD_BYTES = 16 << 20
"""Weights at most this large load on the caller's thread when the engine is idle (see
:meth:`HFGenerationEngine.update_weights`): a copy of well under a millisecond."""


def _state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class HFGenerationEngine:
    """Samples responses with a HF causal LM; see the module docstring for the conventions.

    Args:
        model: a saved model folder or an in-memory model (shared, not copied).
        device: where the model runs.
        dtype: dtype for a model loaded from a folder.
        seed: seeds the engine's generator, which draws a seed for every call whose
            ``SamplingParams.seed`` is None, so a run is reproducible call by call.
        version: version of the initial weights; -1 (the protocol's "none yet") by default,
            pass 0 when they are the trainer's initial weights.
        max_batch_size: prompts sampled together in one batch; larger calls are chunked.
        pad_id: id used for padding (masked out, any id works); default the model's pad id or 0.
        partial: interruptible generation: an update lands at the running call's next token
            boundary instead of after it (see the module docstring).
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        version: int = -1,
        max_batch_size: int = 64,
        pad_id: int | None = None,
        partial: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._model = load_model(model, dtype=dtype, device=device)
        self._model.eval()
        self._device = next(self._model.parameters()).device
        self._eos = eos_token_ids(self._model)
        config_pad = getattr(self._model.config, "pad_token_id", None)
        self._pad_id = int(pad_id if pad_id is not None else (config_pad or 0))
        self._max_batch_size = max_batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._version = version
        self._lock = threading.Lock()
        self.partial = partial
        # updates handed to the running call (partial): (state, version, done), in order
        self._pending: list[tuple[Mapping[str, torch.Tensor], int, Future[None]]] = []
        self._pending_lock = threading.Lock()
        self.tokens_decoded = 0
        """Tokens sampled so far by this engine (finished sequences' padding not counted)."""
        self.kept_tokens = 0
        """Tokens of running sequences that weight updates interrupted and kept (partial):
        what aborting and generating them again would have thrown away."""
        self._queued = 0  # calls handed to the worker thread and not finished (event loop's)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self._finalizer = weakref.finalize(self, self._executor.shutdown, wait=False)

    @property
    def version(self) -> int:
        """Version of the weights currently loaded."""
        return self._version

    @property
    def model(self) -> PreTrainedModel:
        """The underlying model (read-only use; load weights through ``update_weights``)."""
        return self._model

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """Sample one response per prompt on the worker thread (see ``generate_sync``)."""
        loop = asyncio.get_running_loop()
        self._queued += 1
        try:
            return await loop.run_in_executor(self._executor, self.generate_sync, prompts, params)
        finally:
            self._queued -= 1

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state`` and adopt ``version``: after the calls queued before this one, or,
        with ``partial``, at the running call's next token boundary.

        With no call queued or running and a small state (at most ``INLINE_LOAD_BYTES``),
        the copy runs here, on the caller's thread: shorter than handing it to the worker
        thread, where each of its tensor calls waits for the GIL while the event loop works
        (a small model's load took 4 ms that way instead of 0.5)."""
        loop = asyncio.get_running_loop()
        if not self.partial:
            small = not self._queued and _state_bytes(state) <= INLINE_LOAD_BYTES
            if small and self._lock.acquire(blocking=False):  # (no direct blocking call)
                try:
                    load_weights(self._model, dict(state))
                    self._version = version
                finally:
                    self._lock.release()
                return
            self._queued += 1
            try:
                await loop.run_in_executor(self._executor, self.load_weights, state, version)
            finally:
                self._queued -= 1
            return
        done: Future[None] = Future()
        with self._pending_lock:
            self._pending.append((state, version, done))
        # With no call running, the worker loads it as soon as it is free.
        self._executor.submit(self._load_pending_now)
        await asyncio.wrap_future(done)

    @compute_bound
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Blocking form of ``update_weights``: copy ``state`` in place under the lock."""
        with self._lock:
            load_weights(self._model, dict(state))
            self._version = version

    def _load_pending_now(self) -> None:
        with self._lock:
            self._load_pending()

    def _load_pending(self, running_tokens: int = 0) -> bool:
        """Load the updates handed over so far, in order (the lock is held); True if any
        landed, then ``running_tokens`` (the running sequences' tokens) count as kept. A
        refused state fails its own ``update_weights`` and changes nothing."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        landed: list[Future[None]] = []
        for state, version, done in pending:
            try:
                load_weights(self._model, dict(state))
            except Exception as exc:
                done.set_exception(exc)
                continue
            self._version = version
            landed.append(done)
        if landed:
            self.kept_tokens += running_tokens  # before the updates return: they report it
        for done in landed:
            done.set_result(None)
        return bool(landed)

    @compute_bound
    def generate_sync(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """Blocking form of ``generate``: sample one response per prompt under the lock."""
        for i, prompt in enumerate(prompts):
            if prompt.dim() != 1 or prompt.numel() == 0:
                raise ValueError(
                    f"prompt {i} must be a non-empty 1-D token tensor, got shape "
                    f"{tuple(prompt.shape)}"
                )
        with self._lock:
            if self.partial:
                self._load_pending()  # an update that came while this call was queued
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
            generator = torch.Generator(device=self._device).manual_seed(seed)
            stops = self._eos | frozenset(int(t) for t in params.stop_token_ids)
            out: list[Generation] = []
            for start in range(0, len(prompts), self._max_batch_size):
                chunk = prompts[start : start + self._max_batch_size]
                out.extend(self._generate_batch(chunk, params, stops, generator))
            return out

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        params: SamplingParams,
        stops: frozenset[int],
        generator: torch.Generator,
    ) -> list[Generation]:
        device = self._device
        batch = len(prompts)
        stop_ids = torch.tensor(sorted(stops), dtype=torch.long, device=device)
        out, attn, next_pos = self._prefill(list(prompts))
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        tokens: list[torch.Tensor] = []
        logps: list[torch.Tensor] = []
        versions: list[int] = []  # per decode step: every row's token of that step
        for step in range(params.max_new_tokens):
            logits = out.logits[:, -1, :].float()  # [B, V]
            token, logp = sample_tokens(logits, params, generator)  # [B], [B]
            token = torch.where(finished, self._pad_id, token)
            tokens.append(token)
            logps.append(logp)
            versions.append(self._version)
            live = int((~finished).sum())
            lengths += (~finished).long()
            self.tokens_decoded += live
            finished |= torch.isin(token, stop_ids)
            if bool(finished.all()) or step == params.max_new_tokens - 1:
                break
            if self.partial and self._pending and self._load_pending(int(lengths[~finished].sum())):
                # a token boundary: recompute every sequence's cache with the new weights
                so_far = torch.stack(tokens, 1).cpu()  # [B, step + 1]
                seqs = [
                    torch.cat([p.reshape(-1).long(), so_far[i, : int(lengths[i])]])
                    for i, p in enumerate(prompts)
                ]
                out, attn, next_pos = self._prefill(seqs)
                continue
            attn = torch.cat([attn, torch.ones((batch, 1), dtype=attn.dtype, device=device)], 1)
            out = self._model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            next_pos = next_pos + 1
        all_tokens = torch.stack(tokens, 1).cpu()  # [B, steps]
        all_logps = torch.stack(logps, 1).cpu()
        step_versions = torch.tensor(versions, dtype=torch.int64)  # [steps]
        results = []
        for i in range(batch):
            n = int(lengths[i])
            results.append(
                Generation(
                    token_ids=all_tokens[i, :n].clone(),
                    logprobs=all_logps[i, :n].clone(),
                    finish_reason="stop" if bool(finished[i]) else "length",
                    version=self._version if n == 0 else -1,
                    token_versions=step_versions[:n].clone(),
                )
            )
        return results

    def _prefill(self, seqs: list[torch.Tensor]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Run the sequences (left-padded) through the model with a fresh cache, each distinct
        one once when a group's samples share their prompt (``engines.hf.batching``): ``(output
        whose last logits predict the next token, attention mask [B, L], next positions
        [B])``."""
        out, attn, positions = prefill_shared(self._model, seqs, self._pad_id)  # [B, L]
        return out, attn, positions[:, -1] + 1

    def close(self) -> None:
        """Stop the worker thread (idempotent); queued calls still finish."""
        self._finalizer()


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``: ``(tokens [B] int64, logprobs [B] float32)``.

    The log-probs are those of the full ``softmax(logits / temperature)`` (temperature 1 when
    greedy), whatever ``top_k`` / ``top_p`` truncate; see the module docstring.
    """
    logits = logits.float()
    if params.temperature == 0:
        token = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
        return token, logp
    scaled = logits / params.temperature
    logp_all = torch.log_softmax(scaled, -1)  # [B, V]
    filtered = scaled
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        probs_sorted, order = torch.softmax(filtered, -1).sort(-1, descending=True)
        mass_before = probs_sorted.cumsum(-1) - probs_sorted  # [B, V]
        drop_sorted = mass_before >= params.top_p  # the top token has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, -1)
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [B]
    logp = logp_all.gather(-1, token[:, None]).squeeze(-1)
    return token, logp
