"""Device data: CUDA columns staged through pinned host buffers, and device memory shared
between processes of one host by handle.

| module       | what                                                                  |
|--------------|-----------------------------------------------------------------------|
| ``sharing``  | a tensor's memory handed to another process (CUDA IPC; shared files)  |

Everything here imports only torch; where CUDA is absent the host paths work unchanged.
"""
