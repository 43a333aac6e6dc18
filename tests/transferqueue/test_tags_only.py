"""Rows that hold only metadata: keys (or rows) put with tags and no field exist, are listed
with their tags, get their fields from a later put, and are handed to a task only once the
fields it asks for are written (verl registers prompts this way, then writes status tags,
then fields). Every deployment."""

from __future__ import annotations

import pytest
import torch

from transferqueue import Client
from transferqueue.errors import BadRequestError, UnknownKeyError

KEYS = [f"uid-{i}" for i in range(4)]


def test_tags_only_keys_exist_then_get_status_tags_then_fields(client: Client) -> None:
    meta = client.kv_batch_put(
        KEYS, partition="p", tags=[{"status": "new", "i": i} for i in range(4)]
    )
    assert len(meta) == 4 and meta.fields == ()
    listing = client.kv_list("p", tags=True, fields="all")
    assert listing.keys == KEYS and listing.ready == {}
    assert listing.tags == [{"status": "new", "i": i} for i in range(4)]
    assert client.kv_batch_get(KEYS, partition="p") == {}  # (no field yet)
    client.kv_put("uid-1", partition="p", tag={"status": "running"})  # a status tag
    assert client.get_custom_meta(client.kv_meta(["uid-1"], partition="p").indexes) == [
        {"status": "running"}
    ]
    # no task is handed a row before the fields it asks for are written
    assert len(client.get_meta("train", ["x"], 4, partition="p", timeout_s=0.05)) == 0
    client.kv_batch_put(KEYS[:2], {"x": torch.arange(2)}, partition="p")
    got = client.get_meta("train", ["x"], 4, partition="p", timeout_s=0.05)
    assert sorted(client.get_data(got)["x"].tolist()) == [0, 1]  # type: ignore[union-attr]
    client.ack(got)
    client.kv_batch_put(KEYS[2:], {"x": torch.arange(2, 4)}, partition="p")
    got = client.get_meta("train", ["x"], 2, partition="p", timeout_s=1)
    assert sorted(client.get_data(got)["x"].tolist()) == [2, 3]  # type: ignore[union-attr]
    # the fields came to the same rows: tags kept, the keys' rows the ones registered
    after = client.kv_list("p", tags=True, fields=["x"])
    assert after.indexes.tolist() == listing.indexes.tolist()
    assert after.tags is not None and after.tags[1] == {"status": "running"}
    assert after.ready["x"].all()


def test_a_key_made_by_its_tag_takes_fields_of_any_kind(client: Client) -> None:
    client.kv_put("solo", tag={"a": 1})
    assert client.kv_get("solo") == {}
    client.kv_put("solo", {"text": "hello", "ids": torch.arange(3)})
    got = client.kv_get("solo")
    assert got["text"] == "hello" and torch.equal(got["ids"], torch.arange(3))
    client.kv_delete(["solo"])
    with pytest.raises(UnknownKeyError, match="solo"):
        client.kv_meta(["solo"])


def test_tags_with_fields_in_one_put_and_bad_tags(client: Client) -> None:
    client.kv_batch_put(["a", "b"], {"x": torch.ones(2)}, tags=[{"k": "a"}, {"k": "b"}])
    assert client.kv_list(tags=True).tags == [{"k": "a"}, {"k": "b"}]
    with pytest.raises(BadRequestError, match="2 rows but 1 tags"):
        client.kv_batch_put(["c", "d"], tags=[{"k": 1}])
    with pytest.raises(BadRequestError, match=r"tags\[0\]"):
        client.kv_batch_put(["c"], tags=[{"k": object()}])
    assert client.kv_list().keys == ["a", "b"]  # (nothing of a refused put stays)


def test_row_put_of_metadata_only_then_fields(client: Client) -> None:
    client.declare_tasks(["t"], partition="q")
    rows = client.put({}, partition="q", tags=[{"prompt": i} for i in range(3)])
    assert len(rows) == 3 and rows.fields == ()
    assert client.get_custom_meta(rows.indexes) == [{"prompt": i} for i in range(3)]
    assert len(client.get_meta("t", ["y"], 3, partition="q", timeout_s=0.05)) == 0
    client.put({"y": torch.tensor([7, 8, 9])}, meta=rows)
    got = client.get_meta("t", ["y"], 3, partition="q", timeout_s=1)
    assert client.get_data(got)["y"].tolist() == [7, 8, 9]  # type: ignore[union-attr]
    assert client.get_custom_meta(got.indexes) == [{"prompt": i} for i in range(3)]
