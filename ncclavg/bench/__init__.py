"""ncclavg.bench: `ncclavg bench`, an nccl-tests style sweep of all_reduce_avg over message sizes with
the peers (torch, torch.distributed, cupy's NCCL, a plain copy) measured side by side in the same run.

What lives here: cli.py (the flags, validation, the run), sweep.py (the measuring engine: set up a
backend's contenders, fill exact inputs, check bit for bit, time), contenders.py (ncclavg and each
peer doing the same work), inputs.py (exact inputs and the #wrong checker), launch.py (torchrun
detection, or spawning the ranks on loopback) and report.py (the table, the summary, JSON and plot).
What it may import: the core, `ncclavg.transport`, `ncclavg.comm` and `ncclavg.process_group`; never
`ncclavg.train`. Nothing is imported here, so
`ncclavg bench --help` loads no torch.
Where to start reading: cli.py's `main_from_args`, then sweep.py's `sweep`.
(The repository's top-level bench/ folder holds the standalone benchmark scripts; this is the command.)
"""
