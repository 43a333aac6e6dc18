"""Plug your own engine into asyncflow: implement one Protocol, or subclass one adapter.

    python examples/custom_engine.py --output-dir runs/custom

Two extension points, both used below in a real GRPO run on the tiny model:

1. A generation engine of your own. Anything with ``version``, ``async generate`` and
   ``async update_weights`` is a ``engines.GenerationEngine``; here one built on
   transformers' ``model.generate`` (instead of asyncflow's own sampling loop), recording
   behaviour log-probs from the logits ``generate`` returns. Swap in a client of your
   inference server the same way.
2. A subclassed adapter: a reward stage that also writes a ``response_len`` column, which
   any later stage (or an analysis job) can read from TransferQueue.

Nothing else changes: the workflow, TransferQueue, staleness control and weight sync are the
same as for the built-in engines.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Mapping, Sequence

import torch

from adapters import RewardAdapter, StageOutput
from asyncflow import RunConfig, build_components, load_config
from asyncflow.build import Components, model_path
from asyncflow.workflow import Workflow
from engines import Generation, SamplingParams
from engines.hf import load_model, load_weights
from engines.hf.batching import left_pad
from transferqueue import BatchMeta
from transferqueue.schema import Column


class GenerateAPIEngine:
    """A GenerationEngine on ``transformers``' ``model.generate`` (one call at a time)."""

    def __init__(self, model_dir: str, *, seed: int = 0) -> None:
        self.model = load_model(model_dir)
        self.model.eval()
        self._version = 0
        self._lock = threading.Lock()  # one generate / weight load at a time
        self._seed = seed

    @property
    def version(self) -> int:
        return self._version

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        return await asyncio.to_thread(self._generate, prompts, params)

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        def load() -> None:
            with self._lock:  # waits for the generate call in flight: a call boundary
                load_weights(self.model, state)
                self._version = version

        await asyncio.to_thread(load)

    @torch.inference_mode()
    def _generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        with self._lock:
            version = self._version
            pad = int(self.model.config.pad_token_id or 0)
            ids, mask = left_pad(prompts, pad)  # [B, P]
            self._seed += 1
            torch.manual_seed(self._seed)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=params.temperature > 0,
                temperature=params.temperature or None,
                top_k=0,
                max_new_tokens=params.max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
            )
            new = out.sequences[:, ids.shape[1] :]  # [B, T]
            logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
            temp = params.temperature if params.temperature > 0 else 1.0
            logp = torch.log_softmax(logits / temp, dim=-1).gather(-1, new.unsqueeze(-1))[..., 0]
            eos = int(self.model.config.eos_token_id)
            gens = []
            for i in range(new.shape[0]):
                row = new[i]
                stop = (row == eos).nonzero()
                n = int(stop[0]) + 1 if stop.numel() else row.numel()
                gens.append(
                    Generation(
                        token_ids=row[:n].clone(),
                        logprobs=logp[i, :n].clone(),
                        finish_reason="stop" if stop.numel() else "length",
                        version=version,
                    )
                )
            return gens


class RewardWithLength(RewardAdapter):
    """The built-in reward stage, plus a ``response_len`` column for whoever wants it."""

    output_fields = ("reward", "response_len")

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        out = await super().process(meta, cols)
        responses = cols["response_ids"]
        assert not isinstance(responses, list | torch.Tensor)
        out.columns["response_len"] = responses.lengths.to(torch.int32)
        return out


def custom_components(cfg: RunConfig) -> Components:
    """What the config builds, with the generation engine swapped for ours."""
    comps = build_components(cfg)
    folder = str(model_path(cfg, comps.task))
    comps.generators = [GenerateAPIEngine(folder, seed=cfg.rollout.seed)]
    return comps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-dir", default="runs/custom")
    ap.add_argument("overrides", nargs="*", help="section.field=value ...")
    args = ap.parse_args()
    cfg = load_config(
        overrides=["train.steps=100", *args.overrides, f"output.dir={args.output_dir}"]
    )
    comps = custom_components(cfg)
    result = Workflow(cfg, comps, adapters={"reward": RewardWithLength}).run()
    first, last = result.reward_first_last()
    print(
        f"custom engine: {len(result.records)} steps in {result.wall_s:.0f} s, "
        f"mean reward {first:.3f} -> {last:.3f}"
    )


if __name__ == "__main__":
    main()
