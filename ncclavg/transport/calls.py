"""The user-level call a collective serves, in the form the shared-memory channel's signatures carry it
(Note [Call signatures] in csrc/transport/shm_calls.cpp): which collective, the user's dtype, the reduction,
the root and the element count. Ranks whose calls differ fail with both calls named, on every rank,
whichever transport moves the data: the channel compares the calls in the round that moves the data
(or in a round of its own before a gloo step), and between hosts `exchange_record` exchanges them with
the call's data (Note [The check folded into the data]).

Note [The check folded into the data]
Between hosts (and between processes that share no channel) the calls are compared over gloo by a record:
each rank sends every other rank its call (collective, dtype, op, root, count), whether its own step went
well, and data. A record of its own before the data would cost a network exchange per collective, which
for a small one doubles its time; so the record carries the call's data: all of it where it fits
(`fold_limit`: 256 KiB to each peer in a group of two, less in larger groups, never under FOLD_BYTES),
else its first FOLD_BYTES. A small collective is then one exchange in all, and a large one's record moves
data too.
The record must be safe when the calls differ, sizes included. gloo's collectives are not: a message
longer than the receiver expects ends the receiving process (gloo's tcp pair enforces it on its device
thread), and the lengths of a collective's messages follow its count. So the record is gloo's
point-to-point send and recv, one message to each peer, and every rank posts its receives at the largest
length any record can have (`fold_limit` of the group's size plus the header): a shorter message completes
the receive (gloo does not check), its header says how many bytes it carried, and no message is ever
longer. A mismatch is then found within one exchange and raised on every rank, naming both calls; nothing
of the data that rode with it is written where the caller sees it. Only after the record has compared
the calls may a size that differs between ranks reach a gloo collective.
A record sends each peer the same bytes (`payload`) or each its own (`payloads`: a reduce-scatter sends
peer j only its slice), and a broadcast's data goes from its root alone (the others' records carry none).

The codes come from the core's tables (`_C.shm_call_names()`), so that one place says what they mean.
"""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

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
    """Communicator.all_reduce_avg of `t`: the same call on its fast path (fast_average.py) and its general one."""
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


FOLD_BYTES = 4096       # the data every record may carry (Note [The check folded into the data])
FOLD_WHOLE = 256 << 10  # a record's data to all its peers together, when a call rides in it whole
_HEADER = 4             # int64 words: tag, count, ok, the payload's bytes
_TAG = 0x6E636176       # the records' point-to-point tag on a group ("ncav")


def fold_limit(size: int) -> int:
    """The most data bytes a record of a group of `size` ranks sends each peer: a call whose data (to each
    peer) fits rides in its record whole. FOLD_WHOLE over the peers, so that a record's bytes stay those of
    one small exchange however many ranks there are; never under FOLD_BYTES; a multiple of 64, so that
    every received row's payload starts aligned for any dtype (rows of header + fold_limit bytes)."""
    return max(FOLD_BYTES, FOLD_WHOLE // max(1, size - 1) // 64 * 64)


def folded(flat: torch.Tensor, size: int) -> int:
    """The leading elements of `flat` its call's record carries in a group of `size`: all where they fit
    (fold_limit), else the first FOLD_BYTES."""
    nbytes = flat.numel() * flat.element_size()
    return flat.numel() if nbytes <= fold_limit(size) else min(flat.numel(), FOLD_BYTES // flat.element_size())


class Record:
    """A record exchange in flight (`start_record`); `finish` waits for it and reads it."""

    def __init__(self, works: list, rows: Any, call: Call, rank: int, labels: list, where: str, ok: bool):
        self.works, self.rows, self.call, self.rank = works, rows, call, rank
        self.labels, self.where, self.ok = labels, where, ok

    def finish(self, remaining: Callable[[], float]) -> list:
        """Waits until the call's deadline (`remaining()`: the seconds left of it, raising once it has
        passed: the job's, Note [One deadline per call] in runner.py); raises CallMismatchError naming this
        rank's call and the first that differs (or the rank whose step failed); else returns the payload
        every rank sent this one, in rank order, each as long as its sender made it (this rank's own: what
        it sent itself; nothing with ok=False: the caller raises its own error)."""
        for work in self.works:
            work.wait(datetime.timedelta(seconds=remaining()))
        if not self.ok:
            return []
        call, rows = self.call, self.rows
        heads = rows[:, :_HEADER * 8].contiguous().view(torch.int64)
        for r in range(rows.shape[0]):
            if r == self.rank:
                continue
            if not int(heads[r, 2]):
                raise CallMismatchError(f"{call.describe()} failed on the host of rank {self.labels[r]} "
                                        f"({self.where}): its processes' errors say why")
            if int(heads[r, 0]) != call.tag or int(heads[r, 1]) != call.count:
                raise CallMismatchError(mismatch_text(self.labels[self.rank], (call.tag, call.count), self.labels[r],
                                                      (int(heads[r, 0]), int(heads[r, 1])), self.where))
        call.checked = True
        return [rows[r, _HEADER * 8:_HEADER * 8 + int(heads[r, 3])] for r in range(rows.shape[0])]


def start_record(gloo: Any, call: Call, rank: int, size: int, payload: Optional[Any] = None,
                 labels: Optional[list] = None, where: str = "gloo", ok: bool = True,
                 payloads: Optional[list] = None) -> Record:
    """Starts one record exchange over the torch.distributed process group `gloo` (Note [The check folded
    into the data]): this rank's call, whether its own step of the call went well (`ok=False`: a host whose
    ranks disagree tells the others, which then fail at once) and data for every peer, up to
    fold_limit(size) bytes (uint8 tensors): `payload` the same for each, or `payloads[j]` for rank j. The
    lengths are the caller's to make agree (equal calls give equal lengths; a broadcast's root alone sends
    data); the header carries each, so that a receiver reads what was sent, never more."""
    shared = payloads is None
    if shared:
        payloads = [payload] * size
    payloads = [torch.empty(0, dtype=torch.uint8) if p is None else p for p in payloads]
    limit = fold_limit(size)
    if any(p.numel() > limit for p in payloads):
        raise ValueError(f"payload: at most {limit} bytes, got {[p.numel() for p in payloads]}")
    rows = torch.empty(size, _HEADER * 8 + limit, dtype=torch.uint8)   # received: never longer than this
    works = [gloo.recv([rows[j]], j, _TAG) for j in range(size) if j != rank]   # posted before any send

    def message(data: torch.Tensor, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        n = data.numel()
        msg = torch.empty(_HEADER * 8 + n, dtype=torch.uint8) if into is None else into[:_HEADER * 8 + n]
        msg[:_HEADER * 8] = torch.tensor([call.tag, call.count, int(ok), n], dtype=torch.int64).view(torch.uint8)
        if n:
            msg[_HEADER * 8:] = data
        return msg

    message(payloads[rank], rows[rank])   # this rank's own row, as a peer's reads
    one = message(payloads[0]) if shared else None   # the same message for every peer
    works += [gloo.send([one if shared else message(payloads[j])], j, _TAG) for j in range(size) if j != rank]
    return Record(works, rows, call, rank, labels if labels is not None else list(range(size)), where, ok)


def exchange_record(gloo: Any, call: Call, rank: int, size: int, remaining: Callable[[], float],
                    payload: Optional[Any] = None,
                    labels: Optional[list] = None, where: str = "gloo", ok: bool = True,
                    payloads: Optional[list] = None) -> list:
    """start_record, then its finish: the payloads the ranks sent this one, in rank order (Note [The check
    folded into the data])."""
    return start_record(gloo, call, rank, size, payload, labels, where, ok, payloads).finish(remaining)
