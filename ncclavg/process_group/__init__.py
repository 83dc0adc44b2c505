"""ncclavg.process_group: the `ncclavg` torch.distributed backend, the face most users reach ncclavg
through (`init_process_group("ncclavg")`, DDP, FSDP2, DeepSpeed, transformers' Trainer, Ray Train).

What lives here: group.py (`ProcessGroupNcclavg`, a `dist.ProcessGroup`, and `_create`, the creator
that ncclavg/__init__.py registers with torch), lane.py (each group's ordered worker, its works and
watchdog), connect.py (a group's host channel and heartbeats), cpu_collectives.py (the CPU collectives,
each asking its steps of the group's implementations in order: cpu_paths.py's channel, then the inner
gloo), fast_path.py (the inline synchronous collectives; all_reduce's in C++: _C.GroupAllreduce),
device_table.py (which collective's CUDA tensors go to which method of the inner NCCL group),
reductions.py (the element math of the ops the channel does not do), ddp_hook.py (the DDP comm hook
behind `ncclavg.ddp`) and fsdp_comms.py (FSDP2 custom comms). Its errors are in ncclavg/errors.py.
What it may import: the core, `ncclavg.transport`, `ncclavg.comm` and torch; never `ncclavg.train` or
`ncclavg.bench`. Nothing is imported here: the creator loads group.py when torch makes the first group.
Where to start reading: group.py's `ProcessGroupNcclavg.allreduce`, then lane.py's `Lane`, then
cpu_collectives.py.
"""
