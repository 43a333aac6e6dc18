"""Our runner for ``bench.trl``: the GRPO workflow run as the example runs it, one process.

Started by ``bench.trl`` in our virtualenv, one process per run::

    python -m bench.trl_ours SPEC.json SEED MAX_STALENESS OUT.json

The config is the defaults (``load_config``) plus the case's overrides from ``SPEC.json``,
with ``model.name`` set to the model folder TRL gets too, ``rollout.seed`` to ``SEED`` and
``train.max_staleness`` to ``MAX_STALENESS``; ``asyncflow.run`` trains it (metrics into a
temporary folder). After the run (untimed), the token ids of the task's first prompts as our
feeder encodes them (``engines.hf.text.encode_prompts``) and our reward stage's function on
the probe strings are digested for the parent to compare with TRL's.

``OUT.json``: ``step_times`` (epoch s at the end of each step), ``rewards`` (mean per step),
``train_s`` (``asyncflow.run``'s wall time), ``import_s``, the digests.
"""

from __future__ import annotations

import time

T_IMPORT = time.time()

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from asyncflow import load_config, run  # noqa: E402
from asyncflow.build import build_reward, build_task, build_tokenizer  # noqa: E402
from bench.trl_match import ids_digest, probe_completions, rewards_digest  # noqa: E402
from engines.hf.text import encode_prompts  # noqa: E402

T_READY = time.time()


def overrides(spec: dict[str, Any], seed: int, staleness: int, out_dir: str) -> list[str]:
    """The run's config overrides: the case's, then the model folder, seed, bound, steps."""
    return [
        *spec["ours_overrides"],
        f"model.name={spec['model_dir']}",
        f"rollout.seed={seed}",
        f"train.max_staleness={staleness}",
        f"train.steps={spec['steps']}",
        f"output.dir={out_dir}",
    ]


def main(spec_path: str, seed: int, staleness: int, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with tempfile.TemporaryDirectory(prefix="bench-trl-ours-") as out_dir:
        cfg = load_config(None, overrides(spec, seed, staleness, out_dir))
        t0 = time.perf_counter()
        result = run(cfg)
        train_s = time.perf_counter() - t0
    origin = result.timeline.origin
    records = result.records
    # untimed checks: our feeder's prompt ids and our reward stage's function
    task = build_task(cfg)
    items = task.items(len(spec["prompts"]))
    tok = build_tokenizer(Path(spec["model_dir"]))
    ids = [t.tolist() for t in encode_prompts(tok, [it.prompt for it in items])]
    probe = probe_completions([it.answer for it in items])
    values = build_reward(cfg)(
        [""] * len(probe), [t for t, _ in probe], answer=[a for _, a in probe]
    )
    out = {
        "system": f"asyncflow max_staleness={staleness}",
        "torch_threads": torch.get_num_threads(),
        "import_s": T_READY - T_IMPORT,
        "step_times": [origin + r["time_s"] for r in records],
        "rewards": [r["reward"] for r in records],
        "train_s": train_s,
        "prompt_ids_digest": ids_digest(ids),
        "prompts": len(ids),
        "reward_probe_digest": rewards_digest(list(values)),
        "reward_probe_size": len(probe),
    }
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
