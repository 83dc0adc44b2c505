"""What a TowerTrainer checkpoint holds besides the master state: RNG states, the model's non-trainable
tensors, and the checks that a checkpoint belongs to the model it is loaded into."""
from __future__ import annotations

import random
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .checkpoint import CheckpointError

CHECKPOINT_KIND = "ncclavg.TowerTrainer"
CHECKPOINT_FORMAT = 1


def rng_state(cuda_devices: Sequence[torch.device]) -> dict:
    """torch (CPU and the towers' GPUs), numpy's legacy global RNG and Python's `random`, in forms the
    weights-only checkpoint loader accepts (tensors, ints, floats, tuples)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "python": random.getstate(),
        "cuda": {},
    }
    for d in sorted({d.index for d in cuda_devices if d.type == "cuda"}):
        state["cuda"][int(d)] = torch.cuda.get_rng_state(d)
    return state


def set_rng_state(state: dict, cuda_devices: Sequence[torch.device]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state.get("cuda", {})
    for d in sorted({d.index for d in cuda_devices if d.type == "cuda"}):
        if d in saved:
            torch.cuda.set_rng_state(saved[d], d)


def seed_everything(seed: int, cuda_devices: Sequence[torch.device]) -> None:
    """torch (CPU and the towers' GPUs), numpy's legacy global RNG and Python's `random` from the run's
    seed: every RNG a checkpoint records starts from it, so two runs with one seed write the same bytes."""
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)
    for d in sorted({d.index for d in cuda_devices if d.type == "cuda"}):
        with torch.cuda.device(d):
            torch.cuda.manual_seed(seed)


def extra_tensors(model: nn.Module) -> dict:
    """Buffers and frozen parameters (trainable ones live in the master state), on the CPU."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            out[name] = p.detach().to("cpu", copy=True)
    for name, b in model.named_buffers():
        out[name] = b.detach().to("cpu", copy=True)
    return out


def load_extra_tensors(towers: Sequence[nn.Module], tensors: dict) -> None:
    with torch.no_grad():
        for tower in towers:
            named = dict(tower.named_parameters())
            named.update(dict(tower.named_buffers()))
            for name, value in tensors.items():
                named[name].copy_(value)


def check_signature(path: str, state: Any, signature: list) -> None:
    """A checkpoint must come from a TowerTrainer and from a model with the same parameters and buffers
    (names, shapes, dtypes, trainable flags). Raises CheckpointError(check='content') naming the first
    difference; nothing is modified."""
    if not isinstance(state, dict) or state.get("kind") != CHECKPOINT_KIND:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(path, "content", f"not a TowerTrainer checkpoint (kind {got!r})")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(path, "content", f"TowerTrainer checkpoint format {state.get('format')!r} is "
                              f"not supported (expected {CHECKPOINT_FORMAT})")
    saved = [(n, tuple(s), d, bool(tr)) for n, s, d, tr in state["signature"]]
    mine = [(n, tuple(s), d, bool(tr)) for n, s, d, tr in signature]
    if saved == mine:
        return
    saved_by_name = {e[0]: e for e in saved}
    mine_by_name = {e[0]: e for e in mine}
    for entry in mine:
        other = saved_by_name.get(entry[0])
        if other is None:
            detail = f"the model has {entry[0]!r} {entry[1]} {entry[2]} which the checkpoint lacks"
            break
        if other != entry:
            detail = (f"{entry[0]!r} is {other[1]} {other[2]}{'' if other[3] else ' (frozen)'} in the "
                      f"checkpoint but {entry[1]} {entry[2]}{'' if entry[3] else ' (frozen)'} in the model")
            break
    else:
        extra = next(e for e in saved if e[0] not in mine_by_name) if len(saved) > len(mine) else None
        detail = (f"the checkpoint has {extra[0]!r} {extra[1]} which the model lacks" if extra
                  else "the parameter order differs")
    raise CheckpointError(path, "content", f"saved from a different model ({len(saved)} tensors vs "
                          f"{len(mine)} in this model): {detail}")
