"""The controller: TransferQueue's metadata (never payload).

It allocates rows and places them on storage units, records which fields of which rows are
ready, keeps each consumer task's queue and leases, samples micro-batches, enforces
version filters, counts losses, journals its changes and recovers them. ``core`` wires the
synchronous core from its parts (``rows``, ``partitions``, ``leases``, ``placement``,
``writes``, ``queues``, ``rereplicate``, ``retire``, ``health``, ``status``, ``keys``,
``snapshot``: each owns its state); ``service`` is the asyncio shell that adds waiting and
``handlers`` answer its message kinds; ``journal``/``journaled``/``recovery`` keep the core
across restarts; ``recopy`` is the controller server's background copier.

Never imports :mod:`transferqueue.client` (a client reaches the controller only through the
wire or, embedded, through :mod:`transferqueue.deploy.embedded`).
"""
