"""The facade under Ray: ``init()`` on the driver starts our Ray deployment under the peer's
actor name; a remote actor's own ``init()`` finds it and puts; the driver reads what it put;
the named actor lists and clears partitions as the peer's controller does."""

from __future__ import annotations

import pytest
import torch

import tqcompat as tq


def _producer_class() -> type:
    class Producer:
        """A remote producer written as peer code: ``tq.init()`` in its own process, then puts."""

        def produce(self, rank: int, n: int) -> list[int]:
            from tensordict import TensorDict

            import tqcompat as tq

            tq.init()
            try:
                data = TensorDict(
                    {
                        "ids": torch.arange(n * 2).view(n, 2) + 100 * rank,
                        "seq": torch.nested.as_nested_tensor(
                            [torch.arange(k + 1) for k in range(n)], layout=torch.jagged
                        ),
                    },
                    batch_size=n,
                )
                return tq.get_client().put(data, partition_id="train").global_indexes
            finally:
                tq.close()  # a worker's close leaves the store to the driver

    return Producer


@pytest.mark.ray
@pytest.mark.slow
def test_a_remote_actor_produces_for_the_driver(ray_cluster: None) -> None:
    import ray

    Producer = _producer_class()
    conf = tq.init({"controller": {"polling_mode": False}})
    try:
        assert ray.get_actor("TransferQueueController", namespace="transfer_queue") is not None
        assert conf.controller.sampler == "SequentialSampler"
        producer = ray.remote(num_cpus=0)(Producer).remote()
        put = ray.get(producer.produce.remote(rank=1, n=3), timeout=120)
        client = tq.get_client()
        meta = client.get_meta(["ids", "seq"], 3, "train", task_name="trainer")
        assert sorted(meta.global_indexes) == sorted(put)
        data = client.get_data(meta)
        assert data["ids"].tolist() == [[100, 101], [102, 103], [104, 105]]
        assert [r.tolist() for r in data["seq"].unbind()] == [[0], [0, 1], [0, 1, 2]]
        ray.kill(producer)
        # the two controller calls the peer's own tests clean up with
        actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        assert ray.get(actor.list_partitions.remote(), timeout=60) == ["train"]
        ray.get(actor.clear_partition.remote("train"), timeout=60)
        assert ray.get(actor.list_partitions.remote(), timeout=60) == []
        assert client.get_partition_list() == []
    finally:
        tq.close()
    with pytest.raises(ValueError):  # close stopped the named actor with the servers
        ray.get_actor("TransferQueueController", namespace="transfer_queue")
