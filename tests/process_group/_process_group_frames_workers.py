"""Bodies of tests/process_group/test_frames.py: the Python frames of the torch face's general path, from
the group's method (or the runner's worker) to the transport's primitive that calls the binding (Note
[Frames of a call] in ncclavg/process_group/jobs.py)."""
import os
import sys

import torch
import torch.distributed as dist

from _process_group_workers import init_backend


def _frames_from(names):
    """The frames of this thread's stack from the first frame named in `names` (innermost last), as
    (file's base name, function name)."""
    frames, f = [], sys._getframe(1)
    while f is not None:
        frames.append((os.path.basename(f.f_code.co_filename), f.f_code.co_name))
        f = f.f_back
    frames.reverse()
    for i, (_, name) in enumerate(frames):
        if name in names:
            return frames[i:]
    raise AssertionError(f"no frame named {names}: {frames}")


def frames_job(rank, world, port, out_dir):
    import json

    from ncclavg.transport import shm

    init_backend(rank, world, port)
    g = dist.group.WORLD
    for fast in g._runner.fast_paths:   # the general path: what a call the fast paths decline takes
        fast.disable()
    seen = {}
    original = shm.ShmTransport.all_reduce_sum

    def spy(self, t, job, *args, **kwargs):   # stands where ShmTransport.all_reduce_sum's frame is
        seen.setdefault(seen.get("case"), _frames_from({"allreduce", "_serve"}))
        return original(self, t, job, *args, **kwargs)

    shm.ShmTransport.all_reduce_sum = spy
    for case, (n, dtype, op, async_op) in {"sync float32 sum": (1000, torch.float32, dist.ReduceOp.SUM, False),
                                           "sync bfloat16 avg": (1000, torch.bfloat16, dist.ReduceOp.AVG, False),
                                           "async 1 MiB sum": (1 << 18, torch.float32, dist.ReduceOp.SUM, True)
                                           }.items():
        seen["case"] = case
        x = torch.ones(n, dtype=dtype)
        work = dist.all_reduce(x, op=op, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(x, torch.full_like(x, 1.0 if op == dist.ReduceOp.AVG else world)), case
    shm.ShmTransport.all_reduce_sum = original
    seen.pop("case")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
