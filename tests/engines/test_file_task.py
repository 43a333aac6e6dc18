"""The file task: every source gives the same rows, epochs are permutations, errors say the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from engines.file_task import FileTask, read_columns
from engines.hf.text import encode_prompts
from engines.rewards import MathAnswerReward
from engines.tasks import make_task, task_columns
from engines.tiny import TinyConfig, WarmStartConfig, build_model, build_tokenizer, warm_start

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
ROWS = [{"q": f"{a} + {a + 1} =", "a": 2 * a + 1, "tag": f"t{a}"} for a in range(12)]


def _write(tmp_path: Path, fmt: str, rows: list[dict[str, Any]] = ROWS) -> Path:
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        pcsv.write_csv(pa.Table.from_pylist(rows), path)
    return path


def _task(path: Path, seed: int = 0, **options: Any) -> FileTask:
    task = make_task("file", seed=seed, path=str(path), prompt_key="q", answer_key="a", **options)
    assert isinstance(task, FileTask)
    return task


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_every_format_gives_the_rows_in_the_same_order(tmp_path: Path, fmt: str) -> None:
    task = _task(_write(tmp_path, fmt), seed=5, extra_keys=["tag"])
    reference = _task(_write(tmp_path, "jsonl"), seed=5, extra_keys=["tag"])
    assert task.num_rows == len(ROWS) and task.num_items() is None
    for i in range(3 * len(ROWS)):
        got, want = task.item(i), reference.item(i)
        assert got.prompt == want.prompt and got.extra == want.extra == {"tag": got.extra["tag"]}
        # CSV has no types: its answers stay text, which the answer rewards parse
        assert got.answer == (str(want.answer) if fmt == "csv" else want.answer)
        assert MathAnswerReward()([got.prompt], [want.reference], answer=[got.answer]) == [1.0]
        assert msgpack.unpackb(msgpack.packb(got.row())) == got.row()  # TQ object columns
    assert task.columns() == ("answer", "tag")


def test_each_epoch_is_a_fresh_permutation_fixed_by_the_seed(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    n = len(ROWS)
    task = _task(path, seed=1)
    epochs = [[task.row_index(e * n + i) for i in range(n)] for e in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # every row exactly once per epoch
    assert len({tuple(o) for o in epochs}) == 4  # each epoch its own order
    again = _task(path, seed=1)
    assert [again.item(i) for i in range(2 * n)] == [task.item(i) for i in range(2 * n)]
    assert again.item(n + 3) == task.item(n + 3)  # addressable by index, in any order
    other = _task(path, seed=2)
    assert [other.row_index(i) for i in range(n)] != epochs[0]
    plain = _task(path, shuffle=False)
    assert [plain.item(i).prompt for i in range(n + 2)] == [r["q"] for r in ROWS + ROWS[:2]]


def test_epochs_and_max_rows_bound_the_stream(tmp_path: Path) -> None:
    task = _task(_write(tmp_path, "jsonl"), epochs=2, max_rows=5)
    assert task.num_rows == 5 and task.num_items() == 10
    assert {task.item(i).prompt for i in range(10)} == {r["q"] for r in ROWS[:5]}
    with pytest.raises(IndexError, match=r"item 10 is past the 2 epoch\(s\) of 5 rows"):
        task.item(10)


def test_chat_messages_system_prompt_and_template(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    chat = [{"role": "user", "content": "2 + 2 ="}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": chat, "answer": "4"}) + "\n")
    task = make_task("file", path=str(path), prompt_key="messages", system_prompt="Be brief.")
    prompt = task.item(0).prompt
    assert prompt == [{"role": "system", "content": "Be brief."}, *chat]
    # The chat template is applied once, where prompts are encoded (as the feeder does).
    [ids] = encode_prompts(tiny_tokenizer, [prompt])
    text = tiny_tokenizer.decode(ids)
    assert text.count("<|system|>") == 1 and text.count("<|user|>") == 1
    assert text.endswith("<|assistant|>\n")
    templated = _task(_write(tmp_path, "jsonl"), shuffle=False, prompt_template="Q: {prompt}")
    assert templated.item(0).prompt == "Q: 0 + 1 ="
    [plain] = encode_prompts(tiny_tokenizer, [templated.item(0).prompt])
    assert tiny_tokenizer.decode(plain).startswith(tiny_tokenizer.bos_token + "<|user|>\nQ: 0 + 1")
    with pytest.raises(ValueError, match="prompt_template applies to text prompts only"):
        make_task("file", path=str(path), prompt_key="messages", prompt_template="{prompt}!")


def test_errors_name_the_source_and_the_fix(tmp_path: Path) -> None:
    path = _write(tmp_path, "jsonl")
    with pytest.raises(
        ValueError,
        match=r"has no column 'question' \(prompt_key\), 'answer' \(answer_key\); its columns "
        r"are \['q', 'a', 'tag'\]: name them with prompt_key",
    ):
        make_task("file", path=str(path), prompt_key="question")
    with pytest.raises(ValueError, match=r"has no column 'nope' \(extra_keys\); its columns"):
        _task(_write(tmp_path, "parquet"), extra_keys=["nope"])
    with pytest.raises(ValueError, match=r"has no column 'answer' \(answer_key\); its columns"):
        make_task("file", path=str(_write(tmp_path, "csv")), prompt_key="q")
    with pytest.raises(ValueError, match="does not exist"):
        make_task("file", path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": "1 =", "a": 1}\n{"q": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl line 2 is not valid JSON"):
        _task(bad)
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    with pytest.raises(ValueError, match=r"cannot tell the format.*set format"):
        make_task("file", path=str(odd))
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['prompt_column'\] of task 'file'"):
        make_task("file", path=str(path), prompt_column="q")
    with pytest.raises(ValueError, match=r"extra_keys \['answer'\] clash"):
        make_task("file", path=str(path), extra_keys=["answer"])
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        _task(path, epochs=0)


def test_warm_start_reads_a_finite_task_round_and_round(tmp_path: Path) -> None:
    task = _task(_write(tmp_path, "jsonl"), epochs=1)
    tokenizer = build_tokenizer()
    model = build_model(TinyConfig(), tokenizer)
    stats = warm_start(model, tokenizer, task, WarmStartConfig(steps=2, batch_size=4))
    assert stats["last_loss"] < stats["first_loss"] + 1.0  # ran on the rows, far past item 12
    assert torch.isfinite(torch.tensor(stats["last_loss"]))


def test_shipped_data_is_a_held_out_split_with_true_answers() -> None:
    train = [json.loads(x) for x in (DATA / "arithmetic_train.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (DATA / "arithmetic_val.jsonl").read_text().splitlines()]
    assert len(train) == 80 and len(val) == 20
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    for r in train + val:
        a, b = r["question"].removesuffix(" =").split(" + ")
        assert int(a) + int(b) == r["answer"]
    task = make_task("file", path=str(DATA / "arithmetic_val.jsonl"), prompt_key="question")
    assert task.num_items() is None and task.item(0).row().keys() == {"prompt", "answer"}


def test_hf_datasets_folders(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(ROWS),
            "test": datasets.Dataset.from_list(ROWS[:3]),
        }
    ).save_to_disk(str(saved))
    expect = _task(_write(tmp_path, "jsonl"), seed=3)
    task = _task(saved, seed=3)  # load_from_disk; the train split by default
    assert [task.item(i) for i in range(12)] == [expect.item(i) for i in range(12)]
    assert _task(saved, split="test").num_rows == 3
    with pytest.raises(ValueError, match=r"no split 'dev'; its splits are \['train', 'test'\]"):
        _task(saved, split="dev")
    files = tmp_path / "files"  # a folder of data files: load_dataset(path)
    files.mkdir()
    _write(files, "jsonl")
    columns = read_columns(files, ["q", "a"])
    assert columns["q"] == [r["q"] for r in ROWS] and columns["a"] == [r["a"] for r in ROWS]


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "file"])
def test_columns_known_from_the_config_are_those_of_the_rows(tmp_path: Path, name: str) -> None:
    options: dict[str, Any] = {}
    if name == "file":
        path = _write(tmp_path, "jsonl")
        options = {"path": str(path), "prompt_key": "q", "answer_key": "a", "extra_keys": ["tag"]}
    task = make_task(name, **options)
    row_columns = tuple(k for k in task.item(0).row() if k != "prompt")
    assert task_columns(name, **options) == task.columns() == row_columns
