"""ncclavg.transport: what both communication faces use (ncclavg's Communicator in ncclavg.comm, and
the `ncclavg` torch.distributed backend in ncclavg.process_group).

What lives here: shm.py (`ShmTransport`: the Python side of the core's shared-memory channel between
the processes of a host, its setup over an exchange the caller provides, and the steps between hosts),
calls.py (the user-level call signature every channel round compares across ranks), liveness.py
(heartbeats that name a lost rank), flight.py (the flight recorder of the last collectives, dumped on
a timeout, a lost peer or demand) with flight_reader.py (`ncclavg trace`, which merges the dumps) and
profiling.py (torch.profiler ranges of collectives). The C++ side is csrc/transport/.
What it may import: the core (`ncclavg._ext`, `errors`) and torch; nothing of `ncclavg.comm`,
`ncclavg.process_group`, `ncclavg.train` or `ncclavg.bench`. Nothing is imported here.
Where to start reading: shm.py's `ShmTransport` (connect, then all_reduce_sum), then calls.py.
"""
