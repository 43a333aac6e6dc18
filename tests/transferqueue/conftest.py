"""Fixtures shared by the TransferQueue behaviour tests.

``tq`` is parametrized over deployments, so every behaviour test runs unchanged against each
way of running TransferQueue.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import transferqueue
from transferqueue import Client, TransferQueue

DEPLOYMENTS = ["embedded"]


@pytest.fixture(params=DEPLOYMENTS)
def tq(request: pytest.FixtureRequest) -> Iterator[TransferQueue]:
    handle = transferqueue.start(num_units=2)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def client(tq: TransferQueue) -> Client:
    return tq.client()
