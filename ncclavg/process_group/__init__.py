"""ncclavg.process_group: the `ncclavg` torch.distributed backend, the face most users reach ncclavg
through (`init_process_group("ncclavg")`, DDP, FSDP2, DeepSpeed, transformers' Trainer, Ray Train).

What lives here: group.py (`ProcessGroupNcclavg`, a `dist.ProcessGroup`, and `_create`, the creator that
ncclavg/__init__.py registers with torch), face.py (what the torch face adds to the transport's runner:
its errors and the profiled point-to-point Work), connect.py (a group's host channel, runner and
heartbeats), checks.py (the calls' argument checks and descriptions), jobs.py (one job class per
collective, named after it, which the runner runs), cpu_collectives.py (the CPU collectives the jobs
run, each asking its steps of the transport's implementations in order: transport/paths.py),
fast_path.py (the inline synchronous collectives; all_reduce's in C++: _C.GroupAllreduce), devices.py
(the collectives on CUDA tensors, registered for the device type "cuda": the inner NCCL group's),
ddp_hook.py (the DDP comm hook behind `ncclavg.ddp`), fsdp_comms.py (FSDP2 custom comms) and health.py
(`ncclavg.ddp.check_replicas` and `straggler_report` for stock PyTorch). Its errors
are in ncclavg/errors.py.
What it may import: the core, `ncclavg.transport`, `ncclavg.comm` and torch; never `ncclavg.train` or
`ncclavg.bench`. Nothing is imported here: the creator loads group.py when torch makes the first group.
Where to start reading: group.py's `ProcessGroupNcclavg.allreduce`, then jobs.py's `AllReduce`,
transport/runner.py's `Runner.start`, then cpu_collectives.py.
"""
