"""``train.strategy`` and the weight transport a Ray run picks: checks that need no cluster.

The transport choice is one pure function of where the hosts landed
(asyncflow/deploy/transport_choice.py); every branch of its table is checked here, the NCCL
and IPC ones included (they run on GPU clusters only).
"""

from __future__ import annotations

import pytest

from asyncflow import load_config
from asyncflow.config import ConfigError
from asyncflow.config.check import check_config
from asyncflow.deploy.transport_choice import Where, choose_transport
from asyncflow.transport import make_transport

RAY = ["deploy.mode=ray", "train.dp_size=2"]


def test_fsdp_is_a_ray_strategy_with_checked_options() -> None:
    cfg = load_config(overrides=[*RAY, "train.strategy=fsdp"])
    assert cfg.train.strategy == "fsdp" and cfg.train.strategy_options == {}
    with pytest.raises(ValueError, match=r"train\.strategy must be one of \('ddp', 'fsdp'\)"):
        load_config(overrides=["train.strategy=zero3"])
    with pytest.raises(ValueError, match=r"train\.strategy=fsdp needs deploy\.mode=ray"):
        load_config(overrides=["train.strategy=fsdp"])
    with pytest.raises(ValueError, match=r"strategy_options apply to train\.strategy=fsdp"):
        load_config(overrides=[*RAY, "train.strategy_options={param_dtype: bfloat16}"])
    bad = load_config(overrides=[*RAY, "train.strategy=fsdp", "train.strategy_options={shard: 2}"])
    with pytest.raises(ConfigError, match="'shard' is not an option of fsdp; options: resh"):
        check_config(bad)
    wrong = load_config(
        overrides=[*RAY, "train.strategy=fsdp", "train.strategy_options={param_dtype: bf17}"]
    )
    with pytest.raises(ConfigError, match="param_dtype='bf17' is not a torch dtype"):
        check_config(wrong)
    good = load_config(
        overrides=[*RAY, "train.strategy=fsdp", "train.strategy_options={param_dtype: bfloat16}"]
    )
    check_config(good)
    assert load_config(overrides=["deploy.weight_transport=ipc"]).deploy.weight_transport == "ipc"


GPU0, GPU1 = "GPU-aaaa", "GPU-bbbb"


def _gpu(node: str, device: str, gpu: str | None, *gpus: str) -> Where:
    return Where(node, device, gpu, tuple(gpus))


@pytest.mark.parametrize(
    ("trainer", "generators", "want"),
    [
        # one node, all on CPU: one shared file per version
        (Where("n1"), [Where("n1"), Where("n1")], ("shm", {})),
        # one node, generators see the trainer's GPU: IPC handles
        (
            _gpu("n1", "cuda:0", GPU0, GPU0),
            [_gpu("n1", "cuda:0", GPU0, GPU0, GPU1), _gpu("n1", "cuda:1", GPU1, GPU0, GPU1)],
            ("ipc", {}),
        ),
        # one node, a generator that does not see the trainer's GPU (Ray's one GPU per actor)
        (_gpu("n1", "cuda:0", GPU0, GPU0), [_gpu("n1", "cuda:0", GPU1, GPU1)], ("shm", {})),
        # one node, a generator on the CPU
        (_gpu("n1", "cuda:0", GPU0, GPU0), [Where("n1", "cpu", None, (GPU0,))], ("shm", {})),
        # several nodes, GPUs at both ends: NCCL (no host copy at the sender)
        (
            _gpu("n1", "cuda:0", GPU0, GPU0),
            [_gpu("n2", "cuda:0", GPU1, GPU1)],
            ("broadcast", {"backend": "nccl", "keep_newest": False}),
        ),
        # several nodes, a CPU end: gloo, the sender keeps the newest for newcomers
        (
            Where("n1"),
            [_gpu("n2", "cuda:0", GPU1, GPU1)],
            ("broadcast", {"backend": "gloo", "keep_newest": True}),
        ),
    ],
)
def test_auto_picks_by_node_and_device(
    trainer: Where, generators: list[Where], want: tuple[str, dict[str, object]]
) -> None:
    assert choose_transport("auto", trainer, generators) == want
    name, options = want
    if name == "broadcast":  # the options build a valid transport (nccl refuses keep_newest)
        make_transport(name, address="tcp://127.0.0.1:1", **options)


def test_a_named_transport_is_used_as_named() -> None:
    cpu = [Where("n1")]
    assert choose_transport("shm", Where("n1"), cpu) == ("shm", {})
    assert choose_transport("ipc", Where("n1"), cpu) == ("ipc", {})
    gpu = _gpu("n1", "cuda:0", GPU0, GPU0)
    assert choose_transport("broadcast", gpu, [gpu]) == (
        "broadcast",
        {"backend": "nccl", "keep_newest": False},
    )
