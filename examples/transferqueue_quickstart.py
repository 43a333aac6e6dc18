"""TransferQueue in one file: producers put columns, consumer tasks lease, read and ack.

    python examples/transferqueue_quickstart.py                 # embedded (in-process)
    python examples/transferqueue_quickstart.py --service       # local server processes

Shows the whole client API: put of new rows (dense, ragged and object fields), blocking
get_meta with a lease, get_data, put of new fields onto leased rows (which acks the lease),
the group sampler, stream(), stats() and the end of a stream.
"""

from __future__ import annotations

import argparse
import threading

import torch

import transferqueue
from transferqueue import Ragged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--service", action="store_true", help="run controller and units as processes")
    args = ap.parse_args()
    service = transferqueue.serve(num_units=2) if args.service else None
    tq = transferqueue.connect(service.address) if service else transferqueue.start(num_units=2)
    client = tq.client()
    # Rows are freed once every task declared for their partition has acknowledged them.
    client.declare_tasks(["rollout", "train"], partition="train")

    # A producer writes 4 prompts x 2 samples each: group ids keep a prompt's samples together.
    prompts = [
        torch.tensor([1, 2, 3]),
        torch.tensor([4, 5]),
        torch.tensor([6]),
        torch.tensor([7, 8]),
    ]
    meta = client.put(
        {
            "prompt": [p for p in prompts for _ in range(2)],  # ragged int64
            "answer": [str(i) for i in range(4) for _ in range(2)],  # object
        },
        group=[i for i in range(4) for _ in range(2)],
        partition="train",
    )
    print("put:", meta)

    # A rollout worker leases a batch, reads it, writes its results onto the same rows.
    def rollout() -> None:
        for m, cols in client.stream("rollout", ["prompt"], 4, partition="train", timeout_s=5):
            prompt = cols["prompt"]
            assert isinstance(prompt, Ragged)
            responses = [p.flip(0) for p in prompt.unbind()]
            client.put(  # adds fields to the leased rows and acknowledges the lease
                {"response": responses, "score": torch.rand(len(m))},
                meta=m,
                version=0,
            )

    worker = threading.Thread(target=rollout)
    worker.start()

    # The trainer takes whole groups only, as they complete.
    for _ in range(2):
        batch = client.get_meta(
            "train",
            ["response", "score", "answer"],
            4,
            partition="train",
            sampler="group",
            group_size=2,
            timeout_s=10,
        )
        cols = client.get_data(batch)
        print(
            f"train batch {batch.reason}: groups {batch.groups.tolist()}, answers {cols['answer']}"
        )
        client.ack(batch)

    client.finish("train")  # no more rows: the rollout stream ends once drained
    worker.join()
    stats = client.stats()["controller"]
    print(
        "rows still stored:", stats["rows_live"], "| tasks:", stats["partitions"]["train"]["tasks"]
    )
    tq.close()
    if service:
        service.close()


if __name__ == "__main__":
    main()
