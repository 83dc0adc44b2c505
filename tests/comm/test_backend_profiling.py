"""torch.profiler on the `ncclavg` backend (ncclavg/comm/profiling.py): every collective under gloo's
name for it, with its shapes; the transport step inside it where it runs on the caller's thread."""
import json
import os

import _flight_workers as FW
from _dist_util import run_ranks


def test_ddp_steps_show_one_allreduce_per_bucket(tmp_path):
    steps = 5
    run_ranks(FW.ddp_profile_job, 2, args=(str(tmp_path), steps, 0.1), timeout_s=180)
    with open(os.path.join(tmp_path, "events.json")) as f:
        got = json.load(f)
    events, buckets = got["events"], got["buckets"]
    assert len(buckets) == 2, got   # bucket_cap_mb=0.1 splits the model in two
    reduces = [e for e in events if e["name"] == "c10d::allreduce_"]
    # one per bucket per step, each with the bucket's flat tensor as its input, in DDP's bucket order
    assert [e["shapes"] for e in reduces] == [[[n]] for n in buckets] * steps, reduces
    # and nothing else of the backend but the broadcast after the steps, with its channel step inside
    others = [(e["name"], e["shapes"], e["parent"]) for e in events if e["name"] != "c10d::allreduce_"]
    assert others == [("c10d::broadcast_", [[5, 3]], None), ("ncclavg:shm:broadcast", [], "c10d::broadcast_")], others
