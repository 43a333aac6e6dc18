"""Every sample reaches every task exactly once, under concurrency and consumer crashes.

Hypothesis draws the shape of a run (producers, consumers per task, batch sizes, which
batches a consumer abandons without acknowledging, timing jitter); real threads run it
against a real TransferQueue. A consumer that "crashes" simply walks away from its lease:
the rows must come back to another consumer after the deadline, and in the end each task
must have acknowledged every row exactly once.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transferqueue import Client, LeaseExpiredError, TransferQueue, UnknownRowError

LEASE_S = 0.5
_RUN = itertools.count()  # hypothesis reseeds `random`: name partitions by a counter


def _producer(client: Client, pid: int, sizes: list[int], rng: random.Random) -> None:
    k = 0
    for n in sizes:
        ids = [pid * 10_000 + k + i for i in range(n)]
        k += n
        client.put(
            {"x": torch.tensor(ids, dtype=torch.int64), "id": ids},
            group=[i // 4 for i in ids],
        )
        if rng.random() < 0.5:
            threading.Event().wait(rng.random() * 0.005)


def _guard(errors: list[BaseException], fn: object, *args: object) -> None:
    """Run a thread body; record any error so the test fails on a thread that died."""
    try:
        fn(*args)  # type: ignore[operator]
    except BaseException as e:  # reported by the test
        errors.append(e)


def _consumer(
    client: Client,
    task: str,
    fields: list[str],
    batch_size: int,
    crash_p: float,
    rng: random.Random,
    seen: Counter[int],
    lock: threading.Lock,
    writes: str | None,
) -> None:
    while True:
        meta = client.get_meta(task, fields, batch_size, timeout_s=0.05, lease_s=LEASE_S)
        # A batch this consumer did not acknowledge comes back to the task when its lease
        # runs out, so that batch's end-of-stream mark is not the end for whoever restarts.
        finished = True
        if len(meta):
            try:
                cols = client.get_data(meta)
            except UnknownRowError:
                # Our lease ran out while we were slow; another consumer took the rows, every
                # task consumed them and they were freed. Correct: nothing to do here.
                continue
            ids = cols["id"]
            assert isinstance(ids, list)
            x = cols["x"]
            assert isinstance(x, torch.Tensor)
            assert x.tolist() == ids  # columns of one row stay together
            if rng.random() < crash_p:
                finished = False  # crash: walk away from the lease, never ack, restart
            else:
                try:
                    if writes is not None:
                        client.put({writes: x * 2}, meta=meta)  # result + ack in one put
                    else:
                        client.ack(meta)
                except LeaseExpiredError:
                    finished = False  # too slow: the rows were handed to someone else
                else:
                    with lock:
                        seen.update(ids)
        if meta.is_end and finished:
            return


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    producers=st.integers(4, 6),
    consumers=st.integers(4, 6),
    put_sizes=st.lists(st.integers(1, 9), min_size=2, max_size=6),
    batch_sizes=st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)),
    crash_p=st.sampled_from([0.0, 0.1, 0.25]),
    seed=st.integers(0, 2**16),
)
def test_each_sample_reaches_each_task_exactly_once(
    tq: TransferQueue,
    producers: int,
    consumers: int,
    put_sizes: list[int],
    batch_sizes: tuple[int, int, int],
    crash_p: float,
    seed: int,
) -> None:
    partition = f"run-{next(_RUN)}"
    # "gen" adds field y to each row; "score" and "train" consume it; "audit" reads x only.
    tasks = {
        "gen": (["x", "id"], batch_sizes[0], "y"),
        "train": (["y", "x", "id"], batch_sizes[1], None),
        "audit": (["x", "id"], batch_sizes[2], None),
    }
    setup = tq.client()
    setup.declare_tasks(list(tasks), partition=partition)

    def client() -> Client:
        c = tq.client()
        # route every call of this run to its own partition
        for name in ("put", "get_meta"):
            orig = getattr(c, name)

            def bound(*a: object, _orig: object = orig, **kw: object) -> object:
                kw.setdefault("partition", partition)
                return _orig(*a, **kw)  # type: ignore[operator]

            setattr(c, name, bound)
        return c

    seen: dict[str, Counter[int]] = {t: Counter() for t in tasks}
    lock = threading.Lock()
    errors: list[BaseException] = []
    threads = []
    for p in range(producers):
        rng = random.Random(seed * 131 + p)
        threads.append(
            threading.Thread(
                target=_guard, args=(errors, _producer, client(), p, put_sizes, rng), daemon=True
            )
        )
    for t, (fields, bs, writes) in tasks.items():
        for c in range(consumers):
            rng = random.Random(seed * 7919 + c + hash(t) % 1000)
            body = (client(), t, fields, bs, crash_p, rng, seen[t], lock, writes)
            threads.append(
                threading.Thread(target=_guard, args=(errors, _consumer, *body), daemon=True)
            )
    for th in threads:
        th.start()
    for th in threads[:producers]:
        th.join(30)
    setup.finish(partition)
    for th in threads[producers:]:
        th.join(60)
    assert not errors, f"a producer or consumer thread failed: {errors[0]!r}"
    assert not any(th.is_alive() for th in threads), "a consumer never saw the end of stream"
    expected = Counter(p * 10_000 + k for p in range(producers) for k in range(sum(put_sizes)))
    for t in tasks:
        assert seen[t] == expected, f"task {t}: missing or duplicated rows"
    stats = setup.stats()["controller"]["partitions"][partition]
    assert stats["rows_live"] == 0  # every declared task acked every row: all freed
    for t in tasks:
        assert stats["tasks"][t]["done"] == sum(expected.values())
