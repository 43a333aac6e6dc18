"""The key-value calls, in every deployment.

Rows put by key must read back bit for bit in the keys' order; a put to a known key updates
that row's fields in place (same row, other fields kept); list names every key with the
fields its row has; a delete frees the rows on the units, all or nothing, and never a row a
task holds leased. Keyed rows are ordinary rows: a task consumes each exactly once through
get_meta/ack, whatever KV puts and deletes happen alongside. Unknown keys and bad keys are
typed errors that name them and the fix, across the wire, after which the server serves on.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
import torch

from tests.transferqueue.conftest import Deploy
from transferqueue import (
    CapacityError,
    Client,
    FieldSpec,
    FinishedError,
    KeyLeasedError,
    Ragged,
    TQError,
    TransferQueue,
    UnknownFieldError,
    UnknownKeyError,
)
from transferqueue.controller.core import Controller
from transferqueue.errors import BadRequestError, SchemaError
from transferqueue.limits import MAX_KEY_CHARS, MAX_KEYS

HOLD_S = 30.0
"""A lease the test relies on still holding while it acts on its rows."""
WAIT_S = 60.0
"""Bound of a wait that ends on an event, long before this."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: Any, b: Any) -> bool:
    """Bit-identical tensors / Ragged (dtype and shape too), or equal plain values."""
    if isinstance(a, Ragged):
        return (
            isinstance(b, Ragged)
            and torch.equal(a.offsets, b.offsets)
            and _same(a.values, b.values)
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_bits(a), _bits(b))
        )
    return bool(a == b) and type(a) is type(b)


def _columns() -> dict[str, Any]:
    """Five rows of every kind, awkward values included (NaN, -0, inf in bf16; empty ragged
    rows; unicode and nested objects)."""
    gen = torch.Generator().manual_seed(7)
    bf = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    bf.view(-1)[:3] = torch.tensor([math.nan, -0.0, math.inf], dtype=torch.bfloat16)
    lens = [3, 0, 1, 0, 4]
    return {
        "emb": bf,  # dense bf16 [5, 3]
        "mat": torch.randint(-(2**31), 2**31 - 1, (5, 2, 2), generator=gen, dtype=torch.int64),
        "ids": [torch.randint(0, 50_000, (n,), generator=gen) for n in lens],  # ragged
        "pairs": Ragged.from_lengths(torch.randn(8, 2, generator=gen).half(), torch.tensor(lens)),
        "meta": ["ü∂", {"a": [1, None, 2.5]}, None, "", {"nested": {"x": "y"}}],
    }


def _rows(cols: dict[str, Any], pos: list[int]) -> dict[str, Any]:
    """Rows ``pos`` of ``_columns()`` as the canonical columns a read returns."""
    out: dict[str, Any] = {}
    for name, col in cols.items():
        if isinstance(col, torch.Tensor):
            out[name] = col[pos]
        elif isinstance(col, Ragged):
            out[name] = col.take(np.asarray(pos))
        elif name == "ids":
            out[name] = Ragged.from_tensors([col[i] for i in pos])
        else:
            out[name] = [col[i] for i in pos]
    return out


KEYS = ["prompt/0", "prompt/1", "ключ-2", "k 3", "k" * MAX_KEY_CHARS]


# -- round trips ---------------------------------------------------------------------------------
def test_batch_put_then_get_is_bit_exact_in_the_keys_order(client: Client) -> None:
    cols = _columns()
    meta = client.kv_batch_put(KEYS, cols, partition="kv")
    assert len(meta) == 5 and meta.fields == tuple(cols)
    for order in ([4, 0, 2], [1], [3, 2, 1, 0, 4]):
        got = client.kv_batch_get([KEYS[i] for i in order], partition="kv")
        want = _rows(cols, order)
        assert set(got) == set(want)  # (no fields asked: every field all rows have)
        for name in want:
            assert _same(got[name], want[name]), (name, order)
    only = client.kv_batch_get([KEYS[2]], ["ids"], partition="kv")
    assert list(only) == ["ids"] and _same(only["ids"], _rows(cols, [2])["ids"])


def test_single_key_forms_take_and_give_one_rows_values(client: Client) -> None:
    x = torch.tensor([1.5, math.nan, -0.0], dtype=torch.float64)
    client.kv_put("a", {"x": x, "obj": {"k": "ü"}})  # a tensor: a row of a dense field
    client.kv_put(
        "b",
        {"x": torch.zeros(3, dtype=torch.float64), "tok": torch.arange(4), "obj": "s"},
        specs={"tok": FieldSpec.ragged("int64")},  # a 1-D tensor: a row of a ragged field
    )
    client.kv_put("c", {"tok": torch.arange(0), "x": x})  # (tok known ragged now: empty row)
    a = client.kv_get("a")
    assert set(a) == {"x", "obj"} and _same(a["x"], x) and a["obj"] == {"k": "ü"}
    b = client.kv_get("b", ["tok", "obj"])
    assert _same(b["tok"], torch.arange(4)) and b["obj"] == "s"
    c = client.kv_get("c", ["tok"])
    assert _same(c["tok"], torch.arange(0))
    with pytest.raises(SchemaError, match="one row"):
        client.kv_put("d", {"tok": Ragged.from_tensors([torch.arange(2)] * 2)})


def test_async_forms_round_trip_and_delete(tq: TransferQueue) -> None:
    async def main() -> tuple[dict[str, Any], list[str]]:
        ac = tq.async_client()
        await ac.kv_batch_put(["x", "y"], {"v": torch.arange(4).view(2, 2)})
        await ac.kv_put("z", {"v": torch.tensor([7, 8])})
        got = await ac.kv_batch_get(["z", "x"], ["v"])
        await ac.kv_delete(["x"])
        listing = await ac.kv_list()
        return got, listing.keys

    got, keys = asyncio.run(main())
    assert _same(got["v"], torch.tensor([[7, 8], [0, 1]]))
    assert keys == ["y", "z"]


# -- overwrite -----------------------------------------------------------------------------------
def test_a_put_to_a_known_key_updates_its_fields_in_place(client: Client) -> None:
    first = client.kv_batch_put(
        ["a", "b"],
        {"x": torch.tensor([1.0, 2.0]), "ids": [torch.arange(3), torch.arange(1)], "o": [1, 2]},
        group=[10, 11],
        version=0,
    )
    # a: x and ids overwritten (ids with another length), y new, o kept; c: a new key
    again = client.kv_batch_put(
        ["c", "a"],
        {"x": torch.tensor([3.0, 4.0]), "ids": [torch.arange(2), torch.arange(5)], "y": ["c", "a"]},
        group=[12, 99],
        version=[1, 1],
    )
    assert again.indexes[1] == first.indexes[0]  # the same row
    assert again.groups.tolist() == [12, 10]  # (a group is set when a key's row is created)
    assert again.versions.tolist() == [1, 1]
    got = client.kv_batch_get(["a", "b"], ["x", "ids", "o"])
    assert _same(got["x"], torch.tensor([4.0, 2.0]))
    assert _same(got["ids"], Ragged.from_tensors([torch.arange(5), torch.arange(1)]))
    assert got["o"] == [1, 2]
    assert client.kv_get("a", ["y"]) == {"y": "a"}
    with pytest.raises(UnknownFieldError, match=r"keys \['b'\].*no field 'y'"):
        client.kv_batch_get(["a", "b"], ["y"])
    assert set(client.kv_batch_get(["a", "b"])) == {"x", "ids", "o"}  # (fields both have)
    part = client.stats()["controller"]["partitions"]["default"]
    assert part["rows_put"] == 3 and part["rows_live"] == 3 and part["keys"] == 3


def test_list_names_every_key_in_row_order_with_its_fields(client: Client) -> None:
    assert client.kv_list("nothing-yet").keys == []
    client.kv_batch_put(["b", "a"], {"x": torch.zeros(2)}, partition="p")
    client.kv_put("c", {"y": "only y"}, partition="p")
    client.put({"x": torch.zeros(3)}, partition="p")  # rows without keys are not listed
    listing = client.kv_list("p")
    assert listing.keys == ["b", "a", "c"] and listing.ready == {}
    assert listing.indexes.tolist() == sorted(listing.indexes.tolist())
    full = client.kv_list("p", fields="all")
    assert full.ready["x"].tolist() == [True, True, False]
    assert full.fields_of("c") == ["y"] and full.fields_of("a") == ["x"]
    some = client.kv_list("p", fields=["y"])
    assert list(some.ready) == ["y"] and some.ready["y"].tolist() == [False, False, True]
    with pytest.raises(BadRequestError, match="'nope' was never written"):
        client.kv_list("p", fields=["nope"])
    with pytest.raises(BadRequestError, match='"all"'):
        client.kv_list("p", fields="x")


# -- delete --------------------------------------------------------------------------------------
def _unit_rows(client: Client) -> int:
    """Rows the units hold, counted once per row (each row has ``replicas`` copies)."""
    stats = client.stats()
    copies = sum(u["rows"] for u in stats["units"])
    return copies // int(stats["controller"].get("replicas", 1))


def test_delete_frees_the_rows_on_the_units_and_clear_every_key(client: Client) -> None:
    keys = [f"k{i}" for i in range(6)]
    client.kv_batch_put(
        keys, {"x": torch.randn(6, 256), "ids": [torch.arange(i) for i in range(6)]}
    )
    plain = client.put({"x": torch.zeros(2, 256)})  # rows without keys
    assert _unit_rows(client) == 8
    client.kv_delete(["k1", "k4"])
    ctl = client.stats()["controller"]
    assert ctl["rows_live"] == 6 and ctl["partitions"]["default"]["keys"] == 4
    assert _unit_rows(client) == 6  # freed on the units before kv_delete returned
    with pytest.raises(UnknownKeyError, match=r"\['k1'\]"):
        client.kv_get("k1")
    assert client.kv_list().keys == ["k0", "k2", "k3", "k5"]
    again = client.kv_put("k1", {"x": torch.ones(256)})  # a deleted key may be put again
    assert again.indexes[0] > plain.indexes[-1]  # (on a new row)
    client.kv_clear()
    assert client.kv_list().keys == [] and _unit_rows(client) == 2
    assert client.stats()["controller"]["rows_live"] == 2  # the plain rows stay
    assert _same(client.get_data(plain)["x"], torch.zeros(2, 256))
    client.kv_clear()  # (nothing left: a no-op)


def test_a_delete_with_an_unknown_key_deletes_nothing(client: Client) -> None:
    client.kv_batch_put(["a", "b"], {"x": torch.arange(2)})
    with pytest.raises(UnknownKeyError, match=r"keys \['zz'\] \(1 of 2\)"):
        client.kv_delete(["a", "zz"])
    assert client.kv_list().keys == ["a", "b"]


def test_delete_refuses_rows_a_task_holds_leased_and_deletes_them_once_released(
    client: Client,
) -> None:
    keys = ["k0", "k1", "k2", "k3"]
    client.kv_batch_put(keys, {"x": torch.arange(4)})
    leased = client.get_meta("t", ["x"], 2, timeout_s=WAIT_S, lease_s=HOLD_S)  # k0, k1
    assert leased.reason == "full"
    with pytest.raises(KeyLeasedError, match=r"keys \['k1'\].*task 't'.*nothing was deleted"):
        client.kv_delete(["k2", "k1"])
    assert client.kv_list().keys == keys  # all or nothing
    assert _same(client.get_data(leased)["x"], torch.tensor([0, 1]))  # the lease reads on
    client.release(leased)
    client.kv_delete(["k1", "k2"])  # k1 was queued again, k2 queued: both leave the queue
    client.finish()
    got: list[int] = []
    while True:
        meta = client.get_meta("t", ["x"], 4, timeout_s=WAIT_S)
        got += client.get_data(meta)["x"].tolist() if len(meta) else []
        if len(meta):
            client.ack(meta)
        if meta.is_end:
            break
    assert sorted(got) == [0, 3]  # the deleted rows never reach the task
    task = client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
    assert task["done"] == 2 and task["waiting"] == 0 and task["queued"] == 0


# -- the queue interface on keyed rows -----------------------------------------------------------
def test_keyed_rows_reach_a_task_exactly_once_alongside_kv_writes(client: Client) -> None:
    keys = [f"s{i}" for i in range(10)]
    client.kv_batch_put(keys, {"x": torch.arange(10)}, partition="q")
    seen: list[int] = []
    first = client.get_meta("t", ["x"], 4, partition="q", timeout_s=WAIT_S, lease_s=HOLD_S)
    seen += client.get_data(first)["x"].tolist()
    client.ack(first)
    # overwrite a consumed key and a queued one; a delivered row is never handed out again
    client.kv_batch_put([keys[0], keys[9]], {"x": torch.tensor([100, 109])}, partition="q")
    # a field another task waits for, put by key: that task gets exactly those rows
    client.kv_batch_put(keys[:3], {"y": ["a", "b", "c"]}, partition="q")
    client.finish("q")
    with pytest.raises(FinishedError):
        client.kv_put("new", {"x": torch.tensor(1)}, partition="q")
    client.kv_put(keys[5], {"x": torch.tensor(105)}, partition="q")  # (updates still go)
    while True:
        meta = client.get_meta("t", ["x"], 3, partition="q", timeout_s=WAIT_S)
        if len(meta):
            seen += client.get_data(meta)["x"].tolist()
            client.ack(meta)
        if meta.is_end:
            break
    assert sorted(seen) == [0, 1, 2, 3, 4, 6, 7, 8, 105, 109]  # each row once, latest value
    other = client.get_meta("u", ["y"], 10, partition="q", timeout_s=0)  # (the rest lack y)
    assert len(other) == 3
    assert client.get_data(other)["y"] == ["a", "b", "c"]


def test_a_key_leaves_with_its_row_once_every_declared_task_acked(client: Client) -> None:
    client.declare_tasks(["t"], partition="d")
    client.kv_batch_put(["a", "b"], {"x": torch.arange(2)}, partition="d")
    meta = client.get_meta("t", ["x"], 1, partition="d", timeout_s=WAIT_S)
    client.ack(meta)  # a's row is freed: its key goes with it
    assert client.kv_list("d").keys == ["b"]
    with pytest.raises(UnknownKeyError, match="every declared task acknowledged"):
        client.kv_get("a", partition="d")


# -- errors --------------------------------------------------------------------------------------
def test_unknown_keys_are_typed_errors_naming_them_and_the_fix(client: Client) -> None:
    client.kv_put("here", {"x": torch.tensor(1)})
    with pytest.raises(UnknownKeyError) as info:
        client.kv_batch_get(["here", "gone-1", "gone-2"])
    err = info.value
    assert isinstance(err, TQError) and isinstance(err, KeyError)  # (rebuilt across the wire)
    text = str(err)
    assert "['gone-1', 'gone-2'] (2 of 3)" in text and "'default'" in text and "kv_put" in text
    with pytest.raises(UnknownKeyError, match="'other'"):
        client.kv_get("here", partition="other")
    with pytest.raises(UnknownKeyError):
        client.kv_meta(["gone"])
    assert _same(client.kv_get("here")["x"], torch.tensor(1))  # the server serves on


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ([], r"1\.\.65536 keys"),
        (["a", 7], r"keys\[1\]: a key is a non-empty str.*got int"),
        (["a", ""], r"keys\[1\].*got 0 characters"),
        (["k" * (MAX_KEY_CHARS + 1)], rf"at most {MAX_KEY_CHARS} characters \(MAX_KEY_CHARS\)"),
        (["a", "b", "a"], r"keys \['a'\] appear more than once"),
        ("abc", "got the str"),
        ([f"{i}" for i in range(MAX_KEYS + 1)], "MAX_KEYS"),
    ],
    ids=["empty", "int", "empty-str", "too-long", "repeated", "a-str", "too-many"],
)
def test_bad_keys_are_clear_errors(client: Client, keys: Any, error: str) -> None:
    n = len(keys) if isinstance(keys, list) else 1
    with pytest.raises(BadRequestError, match=error):
        client.kv_batch_put(keys, {"x": torch.zeros(n)})
    with pytest.raises(BadRequestError, match=error):
        client.kv_batch_get(keys)
    with pytest.raises(BadRequestError, match=error):
        client.kv_delete(keys)
    assert client.stats()["controller"]["rows_live"] == 0  # nothing was stored


def test_rows_and_keys_must_match(client: Client) -> None:
    with pytest.raises(SchemaError, match="2 keys but the columns have 3 rows"):
        client.kv_batch_put(["a", "b"], {"x": torch.zeros(3)})
    with pytest.raises(BadRequestError, match="key: expected a str, got int"):
        client.kv_put(5, {"x": torch.zeros(1)})  # type: ignore[arg-type]
    assert client.kv_list().keys == []


def test_new_keys_wait_for_capacity_and_updates_need_none(deploy: Deploy) -> None:
    with deploy(capacity_rows=2) as tq:
        client = tq.client()
        client.kv_batch_put(["a", "b"], {"x": torch.arange(2)})
        with pytest.raises(CapacityError, match="capacity_rows=2"):
            client.kv_put("c", {"x": torch.tensor(2)}, timeout_s=0.2)
        assert client.kv_list().keys == ["a", "b"]  # (nothing half-made)
        client.kv_batch_put(["b", "a"], {"x": torch.tensor([5, 4])}, timeout_s=0.2)
        client.kv_delete(["a"])
        client.kv_put("c", {"x": torch.tensor(2)}, timeout_s=WAIT_S)
        assert _same(client.kv_batch_get(["b", "c"])["x"], torch.tensor([5, 2]))


# -- export / restore of the key map (checkpoints) -----------------------------------------------
def test_the_key_map_exports_as_plain_data_and_restores_onto_rows() -> None:
    ctl = Controller(2)
    ctl.keys.key_rows("p", ["a", "b"], create=True)
    ctl.writes.allocate(1, "p")  # a row without a key
    ctl.keys.key_rows("q", ["c"], create=True)
    saved = ctl.keys.export_keys()
    assert saved["p"]["keys"] == ["a", "b"] and saved["p"]["indexes"].tolist() == [0, 1]
    assert saved["q"]["keys"] == ["c"] and saved["q"]["indexes"].dtype == np.int64
    assert list(ctl.keys.export_keys("q")) == ["q"]
    fresh = Controller(2)
    rows = fresh.writes.allocate(2, "p").indexes[::-1].copy()  # restored rows: other indexes
    fresh.keys.restore_keys("p", saved["p"]["keys"], rows)
    assert fresh.keys.key_rows("p", ["b", "a"]).meta.indexes.tolist() == [0, 1]
    with pytest.raises(BadRequestError, match=r"keys \['a'\] already have a row"):
        fresh.keys.restore_keys("p", ["a"], rows[:1])
    with pytest.raises(BadRequestError, match="rows already have a key"):
        fresh.keys.restore_keys("p", ["new"], rows[:1])
    with pytest.raises(BadRequestError, match="not all distinct"):
        fresh.keys.restore_keys("p", ["x", "x"], rows)
    with pytest.raises(BadRequestError, match="not all in partition 'q'"):
        fresh.keys.restore_keys("q", ["z"], rows[:1])
