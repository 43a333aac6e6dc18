"""TRL's runner for ``bench.trl``: ``GRPOTrainer`` (TRL 1.16.0) run as its users run it.

Runs in TRL's own virtualenv (``python -m bench.trl --setup`` builds it), one process per
run, started by ``bench.trl``::

    bench/.trl-venv/bin/python -m bench.trl_runner SPEC.json SEED OUT.json

``SPEC.json`` (written by ``bench.trl``) names the model folder, the prompts and their
reward columns, the reward functions and the ``GRPOConfig`` arguments. From our code it
imports ``engines.rewards`` (the reward functions, plain Python) and ``bench.trl_match``
(digests, the reward wrapper), nothing else. The prompts go in as conversations (one user
turn), which TRL renders with the tokenizer's chat template and the generation prompt;
after training, the token ids TRL's own ``_tokenize_prompts`` gives for every prompt, and
the reward wrapper's values on the probe strings, are digested for the parent to compare
with ours (untimed).

``OUT.json``: ``step_times`` (epoch s when each step was logged), ``rewards`` (TRL's mean
reward of each step), ``train_s`` (``trainer.train()``), ``import_s``, the digests.
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
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from bench.trl_match import ids_digest, probe_completions, reward_function, rewards_digest  # noqa: E402

T_READY = time.time()


def main(spec_path: str, seed: int, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(seed)
    prompts = [[{"role": "user", "content": p}] for p in spec["prompts"]]
    ds = Dataset.from_dict({"prompt": prompts, **spec["columns"]})
    reward = reward_function(spec)
    step_times: list[float] = []
    rewards: list[float] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                step_times.append(time.time())
                rewards.append(float(logs["reward"]))

    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as out_dir:
        args = GRPOConfig(output_dir=out_dir, seed=seed, **spec["trl_args"])
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Steps()],
        )
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        # untimed checks: TRL's own prompt tokenization, and its reward call on the probe
        ids: list[list[int]] = []
        for i in range(0, len(prompts), 256):
            got, _, _ = trainer._tokenize_prompts(prompts[i : i + 256])
            ids += [list(map(int, x)) for x in got]
    probe = probe_completions(spec["columns"]["answer"]) if "answer" in spec["columns"] else []
    values = reward(
        [[{"role": "user", "content": ""}]] * len(probe),
        [[{"role": "assistant", "content": text}] for text, _ in probe],
        answer=[a for _, a in probe],
    )
    result = {
        "system": f"trl {trl.__version__}",
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "import_s": T_READY - T_IMPORT,
        "step_times": step_times,
        "rewards": rewards,
        "train_s": train_s,
        "prompt_ids_digest": ids_digest(ids),
        "prompts": len(ids),
        "reward_probe_digest": rewards_digest(values),
        "reward_probe_size": len(probe),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
