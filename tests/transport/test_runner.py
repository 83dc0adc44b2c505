"""The one runner of both faces (ncclavg/transport/runner.py, Note [One runner], Note [One deadline per
call]) and its Works (transport/work.py): order, inline only when idle, the order lock the fast paths
take, a failure told by type (Note [Failures are told by type]) that fails the runner and every later
call in its face's words, the watchdog that ends a job at its deadline, a public API waiter that gives up,
close. Every wait here is bounded."""
import threading
import time

import pytest

from ncclavg import _C, errors
from ncclavg.comm.base import FACE as API
from ncclavg.process_group.face import FACE as TORCH
from ncclavg.transport.runner import Job, Runner


def job(name, ran, body=None, timeout=10.0):
    def run(j):
        ran.append((name, threading.get_ident()))
        if body is not None:
            body()
    return Job(run, name, timeout)


class Switch:
    def __init__(self):
        self.off = False

    def disable(self):
        self.off = True


class Heartbeats:
    """What a runner asks of the heartbeats: who was lost (recorded in `asked`), and to say it is alive."""

    def __init__(self, asked, words=" (rank 1 stopped responding: heartbeat stopped)"):
        self.asked, self.words, self.marked = asked, words, 0

    def diagnose(self):
        self.asked.append(1)
        return self.words

    def mark_failed(self):
        self.marked += 1


class FakeChannel:
    """What the watchdog needs of a transport: abort() ends the running body, stalled_on() names a rank."""

    names_peers = True

    def __init__(self):
        self.aborted = threading.Event()
        self.why = None
        self.closed = False

    def abort(self, why, mismatch=False):
        self.why = (why, mismatch)
        self.aborted.set()

    def stalled_on(self):
        return " (rank 1 stopped responding: it has not reached this collective on the channel)"

    def close(self):
        self.closed = True


def test_jobs_run_in_order_and_inline_only_when_idle():
    r = Runner("test-runner", TORCH)
    ran, gate, me = [], threading.Event(), threading.get_ident()
    r.submit(job("first", ran), inline=True).wait()          # idle: here, now
    assert ran == [("first", me)] and r.idle()
    r.submit(job("blocker", ran, lambda: gate.wait(10)))
    w2 = r.submit(job("second", ran), inline=True)           # queued behind the blocker although inline was asked
    w3 = r.submit(job("third", ran))
    assert r.order.outstanding == 3 and not r.drain(0.05)
    assert not r.acquire_idle()                               # the fast paths' rule: nothing outstanding
    gate.set()
    w2.wait(), w3.wait()
    assert [n for n, _ in ran] == ["first", "blocker", "second", "third"]
    assert {t for n, t in ran if n != "first"} != {me}
    assert r.drain(10) and r.order.outstanding == 0
    assert r.acquire_idle()                                   # free now: the caller holds the lock
    r.order.release()
    assert r.acquire_idle(lambda wait_s: False) is False      # an asynchronous call whose peers are not there
    assert r.close(10)


def test_an_asynchronous_call_whose_peers_wait_runs_here():
    r = Runner("test-runner", TORCH)
    ran, me = [], threading.get_ident()
    looked = []
    w = r.submit(job("async", ran), ready=lambda wait_s: looked.append(wait_s) or True)
    assert w.done() and ran == [("async", me)] and looked and looked[0] > 0
    w = r.submit(job("queued", ran), ready=lambda wait_s: False)
    w.wait()
    assert ran[-1][0] == "queued" and ran[-1][1] != me
    assert r.close(10)


@pytest.mark.parametrize("face", [TORCH, API], ids=["torch", "api"])
@pytest.mark.parametrize("raised, kind, named", [
    (_C.ShmMismatchError("collectives out of step: rank 0 called a, rank 1 called b"), "mismatch", True),
    (_C.ShmPeerError("shared-memory all_reduce: rank 1 stopped responding (pid 7): its process exited"), "failed", True),
    (_C.ShmTimeoutError("shared-memory all_reduce timed out after 2 s: rank 1 stopped responding"), "timeout", True),
    (RuntimeError("Connection closed by peer"), "failed", False),
])
def test_a_failure_is_told_by_type_and_fails_every_later_call(face, raised, kind, named):
    asked = []
    r = Runner("test-runner", face, liveness=Heartbeats(asked))
    fast = Switch()
    r.fast_paths.append(fast)

    def boom():
        raise raised

    w = r.submit(job("ncclavg allreduce of 4 x float32", [], boom), inline=True)
    with pytest.raises(Exception) as got:
        w.wait()
    want = {"mismatch": face.mismatch_error, "timeout": face.timeout_error, "failed": face.error}[kind]
    assert type(got.value) is type(want("")), got.value
    text = str(got.value)
    assert text.startswith("ncclavg allreduce of 4 x float32") and str(raised) in text
    assert text.endswith(f"the {face.noun} is unusable now")
    assert bool(asked) == (not named)   # the heartbeats are asked only when the error names nobody
    assert ("heartbeat stopped" in text) == (not named)
    assert fast.off and r.failure is not None and r.failure in text
    assert r.liveness.marked == 1   # alive, failed: a slower survivor must not name this rank
    later = r.submit(job("ncclavg broadcast", []), inline=True)
    with pytest.raises(face.error) as refused:
        later.wait()
    assert "broadcast" in str(refused.value) and r.failure in str(refused.value)
    assert r.close(10)


def test_a_bad_argument_found_in_a_job_leaves_the_runner_usable():
    r = Runner("test-runner", TORCH)

    def bad():
        raise ValueError("root: must be a rank of the group")

    with pytest.raises(ValueError, match="root"):
        r.submit(job("x", [], bad), inline=True).wait()
    assert r.failure is None
    r.submit(job("y", []), inline=True).wait()
    assert r.close(10)


def test_the_watchdog_ends_a_job_at_its_deadline_naming_the_rank_it_waits_for():
    channel = FakeChannel()
    r = Runner("test-runner", TORCH, transport=channel, liveness=Heartbeats([], ""))

    def stuck():
        assert channel.aborted.wait(20), "the watchdog never aborted the channel"
        raise _C.ShmPeerError("shared-memory all_reduce: aborted by this process")

    t0 = time.monotonic()
    w = r.submit(Job(lambda j: stuck(), "ncclavg allreduce of 3 x float32", 0.3), inline=True)
    elapsed = time.monotonic() - t0
    with pytest.raises(errors.BackendTimeoutError) as got:
        w.wait()
    assert elapsed >= 0.3   # not before its deadline
    text = str(got.value)
    assert "did not complete within 0.3 s: the group's timeout expired" in text
    assert "rank 1 stopped responding" in text and "aborted by this process" not in text   # the watchdog's words
    assert channel.why[0] in text and channel.why[1] is False
    assert r.close(10) and channel.closed


def test_a_public_api_waiter_gives_up_for_good_and_a_torch_waiter_only_for_itself():
    for face in (API, TORCH):
        r = Runner("test-runner", face)
        r.alone = face is API   # as the local backend's: the queued job still runs
        gate = threading.Event()
        r.submit(job("blocker", [], lambda: gate.wait(20)))
        w = r.submit(job("local all_reduce_avg of 40 bytes", []))
        t0 = time.monotonic()
        with pytest.raises(face.timeout_error) as got:
            w.wait(0.05)
        assert time.monotonic() - t0 < 10
        if face is API:   # the waiter's timeout plus SLACK_S, then the runner fails naming the call
            assert "local all_reduce_avg of 40 bytes did not complete within 0.05 s" in str(got.value)
            assert r.failure is not None and "did not complete within 0.05 s" in r.failure
        else:             # torch's wait(timeout) is the caller's patience: the call goes on
            assert "gave up after 0.05 s" in str(got.value) and r.failure is None
        gate.set()
        w.wait(20)        # the job itself runs to completion either way
        assert w.done() and w.is_success()
        assert r.close(10)


def test_close_refuses_new_jobs_after_the_queued_ones_ran():
    r = Runner("test-runner", TORCH)
    ran, gate = [], threading.Event()
    r.submit(job("blocker", ran, lambda: gate.wait(10)))
    queued = r.submit(job("queued", ran))
    threading.Timer(0.1, gate.set).start()
    assert r.close(10)
    assert queued.done() and [n for n, _ in ran] == ["blocker", "queued"]
    late = r.submit(job("late", ran))
    with pytest.raises(errors.BackendError, match="late: the process group was shut down"):
        late.wait()


def test_a_job_past_its_deadline_before_a_step_says_so():
    r = Runner("test-runner", API)

    def late_step(j):
        time.sleep(0.06)
        j.remaining()   # a step that would start past the deadline

    w = r.submit(Job(late_step, "gloo broadcast_tensors", 0.05), inline=True)
    with pytest.raises(errors.CommTimeoutError, match="gloo broadcast_tensors did not complete within 0.05 s: the "
                                                      "communicator's timeout expired; the communicator is unusable now"):
        w.wait()
