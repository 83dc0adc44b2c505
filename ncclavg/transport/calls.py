"""The user-level call a collective serves, in the form the shared-memory channel's signatures carry it
(Note [Call signatures] in csrc/transport/shm_calls.cpp): which collective, the user's dtype, the reduction,
the root and the element count. Ranks whose calls differ fail with both calls named, on every rank,
whichever transport moves the data: the channel compares the calls in the round that moves the data
(or in a round of its own before a gloo step), and between hosts `exchange_record` exchanges them with
the call's first data.

Note [The check beside the data]
Between hosts (and between processes that share no channel) the calls are compared by one all-gather of
three words per rank over gloo. Run before the data, it would cost a network round trip per collective,
which for a small all-reduce doubles its time. So it is started just before the call's data is sent, in
flight beside it (gloo runs a group's operations on several threads), and waited for before any result
is written where the caller sees it: the data's exchange and the check end together. A mismatch is then
found within one exchange and raised on every rank, naming both calls; the data that went with it is
never handed back (the group fails, and nothing waits for it).

The codes come from the core's tables (`_C.shm_call_names()`), so that one place says what they mean.
"""
from __future__ import annotations

import datetime
from typing import Any, Optional

import torch

from .._ext import _C

_NAMES = _C.shm_call_names()
_COLLECTIVES = {n: i for i, n in enumerate(_NAMES["collectives"]) if n}
_DTYPES = {n: i for i, n in enumerate(_NAMES["dtypes"]) if n}
_BYTES = _DTYPES["bytes"]
_ROOT_LIMIT = 1 << 20   # the tag's root field (csrc/transport/shm_calls.h)


class Call:
    """One user call: `tag` and `count` as the channel takes them (`tag_count`), `collective` its name.
    `checked` is set once a step has compared it across the ranks (the later channel calls of the
    same collective still carry it: comparing there is free)."""

    __slots__ = ("tag", "count", "collective", "checked")

    def __init__(self, tag: int, count: int, collective: str):
        self.tag, self.count, self.collective, self.checked = tag, count, collective, False

    def describe(self) -> str:
        return describe(self.tag, self.count)

    def __repr__(self) -> str:
        return f"Call({self.describe()!r})"


def dtype_code(dtype: Optional[torch.dtype]) -> tuple:
    """(code, elements per element) of a torch dtype: a dtype the tables do not name is counted as bytes."""
    if dtype is None:
        return 0, 1
    code = _DTYPES.get(str(dtype).replace("torch.", ""))
    if code is not None:
        return code, 1
    return _BYTES, torch.empty(0, dtype=dtype).element_size()


def make(collective: str, dtype: Optional[torch.dtype] = None, op: Any = None, root: Optional[int] = None,
         count: int = 0) -> Call:
    """The Call of `collective` (a name of the core's table) on `count` elements of `dtype`, with the
    reduction `op` (a ReduceOp or RedOpType) and `root` (a group rank) where it has them."""
    code, per = dtype_code(dtype)
    op_code = 0 if op is None else int(getattr(op, "op", op)) + 1   # RedOpType value + 1
    root_field = 0 if root is None else int(root) + 1
    if not 0 <= root_field < _ROOT_LIMIT:
        raise ValueError(f"root: must be in [0, {_ROOT_LIMIT - 1}), got {root}")
    tag = _COLLECTIVES[collective] | code << 8 | op_code << 16 | root_field << 24
    return Call(tag, int(count) * per, collective)


def average_call(t: torch.Tensor) -> Call:
    """Communicator.all_reduce_avg of `t`: the same call on its fast path (shm_fast.py) and its general one."""
    return make("Communicator.all_reduce_avg", t.dtype, count=t.numel())


def describe(tag: int, count: int) -> str:
    """A call in words, as the channel's errors give it: "all_reduce(MAX) of 4 int32"."""
    return _C.shm_describe_call(int(tag), int(count))


def mismatch_text(rank: int, mine: tuple, other_rank: int, theirs: tuple, where: str) -> str:
    """The error of ranks whose calls differ (the channel's words, Note [Call signatures])."""
    return (f"collectives out of step: rank {rank} called {describe(*mine)}, rank {other_rank} called "
            f"{describe(*theirs)}: every rank must call the same collectives, with the same sizes, dtypes, ops "
            f"and roots, in the same order ({where})")


class CallMismatchError(_C.ShmMismatchError):
    """Ranks called different collectives, found by an exchange outside the channel (gloo)."""


FOLD_BYTES = 4096       # the data a record carries beside its call (Note [The check folded into the data])
_HEADER = 4             # int64 words: tag, count, ok, the payload's bytes


class Record:
    """A record exchange in flight (`start_record`); `finish` waits for it and reads it."""

    def __init__(self, work: Any, rows: Any, call: Call, rank: int, n: int, labels: list, where: str, ok: bool):
        self.work, self.rows, self.call, self.rank, self.n = work, rows, call, rank, n
        self.labels, self.where, self.ok = labels, where, ok

    def finish(self, timeout: float) -> list:
        """Waits (at most `timeout` s); raises CallMismatchError naming this rank's call and the first that
        differs (or the rank whose step failed); else returns every rank's payload, in rank order (nothing
        with ok=False: the caller raises its own error)."""
        self.work.wait(datetime.timedelta(seconds=max(timeout, 1e-3)))
        if not self.ok:
            return []
        call, rows, n = self.call, self.rows, self.n
        heads = rows[:, :_HEADER * 8].contiguous().view(torch.int64)
        for r in range(rows.shape[0]):
            if r == self.rank:
                continue
            if not int(heads[r, 2]):
                raise CallMismatchError(f"{call.describe()} failed on the host of rank {self.labels[r]} "
                                        f"({self.where}): its processes' errors say why")
            if int(heads[r, 0]) != call.tag or int(heads[r, 1]) != call.count or int(heads[r, 3]) != n:
                raise CallMismatchError(mismatch_text(self.labels[self.rank], (call.tag, call.count), self.labels[r],
                                                      (int(heads[r, 0]), int(heads[r, 1])), self.where))
        call.checked = True
        return [rows[r, _HEADER * 8:_HEADER * 8 + n] for r in range(rows.shape[0])]


def start_record(gloo: Any, call: Call, rank: int, size: int, payload: Optional[Any] = None,
                 labels: Optional[list] = None, where: str = "gloo", ok: bool = True) -> Record:
    """Starts one exchange of a fixed-size record per rank over the torch.distributed process group `gloo`
    (its c10d `_allgather_base`): this rank's call, whether its own step of the call went well (`ok=False`:
    a host whose ranks disagree tells the others, which then fail at once) and up to FOLD_BYTES of the
    call's data (`payload`, a uint8 tensor). Note [The check folded into the data]."""
    from torch._C._distributed_c10d import AllgatherOptions

    n = 0 if payload is None else payload.numel()
    if n > FOLD_BYTES:
        raise ValueError(f"payload: at most {FOLD_BYTES} bytes, got {n}")
    mine = torch.zeros(_HEADER * 8 + FOLD_BYTES, dtype=torch.uint8)
    mine[:_HEADER * 8].view(torch.int64).copy_(torch.tensor([call.tag, call.count, int(ok), n], dtype=torch.int64))
    if n:
        mine[_HEADER * 8:_HEADER * 8 + n] = payload
    rows = torch.empty(size, mine.numel(), dtype=torch.uint8)
    work = gloo._allgather_base(rows.view(-1), mine, AllgatherOptions())
    return Record(work, rows, call, rank, n, labels if labels is not None else list(range(size)), where, ok)


def exchange_record(gloo: Any, call: Call, rank: int, size: int, timeout: float, payload: Optional[Any] = None,
                    labels: Optional[list] = None, where: str = "gloo", ok: bool = True) -> list:
    """start_record, then its finish: the ranks' payloads in rank order (Note [The check folded into the
    data])."""
    return start_record(gloo, call, rank, size, payload, labels, where, ok).finish(timeout)


def check_over_gloo(gloo: Any, call: Call, rank: int, size: int, timeout: float, labels: Optional[list] = None,
                    where: str = "gloo", ok: bool = True) -> None:
    """Compares `call` across the ranks of `gloo`: a record that carries no data."""
    exchange_record(gloo, call, rank, size, timeout, labels=labels, where=where, ok=ok)
