"""Deployments: how the controller, the storage units and the clients are put together.

| module        | deployment                                                             |
|---------------|------------------------------------------------------------------------|
| ``embedded``  | controller and units as objects in this process (``start``)            |
| ``connect``   | a client of a running service (``connect``)                            |
| ``service``   | ``serve``: a controller and N units as processes on one host          |
| ``server``    | the controller and unit servers (ZeroMQ request/reply)                 |
| ``server_main`` | the entry point of one server process                                |
| ``ray``       | controller and units as Ray actors                                     |
| ``cli``, ``top``, ``metrics`` | the ``transferqueue`` command, its live view, Prometheus |
"""
