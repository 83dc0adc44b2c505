"""The one executor (ncclavg/transport/executor.py, Note [One executor]) that the torch backend's lanes,
the channel's own calls and the local backend run their jobs on: order, inline when idle, the shared
count of a channel's lock, drain, close. Every wait here is bounded."""
import threading

from ncclavg import _C
from ncclavg.transport.executor import Executor


class Recording(Executor):
    def __init__(self, order=None):
        super().__init__("test-executor", order=order)
        self.ran, self.done = [], []

    def _run(self, job):
        self.ran.append((job[0], threading.get_ident()))
        return job[1]() if job[1] is not None else None

    def _finished(self, job, error):
        self.done.append((job[0], error))


def test_jobs_run_in_order_on_the_worker_and_inline_only_when_idle():
    ex = Recording()
    gate = threading.Event()
    me = threading.get_ident()
    assert ex.submit(("first", None), inline=True) is None      # idle: runs here, now
    assert ex.ran == [("first", me)] and ex.idle()
    assert ex.submit(("blocker", lambda: gate.wait(10)), inline=False) is None
    # queued behind the blocker although inline was asked: the order holds
    assert ex.submit(("second", None), inline=True) is None
    assert ex.submit(("third", None)) is None
    assert not ex.idle() and not ex.drain(0.05)
    gate.set()
    assert ex.drain(10)
    assert [name for name, _ in ex.ran] == ["first", "blocker", "second", "third"]
    assert {t for name, t in ex.ran if name != "first"} != {me}
    assert [name for name, _ in ex.done] == ["first", "blocker", "second", "third"]
    assert ex.close(10)


def test_an_error_is_handed_on_and_the_next_jobs_still_run():
    seen = []
    boom = RuntimeError("boom")

    def fails():
        seen.append("fails")
        raise boom

    class Finished(Executor):
        def _finished(self, job, error):
            seen.append(error)

    ex = Finished("with-finish")
    ex.submit(fails)
    ex.submit(lambda: seen.append("next"))
    assert ex.drain(10)
    assert seen == ["fails", boom, "next", None]
    assert ex.close(10)


def test_close_refuses_new_jobs_and_lets_the_queued_ones_run():
    ex = Recording()
    gate = threading.Event()
    ex.submit(("blocker", lambda: gate.wait(10)))
    ex.submit(("queued", None))
    assert ex.close(0.05) is False          # the worker is still in the blocker
    assert ex.submit(("late", None)) == "test-executor is closed"
    gate.set()
    assert ex.drain(10)
    assert [name for name, _ in ex.ran] == ["blocker", "queued"]


def test_a_channel_lock_counts_the_jobs_of_every_executor_sharing_it():
    order = _C.ShmExec()
    a, b = Recording(order), Recording(order)
    gate = threading.Event()
    counts = []
    a.submit(("blocker", lambda: gate.wait(10)))
    b.submit(("behind", lambda: counts.append(order.outstanding)), inline=True)   # not inline: a's job counts
    assert order.outstanding == 2
    gate.set()
    assert a.drain(10) and b.drain(10)
    assert order.outstanding == 0 and counts == [1]
    me = threading.get_ident()
    b.submit(("now", None), inline=True)   # nothing outstanding anywhere: inline
    assert b.ran[-1] == ("now", me)
    assert a.close(10) and b.close(10)
