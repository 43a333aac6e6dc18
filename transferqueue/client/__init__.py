"""The client: ``AsyncClient`` (the one implementation) and its blocking facade ``Client``.

It routes writes to storage units, reports readiness to the controller, gathers reads from
the units in parallel and assembles columns, with parts that own their state (``put``: the
writer; ``status``, ``kv``, ``checkpoint``: the calls of their names; ``specs``: the field
specs known; ``device_io``: device columns, through the handle's pinned chunks); ``handle``
is the ``TransferQueue`` handle that owns the I/O loop and the links a client talks through
(``links``: the seam; ``unit_link`` and ``controller_link``: over ZeroMQ). Never imports
:mod:`transferqueue.controller`.
"""
