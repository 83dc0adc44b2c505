"""The torch face's general path is short and named (Note [Frames of a call] in
ncclavg/process_group/jobs.py): from `ProcessGroupNcclavg.allreduce` to the transport's primitive that
calls the channel's binding, at most 8 Python frames, none of them an anonymous function; a queued job
the same from the runner's worker."""
import json

import _process_group_frames_workers as W
from _dist_util import run_ranks


def test_the_general_path_of_all_reduce_is_eight_named_frames(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCLAVG_SHM", "auto")
    run_ranks(W.frames_job, 2, args=(str(tmp_path),), timeout_s=120)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = ["allreduce", "_submit", "start", "_execute", "run", "allreduce", "sum", "spy"]
        for case in ("sync float32 sum", "sync bfloat16 avg"):
            names = [name for _, name in seen[case]]
            assert names == want, (case, seen[case])
            assert seen[case][0][0] == "group.py" and seen[case][4][0] == "jobs.py", seen[case]
        # the worker: _serve -> _execute -> the job, the same frames below
        names = [name for _, name in seen["async 1 MiB sum"]]
        assert names == ["_serve", "_execute", "run", "allreduce", "sum", "spy"], seen["async 1 MiB sum"]
