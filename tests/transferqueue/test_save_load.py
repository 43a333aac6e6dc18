"""Store checkpoints: save -> a new store -> load serves the same reads and consumption state,
over every deployment; typed errors; the CLI round trip; a save while consumers free rows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tq_helpers import Deploy

import transferqueue
from transferqueue import BatchMeta, CheckpointError, Client, PartitionExistsError, Ragged
from transferqueue.controller.core import Controller
from transferqueue.controller.handlers import QueueHandlers, RowHandlers, SnapshotHandlers
from transferqueue.controller.service import ControllerService
from transferqueue.deploy.cli import main
from transferqueue.errors import BadRequestError
from transferqueue.wire import messages as m
from transferqueue.wire.protocol import TRUSTED

N = 24


def _fill(c: Client) -> None:
    """A partition with every kind of column, headers, custom metadata, a field written later
    to half the rows, and a second partition with declared tasks."""
    ids = torch.arange(N, dtype=torch.int64)
    c.put(
        {
            "id": ids,
            "x": torch.randn(N, 3, 2),
            "flag": ids % 3 == 0,
            "half": torch.randn(N, 4).to(torch.bfloat16),
            "tokens": Ragged.from_tensors([torch.arange(i % 5) for i in range(N)]),  # empty rows
            "vecs": Ragged.from_tensors([torch.randn(i % 3, 2) for i in range(N)]),
            "obj": [{"i": i, "s": "ü→" * (i % 4), "b": b"\x00\xff", "n": None} for i in range(N)],
        },
        partition="train",
        group=np.arange(N) // 4,
        version=np.arange(N) % 3,
        length=np.arange(N) * 7,
    )
    c.set_custom_meta(np.array([2, 5]), [{"source": "gsm8k"}, {"tags": [1, "two"]}])
    meta = c.get_meta("reward", ["id"], batch_size=N // 2, partition="train")
    c.put({"score": torch.arange(len(meta), dtype=torch.float32)}, meta=meta)  # acks it
    c.put({"p": torch.arange(6)}, partition="val")
    c.declare_tasks(["a", "b"], partition="val")
    c.ack(c.get_meta("a", ["p"], batch_size=3, partition="val"))
    c.finish("val")


def _all(c: Client, task: str, fields: list[str], partition: str = "train") -> tuple[Any, Any]:
    meta = c.get_meta(task, fields, batch_size=1000, partition=partition, timeout_s=0)
    return meta, c.get_data(meta) if len(meta) else {}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # bit-exact
        elif isinstance(x, Ragged):
            assert torch.equal(x.offsets, y.offsets), name
            assert x.values.dtype == y.values.dtype and torch.equal(x.values, y.values), name
        else:
            assert x == y, name


def test_save_new_store_load_serves_same_reads_and_consumption(
    deploy: Deploy, tmp_path: Path
) -> None:
    src = deploy()
    c = src.client()
    _fill(c)
    # "half": consumed the first half; "leasing": holds rows 0..3 leased (not acknowledged)
    took = c.get_meta("half", ["id"], batch_size=N // 2, partition="train")
    c.ack(took)
    leased = c.get_meta("leasing", ["id"], batch_size=4, partition="train", lease_s=600)
    assert c.save(tmp_path / "ck", batch_rows=10) == {"train": N, "val": 6}  # 3 row batches

    dst = deploy(capacity_rows=1 << 16)  # a new, empty store of the same deployment
    d = dst.client()
    assert d.load(tmp_path / "ck") == {"train": N, "val": 6}

    fields = ["id", "x", "flag", "half", "tokens", "vecs", "obj"]
    m_src, got_src = _all(c, "reader", fields)
    m_dst, got_dst = _all(d, "reader", fields)
    _same(got_src, got_dst)  # a task that never read sees every row, bit-exact, same order
    for h in ("groups", "versions", "lengths"):
        assert np.array_equal(getattr(m_src, h), getattr(m_dst, h)), h
    assert d.get_custom_meta(m_dst) == c.get_custom_meta(m_src)
    row2 = got_dst["id"].tolist().index(2)
    assert d.get_custom_meta(m_dst)[row2] == {"source": "gsm8k"}

    # "half" sees exactly the other half, once, in the order the source hands it out
    m_half, got_half = _all(d, "half", ["id"])
    rest = _all(c, "half", ["id"])[1]["id"].tolist()
    assert got_half["id"].tolist() == rest
    assert sorted(rest + c.get_data(took)["id"].tolist()) == list(range(N))
    d.ack(m_half)
    assert len(_all(d, "half", ["id"])[0]) == 0
    # leased rows count as not consumed and come first, as after their lease's expiry
    c.release(leased)
    want = _all(c, "leasing", ["id"])[1]["id"].tolist()
    got = _all(d, "leasing", ["id"])[1]["id"].tolist()
    assert got == want and set(got[:4]) == set(c.get_data(leased)["id"].tolist())
    # a field written to half the rows: only those rows are ready for it
    m_score, got_score = _all(d, "scores", ["score"])
    assert len(m_score) == N // 2
    assert got_score["score"].tolist() == list(range(N // 2))
    # declared tasks and the finished flag: "a" consumed 3 of 6 ("b" none: nothing freed)
    m_a, _ = _all(d, "a", ["p"], "val")
    assert m_a.is_end and d.get_data(m_a)["p"].tolist() == [3, 4, 5]
    b_src, b_dst = c.status("val", task="b"), d.status("val", task="b")
    assert b_dst.state_names() == b_src.state_names() == ["waiting"] * 6  # (not started)
    assert len(_all(d, "b", ["p"], "val")[0]) == 6


def test_string_keys_survive_save_and_load(deploy: Deploy, tmp_path: Path) -> None:
    """Keyed rows (the key-value calls) come back under their keys, bit-exact, beside rows
    without keys, with the consumption state of a task; a save without keys lists no
    feature (older loaders read it), one with keys lists ``keys``."""
    src = deploy()
    c = src.client()
    keys = [f"prompt-{i:03d}" for i in range(12)]
    vals = torch.randn(12, 5)
    toks = [torch.arange(i % 4 + 1) for i in range(12)]
    head, tail = Ragged.from_tensors(toks[:8]), Ragged.from_tensors(toks[8:])
    c.kv_batch_put(keys[:8], {"v": vals[:8], "tok": head}, partition="kv")
    c.put({"v": vals[8:], "tok": tail}, partition="kv")  # rows without keys
    c.kv_batch_put(keys[8:], {"v": vals[8:], "tok": tail}, partition="kv")
    c.kv_delete(["prompt-003"], partition="kv")
    c.ack(c.get_meta("t", ["v"], batch_size=5, partition="kv"))  # "t" took 5 of the 15 rows
    c.save(tmp_path / "plain", partitions=[])  # (nothing saved: no feature)
    assert json.loads((tmp_path / "plain" / "manifest.json").read_text())["features"] == []
    c.save(tmp_path / "ck", batch_rows=4)  # keys spread over 4 row batches
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["features"] == ["keys"]

    d = deploy(capacity_rows=1 << 16).client()
    d.load(tmp_path / "ck")
    want = c.kv_list("kv")
    got = d.kv_list("kv")
    assert got.keys == want.keys and len(got.keys) == 11 and "prompt-003" not in got.keys
    _same(d.kv_batch_get(got.keys, partition="kv"), c.kv_batch_get(want.keys, partition="kv"))
    assert torch.equal(d.kv_get("prompt-011", partition="kv")["v"], vals[11])
    loaded, saved = (sorted(_all(x, "t", ["v"], "kv")[1]["v"][:, 0].tolist()) for x in (d, c))
    assert loaded == saved and len(loaded) == 10  # "t" goes on where it was


def test_partitions_with_their_own_specs_and_every_dtype_survive_save_and_load(
    tmp_path: Path,
) -> None:
    """Each partition's specs are saved with it (``x`` has another shape in each); dtypes
    without an Arrow type (fp8, complex, bfloat16) are saved as their bits."""
    from transferqueue.schema import DTYPES

    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 256, (6 * 3 * 16,), generator=gen, dtype=torch.uint8)
    cols: dict[str, torch.Tensor | list[torch.Tensor]] = {
        f"d_{n}": bits[: 6 * 3 * d.itemsize].view(d).reshape(6, 3) for n, d in DTYPES.items()
    }
    cols["d_bool"] = bits[:18].reshape(6, 3) > 127
    cols["r_fp8"] = [bits[:4].view(torch.float8_e4m3fn), bits[4:5].view(torch.float8_e4m3fn)] * 3
    cols["r_c128"] = [bits[:32].view(torch.complex128), bits[32:48].view(torch.complex128)] * 3
    with transferqueue.start(num_units=2, spread_bytes=0) as a, transferqueue.start() as b:
        c, d = a.client(), b.client()
        c.put({"x": torch.zeros(6, 2), **cols}, partition="p")
        c.put({"x": ["strings", "here"]}, partition="q")
        c.save(tmp_path / "ck")
        d.load(tmp_path / "ck")
        assert d.specs("p")["x"] == transferqueue.FieldSpec.dense("float32", (2,))
        assert d.specs("q")["x"] == transferqueue.FieldSpec.object()
        q, p = d.status("q", meta=True).meta, d.status("p", meta=True).meta
        assert q is not None and p is not None
        assert d.get_data(q, ["x"])["x"] == ["strings", "here"]
        got = d.get_data(p, list(cols))
        for name, want in cols.items():
            have = got[name]
            if isinstance(want, list):
                assert isinstance(have, Ragged) and have.dtype == want[0].dtype, name
                flat = torch.cat([w.view(torch.uint8) for w in want])
                assert torch.equal(have.values.view(torch.uint8).reshape(-1), flat), name
            else:
                assert isinstance(have, torch.Tensor) and have.dtype == want.dtype, name
                assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), name


def test_loading_a_partition_the_store_has_is_refused(deploy: Deploy, tmp_path: Path) -> None:
    tq = deploy()
    c = tq.client()
    c.put({"id": torch.arange(4)}, partition="train")
    c.save(tmp_path / "ck")
    with pytest.raises(PartitionExistsError, match=r"'train'.*new \(or reset\) store"):
        c.load(tmp_path / "ck")
    assert len(c.status("train")) == 4  # nothing of it was loaded


def test_save_while_consumers_free_rows_keeps_them_until_read(tmp_path: Path) -> None:
    """Rows acknowledged by every declared task after the snapshot are freed by the
    controller, but their payload stays on the units until the save has read it."""
    with transferqueue.start(num_units=2, spread_bytes=0) as tq:
        c = tq.client()
        c.declare_tasks(["t"])
        c.put({"id": torch.arange(64)})
        leased = c.get_meta("t", ["id"], batch_size=64)
        acks: list[asyncio.Future[None]] = []

        def progress(partition: str, done: int, total: int) -> None:
            if not acks:  # after the first batch: every row is freed by the controller
                acks.append(asyncio.ensure_future(tq.async_client().ack(leased)))

        c.save(tmp_path / "ck", batch_rows=8, progress=progress)
        assert acks and acks[0].done() and acks[0].exception() is None
        assert c.stats()["controller"]["rows_live"] == 0
        assert sum(u["rows"] for u in c.stats()["units"]) == 0  # freed once the save ended
    with transferqueue.start(num_units=1) as tq2:
        d = tq2.client()
        d.load(tmp_path / "ck")
        _, got = _all(d, "t", ["id"], "default")
        assert got["id"].tolist() == list(range(64))  # leased at save time: not consumed


def test_bad_save_directories_are_typed_errors(tmp_path: Path) -> None:
    with transferqueue.start(num_units=1) as tq:
        c = tq.client()
        c.put({"id": torch.arange(3)})
        with pytest.raises(CheckpointError, match="not a directory"):
            c.load(tmp_path / "missing")
        (tmp_path / "empty").mkdir()
        with pytest.raises(CheckpointError, match=r"no manifest\.json"):
            c.load(tmp_path / "empty")
        c.save(tmp_path / "ck")
        with pytest.raises(CheckpointError, match="not an empty directory"):
            c.save(tmp_path / "ck")
        manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
        manifest["version"] = 99
        (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=r"version 99.*reads versions 1\.\.1"):
            c.load(tmp_path / "ck")
        manifest["version"], manifest["features"] = 1, ["keys", "zstd-fields"]
        (tmp_path / "ck" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match="features \\['zstd-fields'\\]"):
            c.load(tmp_path / "ck")


def test_a_loading_partition_refuses_puts_and_consumers() -> None:
    """Between the first import_rows and import_tasks a partition is loading: a get_meta
    would create its tasks before their consumption state came."""
    svc = ControllerService(Controller(1), _no_free)
    snap, queues = SnapshotHandlers(svc), QueueHandlers(svc)
    ids = np.arange(3)
    rows = m.ImportRows(partition="p", groups=ids, versions=ids, lengths=ids)
    snap.import_rows(rows, TRUSTED)
    with pytest.raises(BadRequestError, match="'p' is being loaded"):
        queues.get_meta(m.GetMeta(task="t", partition="p", fields=["x"], batch_size=1), TRUSTED)
    with pytest.raises(BadRequestError, match="'p' is being loaded"):
        RowHandlers(svc).allocate(m.Allocate(n=1, partition="p"), TRUSTED)
    with pytest.raises(BadRequestError, match="'p' is being loaded"):
        snap.export_state(m.ExportState(partitions=["p"]), TRUSTED)
    with pytest.raises(PartitionExistsError, match="'p' already exists"):
        snap.import_rows(rows, TRUSTED)

    async def clear() -> None:  # (a load that failed half way: clear it)
        done = queues.clear(m.Clear(partition="p"), TRUSTED)
        if done is not None:
            await done

    asyncio.run(clear())
    assert svc.controller.status.status("p").indexes.size == 0
    assert len(RowHandlers(svc).allocate(m.Allocate(n=1, partition="p"), TRUSTED)) == 1  # type: ignore[arg-type]
    svc.controller.queues.clear("p")
    snap.import_rows(rows, TRUSTED)
    snap.import_tasks(m.ImportTasks(partition="p", tasks=[]), TRUSTED)
    assert len(RowHandlers(svc).allocate(m.Allocate(n=1, partition="p"), TRUSTED)) == 1  # type: ignore[arg-type]


async def _no_free(unit: int, indexes: np.ndarray) -> None:
    return None


def test_cli_save_and_load_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with (
        transferqueue.serve(num_units=2, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.put({"tokens": Ragged.from_tensors([torch.arange(i) for i in range(10)])})
        c.ack(c.get_meta("t", ["tokens"], batch_size=4))
        want = c.get_data(c.get_meta("u", ["tokens"], batch_size=10))
        assert main(["save", svc.address, str(tmp_path / "ck")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"saved": str(tmp_path / "ck"), "rows": {"default": 10}}
    assert "saving default: 10/10 rows" in err
    with transferqueue.serve(num_units=1) as svc2:
        assert main(["load", svc2.address, str(tmp_path / "ck")]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["rows"] == {"default": 10} and "loading default" in err
        assert main(["load", svc2.address, str(tmp_path / "ck")]) == 2  # exists: refused
        assert "already exists" in capsys.readouterr().err
        with transferqueue.connect(svc2.address) as tq:
            c = tq.client()
            _same(want, c.get_data(c.get_meta("u", ["tokens"], batch_size=10)))
            meta = c.get_meta("t", ["tokens"], batch_size=10, timeout_s=0)
            assert isinstance(meta, BatchMeta) and len(meta) == 6  # the 4 it consumed stay so


def _batches(client: Client, sampler: dict[str, Any]) -> list[list[int]]:
    """Every batch task "g" gets until its queue is empty (each acknowledged)."""
    out = []
    while True:
        meta = client.get_meta("g", ["s"], batch_size=8, timeout_s=0, **sampler)
        if not len(meta):
            return out
        out.append(client.get_data(meta, ["id"])["id"].tolist())
        client.ack(meta)


@pytest.mark.parametrize(
    "sampler",
    [
        {},
        {"sampler": "group", "group_size": 4},
        {"sampler": "group", "group_size": 4, "order": "length"},
        {"sampler": "balanced", "dp_size": 2, "group_size": 4},
    ],
    ids=["fifo", "group", "group-length", "balanced"],
)
def test_queues_reload_in_the_same_order(sampler: dict[str, Any], tmp_path: Path) -> None:
    """Complete groups, groups still short of rows and rows leased at save time come back:
    the loaded store hands out the batches the saved one hands out once the lease is given
    back (leased rows first), and the short groups complete when their rows come."""
    rng = np.random.default_rng(0)
    n = 40
    groups = rng.permutation(np.repeat(np.arange(n // 4), 4))
    versions, lengths = rng.integers(0, 3, n), rng.integers(0, 99, n)
    late = n - 3  # the last rows come after the save: their groups wait for them

    def put_late(client: Client) -> None:
        rows = slice(late, n)
        client.put(
            {"id": torch.arange(late, n), "s": torch.zeros(n - late)},
            group=groups[rows],
            version=versions[rows],
            length=lengths[rows],
        )

    with transferqueue.start(num_units=2, spread_bytes=0) as tq:
        c = tq.client()
        c.put(
            {"id": torch.arange(late)},
            group=groups[:late],
            version=versions[:late],
            length=lengths[:late],
        )
        # "s" lands in an order of its own (a stage finishing rows out of order): the order
        # rows reach task "g", which a load must keep, is not index order
        assert not len(c.get_meta("g", ["s"], batch_size=8, timeout_s=0, **sampler))
        w = c.get_meta("w", ["id"], batch_size=late)
        for chunk in np.array_split(rng.permutation(late), 6):
            c.put({"s": torch.zeros(chunk.size)}, meta=w.select(chunk))
        took = c.get_meta("g", ["s"], batch_size=8, **sampler)
        first = c.get_data(took, ["id"])["id"].tolist()
        c.ack(took)
        leased = c.get_meta("g", ["s"], batch_size=4, **sampler)
        c.save(tmp_path / "ck", batch_rows=7)  # (several row batches)
        c.release(leased)
        put_late(c)
        want = _batches(c, sampler)
    with transferqueue.start(num_units=1) as tq2:
        d = tq2.client()
        d.load(tmp_path / "ck")
        put_late(d)
        got = _batches(d, sampler)
    assert got == want
    assert sorted(first + [i for b in want for i in b]) == list(range(n))  # each row once
