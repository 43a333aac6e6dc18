"""The ``transfer_queue`` shim package (see :mod:`tqcompat.alias`): its folder goes on
``PYTHONPATH`` by choice, never by installation."""
