"""Checkpoints of sharded masters written as a set (Note [Sharded checkpoints] in
ncclavg/train/sharded.py): the parts put together again, a missing or foreign part refused by name, and
the checkpoint manager treating a set as one checkpoint (listing, pruning, stale temporary files)."""
import os

import pytest
import torch

from ncclavg.train import checkpoint as ckpt
from ncclavg.train.sharded import assemble_master

SGD_HP = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False}


def write_set(directory, step=7):
    """A 2-process set for two parameters (3 and 2 elements) in one bucket of 5, padded to 6."""
    main = os.path.join(directory, f"ckpt-{step:09d}.ckpt")
    manifest = {"processes": 2, "kind": "sgd", "numel": [5], "padded": [6],
                "slots": [(0, (3,), 0, 0, 3), (1, (2,), 0, 3, 2)], "hp": dict(SGD_HP), "steps": [4],
                "momentum_started": [True]}
    flat = torch.arange(6, dtype=torch.float32)
    mom = -flat
    for r in range(2):
        ckpt.save(ckpt.part_path(main, r, 2), {"rank": r, "processes": 2, "flat": [flat[3 * r:3 * r + 3].clone()],
                                                 "momentum_buffer": [mom[3 * r:3 * r + 3].clone()]})
    ckpt.save(main, {"master": {"sharded": manifest}})
    return main, manifest


def test_parts_are_put_together_into_the_portable_state(tmp_path):
    main, manifest = write_set(str(tmp_path))
    state = assemble_master(manifest, main)
    assert torch.equal(state["params"][0], torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(state["params"][1], torch.tensor([3.0, 4.0]))   # the padding element 5 is dropped
    assert torch.equal(state["optimizer"]["state"][1]["momentum_buffer"], torch.tensor([-3.0, -4.0]))
    assert state["steps"] == [4] and state["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_missing_or_foreign_part_is_refused_by_name(tmp_path):
    main, manifest = write_set(str(tmp_path))
    part1 = ckpt.part_path(main, 1, 2)
    os.replace(ckpt.part_path(main, 0, 2), part1)   # rank 0's part where rank 1's belongs
    with pytest.raises(ckpt.CheckpointError, match="part0-of-2: exists check failed"):
        assemble_master(manifest, main)
    ckpt.save(ckpt.part_path(main, 0, 2), ckpt.load(part1))
    with pytest.raises(ckpt.CheckpointError, match="part1-of-2: content check failed: holds the part of rank 0"):
        assemble_master(manifest, main)


def test_manager_lists_prunes_and_cleans_sets_as_one_checkpoint(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path), keep=1)
    first, _ = write_set(str(tmp_path), step=7)
    assert mgr.list() == [(7, first)]   # the parts are not checkpoints of their own
    # a part's temporary file left by a dead process (pid 999999999 does not exist) is cleaned up
    stale = os.path.join(str(tmp_path), f".{os.path.basename(first)}.part1-of-2.tmp-{ckpt._HOST}-999999999-0123abcd")
    open(stale, "wb").close()
    second = mgr.save({"x": 1}, 8)   # keep=1: the older set goes, parts included
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(second)]
