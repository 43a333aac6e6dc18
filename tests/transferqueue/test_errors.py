"""Bad input gets a typed error that names the field, and stored data stays intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transferqueue import Client, SchemaError, UnknownFieldError, UnknownLeaseError


@pytest.fixture
def stored(client: Client) -> tuple[Client, object]:
    meta = client.put(
        {"x": torch.arange(8, dtype=torch.float32).reshape(4, 2), "r": [torch.ones(2)] * 4},
        group=np.arange(4),
    )
    return client, meta


def _intact(client: Client, meta: object) -> None:
    cols = client.get_data(meta, ["x", "r"])  # type: ignore[arg-type]
    assert torch.equal(cols["x"], torch.arange(8, dtype=torch.float32).reshape(4, 2))  # type: ignore[arg-type]
    assert len(cols["r"]) == 4


def test_wrong_dtype_names_field_expected_and_received(stored: tuple) -> None:
    client, meta = stored
    with pytest.raises(SchemaError, match=r"'x'.*dense float32 \[2\].*dense float16 \[2\]"):
        client.put({"x": torch.zeros(4, 2, dtype=torch.float16)}, meta=meta)
    _intact(client, meta)


def test_wrong_shape(stored: tuple) -> None:
    client, meta = stored
    with pytest.raises(SchemaError, match=r"'x'.*\[2\].*\[3\]"):
        client.put({"x": torch.zeros(4, 3)}, group=0)
    _intact(client, meta)


def test_kind_mismatch_and_row_count_mismatch(stored: tuple) -> None:
    client, meta = stored
    with pytest.raises(SchemaError, match="'r'"):
        client.put({"r": ["not", "tensors"]}, group=0)
    with pytest.raises(SchemaError, match="same number of rows"):
        client.put({"a": torch.zeros(3), "b": torch.zeros(2)}, group=0)
    with pytest.raises(SchemaError, match="meta has 4"):
        client.put({"y": torch.zeros(3)}, meta=meta)
    _intact(client, meta)


def test_not_msgpackable_object(stored: tuple) -> None:
    client, meta = stored
    with pytest.raises(SchemaError, match=r"'o' row 1.*object"):
        client.put({"o": ["fine", object()]}, group=0)
    with pytest.raises(SchemaError, match="dict keys must be str"):
        client.put({"o": [{1: 2}]}, group=0)
    _intact(client, meta)


def test_unknown_field_on_read(stored: tuple) -> None:
    client, meta = stored
    with pytest.raises(UnknownFieldError, match="'nope'"):
        client.get_data(meta, ["nope"])
    _intact(client, meta)


def test_unknown_lease_on_put(stored: tuple) -> None:
    client, meta = stored
    got = client.get_meta("t", ["x"], 4, timeout_s=1)
    got.lease_id = 123456
    with pytest.raises(UnknownLeaseError):
        client.put({"y": torch.zeros(4)}, meta=got)
    _intact(client, meta)
    assert len(client.get_meta("u", ["y"], 4, timeout_s=0.05)) == 0


def test_unsupported_dtype(client: Client) -> None:
    with pytest.raises(SchemaError, match="unsupported dtype"):
        client.put({"c": torch.empty(2, dtype=torch.bits8)}, group=0)


def test_task_field_list_is_fixed(stored: tuple) -> None:
    client, _ = stored
    client.get_meta("t", ["x"], 1, timeout_s=0)
    with pytest.raises(ValueError, match="consumes fields"):
        client.get_meta("t", ["x", "r"], 1, timeout_s=0)
