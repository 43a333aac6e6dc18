"""Bit-exact round trips of every field kind through put / get_meta / get_data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import transferqueue
from transferqueue import Client, FieldSpec, Ragged
from transferqueue.schema import DTYPES


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


_CLASSIC = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16}
_CLASSIC |= {torch.bfloat16, torch.float32, torch.float64}


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype not in _CLASSIC:  # (wide uints, complex, fp8: random bits, NaN payloads and all)
        nbytes = math.prod(shape) * dtype.itemsize
        bits = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
        return bits.view(dtype).reshape(shape)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
        flat = t.view(-1)
        if flat.numel() >= 3:  # special values must survive bit for bit
            flat[0], flat[1], flat[2] = math.nan, -0.0, math.inf
        return t
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen
    ).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5)], ids=["scalar", "vec", "mat"])
def test_dense_round_trip_is_bit_exact(
    client: Client, dtype: torch.dtype, row_shape: tuple
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _random(dtype, (37, *row_shape), gen)
    meta = client.put({"x": x}, group=np.arange(37))
    assert len(meta) == 37 and set(meta.units.tolist()) == {0, 1}  # rows spread over both units
    got = client.get_data(meta, ["x"])["x"]
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(_bits(got), _bits(x))
    # the stored copy is independent of the producer's buffer
    x.zero_() if dtype != torch.bool else x.logical_not_()
    again = client.get_data(meta, ["x"])["x"]
    assert torch.equal(_bits(again), _bits(got))


def test_every_torch_dtype_is_supported() -> None:
    names = {"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"}
    names |= {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
    names |= {"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}
    assert names <= set(DTYPES)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_ragged_round_trip_is_bit_exact(client: Client, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = [_random(dtype, (n, 2), gen) for n in (3, 0, 5, 1)]
    meta = client.put({"r": rows}, group=np.arange(4))
    got = client.get_data(meta, ["r"])["r"]
    assert isinstance(got, Ragged) and got.dtype == dtype
    assert got.lengths.tolist() == [3, 0, 5, 1]
    assert torch.equal(_bits(got.values), _bits(torch.cat([r.view(torch.uint8) for r in rows])))


def test_strings_and_bytes_come_back_as_python_values(client: Client) -> None:
    cols = {
        "u": np.array(["a", "béta", ""]),  # numpy str_ (dtype U)
        "s": np.array([b"a", b"\x00b", b""]),  # numpy bytes_ (dtype S)
        "o": np.array(["x", b"y", None], dtype=object),
        "grid": np.array([["a", "b"], ["c", "d"], ["e", "f"]]),
        "l": ["α", "b", "c"],
        "b": [b"\xff", b"", b"c"],
        "n": [np.str_("a"), np.bytes_(b"b"), np.float64(0.5)],
    }
    meta = client.put(cols, group=0)
    got = client.get_data(meta, list(cols))
    assert got["u"] == ["a", "béta", ""]
    assert got["s"] == [b"a", b"\x00b", b""]
    assert got["o"] == ["x", b"y", None]
    assert got["grid"] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert got["l"] == ["α", "b", "c"] and got["b"] == [b"\xff", b"", b"c"]
    assert got["n"] == ["a", b"b", 0.5]
    assert [type(v) for v in got["n"]] == [str, bytes, float]  # (not numpy scalars)
    assert all(client.specs()[f] == FieldSpec.object() for f in cols)
    # one key's row: a numpy string (0-d) or an array of strings is one object value
    client.kv_put("k", {"t": np.array("hello"), "ts": np.array(["a", "b"])})
    assert client.kv_get("k") == {"t": "hello", "ts": ["a", "b"]}
    client.kv_batch_put(["a", "b"], {"t": [np.array("x"), np.array("y")]})
    assert client.kv_batch_get(["a", "b"], fields=["t"]) == {"t": ["x", "y"]}


def test_dense_non_contiguous_and_numpy_inputs(client: Client) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    strided = base[:, ::2]  # non-contiguous [6, 5]
    arr = np.arange(12, dtype=np.int16).reshape(6, 2)
    meta = client.put({"s": strided, "a": arr}, group=0)
    cols = client.get_data(meta, ["s", "a"])
    assert torch.equal(cols["s"], strided)
    assert torch.equal(cols["a"], torch.from_numpy(arr))


def test_ragged_round_trip_with_empty_rows(client: Client) -> None:
    rows = [
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.tensor([], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
        torch.tensor([], dtype=torch.int32),
        torch.arange(1000, dtype=torch.int32),
    ]
    logp = [torch.randn(len(r)).to(torch.bfloat16) for r in rows]
    meta = client.put({"ids": rows, "logp": logp}, group=[0, 0, 1, 1, 2])
    cols = client.get_data(meta, ["ids", "logp"])
    ids, lp = cols["ids"], cols["logp"]
    assert isinstance(ids, Ragged) and isinstance(lp, Ragged)
    assert ids.lengths.tolist() == [3, 0, 1, 0, 1000]
    for got, want in zip(ids.unbind(), rows, strict=True):
        assert got.dtype == torch.int32 and torch.equal(got, want)
    for got, want in zip(lp.unbind(), logp, strict=True):
        assert torch.equal(_bits(got), _bits(want))


def test_ragged_inner_shape_and_padded_view(client: Client) -> None:
    rows = [torch.randn(n, 4) for n in (2, 0, 5)]
    meta = client.put({"emb": Ragged.from_tensors(rows)}, group=0)
    got = client.get_data(meta)["emb"]
    assert isinstance(got, Ragged) and got.inner_shape == (4,)
    padded, lens = got.to_padded()
    assert padded.shape == (3, 5, 4) and lens.tolist() == [2, 0, 5]
    assert torch.equal(padded[2], rows[2]) and torch.equal(padded[0, :2], rows[0])


def test_object_round_trip_unicode_and_nested(client: Client) -> None:
    values = [
        "7",
        "naïve – 数学 🚀",
        {"a": [1, 2.5, None], "b": {"c": True}},
        [1, "two", [3]],
        None,
        b"\x00\xff",
        2**63 - 1,
        -(2**63),
    ]
    meta = client.put({"obj": values}, group=0)
    assert client.get_data(meta, ["obj"])["obj"] == values


def test_tuples_come_back_as_lists_like_on_the_wire(client: Client) -> None:
    meta = client.put({"t": [(1, 2), {"k": (3,)}]}, group=0)
    assert client.get_data(meta)["t"] == [[1, 2], {"k": [3]}]


def test_fields_added_later_and_read_in_meta_order(client: Client) -> None:
    n = 50
    prompts = [torch.arange(i % 7) for i in range(n)]
    client.put({"prompt": prompts, "id": list(range(n))}, group=np.arange(n) // 5)
    got_ids = []
    for _ in range(5):
        meta = client.get_meta("rollout", ["prompt", "id"], 10, timeout_s=5)
        cols = client.get_data(meta)
        ids = cols["id"]
        assert isinstance(ids, list)
        resp = [torch.full((i % 3,), i) for i in ids]
        client.put({"response": resp, "score": torch.tensor(ids, dtype=torch.float64)}, meta=meta)
        got_ids += ids
    assert sorted(got_ids) == list(range(n))
    meta = client.get_meta("train", ["response", "score", "id"], n, timeout_s=5)
    cols = client.get_data(meta)
    ids = cols["id"]
    assert isinstance(ids, list)
    score = cols["score"]
    assert isinstance(score, torch.Tensor)
    assert score.tolist() == [float(i) for i in ids]
    resp = cols["response"]
    assert isinstance(resp, Ragged)
    for i, r in zip(ids, resp.unbind(), strict=True):
        assert torch.equal(r, torch.full((i % 3,), i))


def test_explicit_spec_converts_lists_of_lists_to_ragged(client: Client) -> None:
    spec = {"tok": FieldSpec.ragged(torch.int32)}
    meta = client.put({"tok": [[1, 2], [], [3]]}, specs=spec, group=0)
    got = client.get_data(meta)["tok"]
    assert isinstance(got, Ragged) and got.dtype == torch.int32
    assert [r.tolist() for r in got.unbind()] == [[1, 2], [], [3]]


def test_large_batch_spanning_units_round_trips(client: Client) -> None:
    x = torch.randn(1024, 257)
    meta = client.put({"x": x}, group=0)
    # read back in a scrambled order: every unit's rows are gathered and placed correctly
    perm = np.random.default_rng(0).permutation(1024)
    got = client.get_data(meta.select(perm), ["x"])["x"]
    assert torch.equal(got, x[torch.from_numpy(perm)])


def test_empty_batch_reads_as_empty_columns(client: Client) -> None:
    client.put({"x": torch.zeros(2, 3), "r": [torch.zeros(1)] * 2, "o": ["a", "b"]}, group=0)
    meta = client.get_meta("t", ["x", "r", "o"], 5, timeout_s=0.05)
    assert len(meta) == 2
    empty = meta.select([])
    cols = client.get_data(empty)
    assert cols["x"].shape == (0, 3)  # type: ignore[union-attr]
    assert len(cols["r"]) == 0 and cols["o"] == []


def test_small_puts_go_whole_to_one_unit_in_turn_and_large_ones_spread() -> None:
    """Placement by payload: one unit per ``spread_bytes``; the first unit rotates so that
    consecutive small puts fill the units evenly."""
    from transferqueue.controller.core import Controller

    ctl = Controller(4, spread_bytes=1000)
    small = [ctl.writes.allocate(10, "p", nbytes=999).units for _ in range(8)]
    assert [set(u.tolist()) for u in small] == [{i % 4} for i in range(8)]
    two = ctl.writes.allocate(10, "p", nbytes=2500).units  # 2 units' worth
    assert sorted(set(two.tolist())) == [0, 1] and np.bincount(two).tolist() == [5, 5]
    assert set(ctl.writes.allocate(12, "p", nbytes=10**9).units.tolist()) == {0, 1, 2, 3}
    assert set(ctl.writes.allocate(12, "p").units.tolist()) == {0, 1, 2, 3}  # size unknown: spread
    spread = Controller(4, spread_bytes=0)
    assert set(spread.writes.allocate(8, "p", nbytes=1).units.tolist()) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="spread_bytes"):
        Controller(2, spread_bytes=-1)
    with transferqueue.start(num_units=2) as tq:  # the client reports its payload's size
        c = tq.client()
        big = c.put({"y": torch.zeros(2, 9 << 20, dtype=torch.uint8)})  # 18 MiB
        assert len(set(big.units.tolist())) == 1  # below 2 x 16 MiB: still one unit


def test_a_producers_small_puts_stay_on_one_unit_while_the_units_are_balanced() -> None:
    """Sticky placement: a named producer's small puts stay on one unit until it holds
    ``spread_bytes`` more live payload than the least loaded unit, then go to the least
    loaded one; rows consumed as fast as they come keep the producer where it is."""
    from transferqueue.controller.core import Controller

    ctl = Controller(4, spread_bytes=1000)
    units = [int(ctl.writes.allocate(3, "p", nbytes=300, producer="a").units[0]) for _ in range(16)]
    assert units == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    assert ctl.stats()["unit_bytes"] == [1200] * 4
    # all units equally loaded: it stays where it is
    assert set(ctl.writes.allocate(5, "p", nbytes=300, producer="a").units.tolist()) == {3}
    assert set(ctl.writes.allocate(5, "p", nbytes=300, producer="b").units.tolist()) == {1}
    # large puts and puts without a producer are placed as before
    assert set(ctl.writes.allocate(12, "p", nbytes=10**9, producer="a").units.tolist()) == {
        0,
        1,
        2,
        3,
    }
    assert set(ctl.writes.allocate(3, "p", nbytes=300).units.tolist()) == {2}
    with pytest.raises(TypeError, match="producer must be a string"):
        ctl.writes.allocate(1, "p", nbytes=1, producer=7)  # type: ignore[arg-type]

    # rows freed as fast as they are put: the producer never moves
    flow = Controller(4, spread_bytes=1000)
    flow.rows.register_fields({"x": FieldSpec.dense(torch.int64, ())}, "p")
    flow.queues.declare_tasks("p", ["t"])
    seen = set()
    for _ in range(40):
        meta = flow.writes.allocate(4, "p", nbytes=700, producer="a")
        seen |= set(meta.units.tolist())
        flow.writes.commit(meta.indexes, ["x"])
        got, _ = flow.queues.poll(task="t", partition="p", fields=["x"], batch_size=4, lease_s=60)
        assert got is not None and got.lease_id is not None
        flow.queues.ack(got.lease_id)
    assert seen == {0} and flow.stats()["unit_bytes"] == [0] * 4
    # rows that pile up spread: live bytes stay within three spread_bytes of each other
    rng = np.random.default_rng(0)
    for _ in range(200):
        flow.writes.allocate(
            2, "p", nbytes=int(rng.integers(1, 1999)), producer=str(rng.integers(3))
        )
        load = flow.stats()["unit_bytes"]
        assert max(load) - min(load) < 3000, load

    one = Controller(1, spread_bytes=1000)  # a single unit: nothing to choose
    assert set(one.writes.allocate(3, "p", nbytes=300, producer="a").units.tolist()) == {0}
    with transferqueue.start(num_units=2) as tq:  # each client names itself
        c, d = tq.client(), tq.client()
        mine = {int(c.put({"x": torch.zeros(64, 16)}).units[0]) for _ in range(4)}
        theirs = {int(d.put({"x": torch.zeros(64, 16)}).units[0]) for _ in range(4)}
        assert len(mine) == 1 and len(theirs) == 1 and mine != theirs
