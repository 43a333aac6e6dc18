"""The wire: every message kind, how it becomes ZeroMQ frames, and the request/reply layer.

| module       | what it holds                                                        |
|--------------|----------------------------------------------------------------------|
| ``messages`` | every message kind of the protocol, typed, with its bounds          |
| ``codec``    | a message to frames and back (msgpack + out-of-band buffers)         |
| ``rpc``      | request/reply over ZeroMQ on asyncio (server and client sockets)     |
| ``auth``     | CURVE keys and who may do what                                       |
| ``liveness`` | heartbeats that notice a dead peer in seconds                        |
| ``grants``   | the controller's signed word that a writer may create rows on a unit |
| ``checks``   | request checks msgspec's own constraints cannot express              |
| ``counters`` | per message kind request counters of one server                      |

Imports only the shared modules at the top of ``transferqueue``.
"""
