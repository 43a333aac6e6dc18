"""Device data: CUDA columns staged through pinned host buffers, and device memory shared
between processes of one host by handle.

| module       | what                                                                  |
|--------------|-----------------------------------------------------------------------|
| ``pinned``   | a bounded pool of reusable pinned host chunks                         |
| ``staging``  | device columns to and from host memory through those chunks           |
| ``sharing``  | a tensor's memory handed to another process (CUDA IPC; shared files)  |
| ``shared``   | columns that stay with their producer, read by handle (``share=``)    |

Everything here imports only torch; where CUDA is absent the host paths work unchanged.
"""
