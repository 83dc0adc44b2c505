"""How a collective fails, in one set of words for both faces: the wording of a timeout, of a failure and
of a refusal after an earlier failure (`timed_out`, `failed`, `unusable`, `refusal`), the kinds a
runner tells apart (`Kind`), and each face's error classes (`Face`). Every message of this sort that
ncclavg writes is written here.

Note [Failures are told by type]
A runner (runner.py) decides what a failed call was from the exception's type and the clock, never from
its text: a mismatch is `_C.ShmMismatchError` (or calls.CallMismatchError, its subclass); an error that
names the rank that stopped is `_C.ShmPeerError` (a peer exited, or a rank aborted the channel with its
reason) or `_C.ShmTimeoutError` (the channel's deadline passed while it waited for a named rank); a
timeout is a TimeoutError, or any failure at or past the call's deadline (gloo's waits end there with
an error of torch's that has one type for everything). Anything else asks the heartbeats which rank was
lost (liveness.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from .._ext import _C


class Kind(enum.Enum):
    """What a failed collective was (Note [Failures are told by type])."""
    TIMEOUT = "timeout"       # its deadline passed (the lost rank named where it can be)
    MISMATCH = "mismatch"     # the ranks called different collectives: both calls named
    LOST = "lost"             # a peer exited or aborted: the channel named it
    FAILED = "failed"         # anything else (a broken connection): the heartbeats name the lost rank


# the channel's errors that name the rank that stopped (or the aborting rank and its reason) themselves
NAMES_ITSELF = (_C.ShmPeerError, _C.ShmTimeoutError)
# what a channel round raises when it fails (a fast path catches these to fail its group or communicator)
CHANNEL_ERRORS = (_C.ShmPeerError, _C.CommTimeoutError)


def kind_of(e: BaseException, past_deadline: bool) -> Kind:
    """The Kind of a failure `e`; `past_deadline`: it came at or after the call's deadline."""
    if isinstance(e, _C.ShmMismatchError):
        return Kind.MISMATCH
    if past_deadline or isinstance(e, TimeoutError) or getattr(e, "is_timeout", False):
        return Kind.TIMEOUT
    if isinstance(e, _C.ShmPeerError):
        return Kind.LOST
    return Kind.FAILED


def timed_out(what: Any, timeout: float, whose: str) -> str:
    """A timeout's words, with " timeout " as gloo's and NCCL's say it (launchers, tools and torch's own tests
    look for it): "ncclavg allreduce of 4 x float32 (...) did not complete within 2 s: the group's timeout
    expired". `whose`: "the call's", "the group's", "the communicator's"."""
    return f"{what} did not complete within {timeout:g} s: {whose} timeout expired"


def failed(what: Any, text: str) -> str:
    return f"{what} failed: {text}"


def lost(ranks: list, how: str) -> str:
    """" (rank 2 stopped responding: heartbeat stopped)": the lost ranks, in the words the channel's own
    errors use too (csrc/transport/shm_channel.cpp)."""
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} stopped responding: {how})"


def unusable(msg: str, noun: str) -> str:
    """The text of the error a call fails with once it has failed its runner."""
    return f"{msg}; the {noun} is unusable now"


def refusal(what: Any, failure: str, noun: str) -> str:
    """Why a call is refused after an earlier one failed (the torch face's words)."""
    return unusable(f"{what} refused: an earlier collective failed ({failure})", noun)


def unusable_because(subject: str, failure: str) -> str:
    """Why a Communicator refuses every call after a failure (the public API's words)."""
    return (f"{subject} is unusable: {failure}. See Note [A failed communicator stays failed]: build a new "
            "communicator (restart the ranks from the last checkpoint)")


@dataclass(frozen=True)
class Face:
    """What a runner's errors look like to the face that owns it: the noun of its messages ("process
    group", "communicator"), an error class per Kind (`error` for FAILED, LOST and a refusal), and what a
    waiter's own timeout means: `wait_fails` (the public API: a wait that runs out fails the runner and
    raises `timeout_error`) or not (torch's: Work.wait(timeout) is the caller's patience, and the call
    goes on to its own deadline)."""
    noun: str
    error: Callable[[str], BaseException]
    timeout_error: Callable[[str], BaseException]
    mismatch_error: Callable[[str], BaseException]
    wait_fails: bool

    def error_for(self, kind: Kind, text: str) -> BaseException:
        if kind is Kind.TIMEOUT:
            return self.timeout_error(text)
        if kind is Kind.MISMATCH:
            return self.mismatch_error(text)
        return self.error(text)


class LazyText:
    """A message written out on first use: `str(LazyText(fn, *args))` is `fn(*args)`, computed once (every
    collective carries the description of its call for errors; most never need it)."""

    __slots__ = ("_fn", "_args", "_text")

    def __init__(self, fn: Callable[..., str], *args: Any):
        self._fn, self._args, self._text = fn, args, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._fn(*self._args)
            self._fn = self._args = None
        return self._text

    def __add__(self, other: str) -> str:
        return str(self) + other


def describe_error(e: BaseException) -> str:
    return str(e).strip() or type(e).__name__
