"""Are the replicas still identical? Every process digests its replicas' bytes in one pass and the
processes compare one 8-byte value each; a difference is found out by a second round that compares the
digests of each part (a bucket, a parameter), already taken by the first pass.

Note [The replica check]
Data-parallel replicas must hold the same bytes after every step; when they drift (a rank that skipped a
step, a non-deterministic kernel in the update, a parameter changed by hand on one rank, a buffer a
broadcast missed) training goes on and silently trains several different models. The check:
1. each process digests each of its replicas part by part (`_C.digest`, Note [Replica digest] in
   csrc/cpu/replica_hash.h: one read of every byte, the parts' digests and their combination);
2. round one: the processes gather one 8-byte combination per replica (a replica is a tower's parameters,
   or a process's master weights: only replicas of the same kind are compared); all equal: done;
3. otherwise round two gathers every replica's part digests (every process takes part: each knows from
   round one that it is needed), and the error names, for each replica that differs from the largest
   group of agreeing ones (rank 0's on a tie), the rank, the tower and the first part where it differs.
Both rounds are one all-gather of the communicator (or of torch.distributed's group) each; the cost is
one read of the parameters plus two small collectives, paid every `every` steps (TowerTrainer's
`replica_check_every`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, List, Optional, Sequence

import torch

from .._ext import _C
from ..errors import ReplicaMismatchError

ON_MISMATCH = ("raise", "warn")


class Replica:
    """One replica held by this process: `label` says which ("tower 1", "master weights"), `kind` which
    replicas it is compared with, `parts` its tensors in order and `names` what to call each part."""

    def __init__(self, label: str, kind: str, parts: Sequence[torch.Tensor], names: Sequence[str]):
        if len(parts) != len(names):
            raise ValueError(f"names: {len(names)} names for {len(parts)} parts of {label}")
        self.label, self.kind, self.parts, self.names = label, kind, list(parts), list(names)

    def digests(self) -> List[int]:
        """Each part's digest, then the whole replica's (Note [Replica digest])."""
        held = [_host_bytes(t) for t in self.parts]   # alive until the digest returns
        return list(_C.digest([(t.data_ptr(), t.numel()) for t in held]))


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, contiguous and on the host (a device tensor is copied: the digest is taken by
    the CPU), as unsigned bytes, so every dtype digests the same way."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def check_replicas(replicas: Sequence[Replica], allgather: Callable[[Any], list], rank: int,
                   on_mismatch: str = "raise", what: str = "the replica check") -> Optional[str]:
    """Note [The replica check] over this process's `replicas`; `allgather(obj)` returns every process's
    `obj` in rank order (a collective: every process calls this together). Returns None when every
    replica agrees; otherwise raises ReplicaMismatchError (on_mismatch="raise") or returns its text ("warn")."""
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch: must be one of {', '.join(map(repr, ON_MISMATCH))}, got {on_mismatch!r}")
    mine = [r.digests() for r in replicas]
    everyone = allgather([(r.label, r.kind, d[-1]) for r, d in zip(replicas, mine)])
    if all(len({total for *_, total in _of_kind(everyone, kind)}) <= 1 for kind in _kinds(everyone)):
        return None
    # Round two: every process got the same round-one answer, so every one is here too.
    parts = allgather([(d[:-1], r.names) for r, d in zip(replicas, mine)])
    text = f"{what}: the replicas differ (this is rank {rank}): " + "; ".join(_differences(everyone, parts))
    if on_mismatch == "raise":
        raise ReplicaMismatchError(text)
    return text


def _kinds(everyone: list) -> List[str]:
    seen: List[str] = []
    for entries in everyone:
        for _, kind, _ in entries:
            if kind not in seen:
                seen.append(kind)
    return seen


def _of_kind(everyone: list, kind: str) -> list:
    """(rank, index, label, total) of every replica of `kind`, in rank order."""
    return [(r, i, label, total) for r, entries in enumerate(everyone)
            for i, (label, k, total) in enumerate(entries) if k == kind]


def _differences(everyone: list, parts: list) -> List[str]:
    """For every replica outside its kind's largest agreeing group (ties: the group of the first
    replica), which rank and replica it is and the first part where it differs from that group."""
    out = []
    for kind in _kinds(everyone):
        reps = _of_kind(everyone, kind)
        counts = Counter(total for *_, total in reps)
        best = max(counts.values())
        reference = next(total for *_, total in reps if counts[total] == best)
        ref_rank, ref_index = next((r, i) for r, i, _, total in reps if total == reference)
        ref_digests, names = parts[ref_rank][ref_index]
        agree = [f"rank {r} {label}" for r, i, label, total in reps if total == reference]
        for r, i, label, total in reps:
            if total == reference:
                continue
            digests, _ = parts[r][i]
            first = next((j for j, (a, b) in enumerate(zip(digests, ref_digests)) if a != b), None)
            where = (f"first at part {first} ({names[first]})" if first is not None else
                     f"in its number of parts ({len(digests)} against {len(ref_digests)})")
            out.append(f"rank {r} {label} differs from {', '.join(agree[:4])}"
                       f"{' and others' if len(agree) > 4 else ''}: {where}")
    return out
