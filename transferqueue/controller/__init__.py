"""The controller: TransferQueue's metadata (never payload).

It allocates rows and places them on storage units, records which fields of which rows are
ready, keeps each consumer task's queue and leases, samples micro-batches, enforces
version filters, counts losses, journals its changes and recovers them. ``core`` holds the
synchronous core; ``service`` the asyncio shell that adds waiting; the other modules are the
parts the core is built from and the controller server's background work.

Never imports :mod:`transferqueue.client` (a client reaches the controller only through the
wire or, embedded, through :mod:`transferqueue.deploy.embedded`).
"""
