"""Payload storage: a storage unit holds a shard of rows as real columns.

| module    | what it holds                                                    |
|-----------|------------------------------------------------------------------|
| ``unit``  | ``StorageUnit``: one shard of rows, by global index              |
| ``columns`` | one column class per field kind (dense, ragged, object)        |
| ``shm``   | same-host shared-memory arenas for the data plane                |
| ``malloc``| allocator settings of server processes                           |

Knows nothing of leases, tasks or readiness (the controller's job).
"""
