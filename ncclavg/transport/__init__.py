"""ncclavg.transport: what both communication faces use (ncclavg's Communicator in ncclavg.comm, and
the `ncclavg` torch.distributed backend in ncclavg.process_group).

What lives here: runner.py (the one runner per channel: a job's queue, worker, inline run when idle, its one
deadline and the watchdog, the failure state), work.py (the Works both faces hand back), failure.py (a
failure's kinds and every message that says one), shm.py (one host's shared-memory channel: its settings and
primitives), ucx.py (the same primitives for processes on several hosts, on the core's lanes over UCX),
hosts.py (the same over gloo's lanes, the fallback) with host_pipes.py (their chunked pipelines),
host_layout.py (which process carries which lane between hosts, for both engines), host_setup.py
(`connect`: the channel a group gets), paths.py (each collective step's implementations in order: one
host's channel or the path between hosts, then gloo) with reductions.py (the element math of the reductions the
channel cannot do), calls.py (the user-level call signature every round compares across ranks), liveness.py
(heartbeats that name a lost rank), flight.py (the flight recorder of the last collectives, dumped on a
timeout, a lost peer or demand) with flight_reader.py (`ncclavg trace`, which merges the dumps) and
profiling.py (torch.profiler ranges of collectives), stragglers.py (the straggler report from the ranks' arrival
times each host's channel logs) and replicas.py (the replica check: digests compared across the processes).
The C++ side is csrc/transport/.
What it may import: the core (`ncclavg._ext`, `buffers`, `errors`) and torch; nothing of `ncclavg.comm`,
`ncclavg.process_group`, `ncclavg.train` or `ncclavg.bench`. Nothing is imported here.
Where to start reading: runner.py's `Runner.submit`, then paths.py's `Paths.sum` and shm.py's
`ShmTransport.all_reduce_sum`.
"""
