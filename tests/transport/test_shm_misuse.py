"""The shared-memory channel under misuse and hostile surroundings: a second process claiming a rank, a
forked child, another user, a creator killed during setup, pid reuse, other pid namespaces, a peer that
is late for long. Each case once went wrong (a wrong result without an error, a hang until the
deadline, a leftover, a live job's segment deleted); each must now fail cleanly or not at all."""
import os
import shutil
import subprocess
import sys
import time

import _transport_shm_misuse_workers as workers
import _transport_shm_workers
import pytest
import torch.multiprocessing as mp
from _transport_shm_util import channel_name, left_behind, run

from ncclavg import _C

HERE = os.path.dirname(os.path.abspath(__file__))   # the channel's workers live beside this file
SLOT = 64 << 10
needs_root_unshare = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                        reason="needs root and unshare (a new pid namespace)")


@pytest.mark.slow   # ~4 s
def test_a_second_process_cannot_take_a_joined_rank_and_a_forked_child_cannot_use_its_parents():
    out = run(workers.impostor_joins, 4, SLOT, expect=8, gate=True)
    by = dict((m[0], m[1]) for m in out)
    # the impostor (rank 3 of the harness) asked for rank 1, which had joined: refused by rank 0's door
    assert by[3].startswith("RuntimeError") and "refused rank 1: rank 1 has joined already" in by[3], by[3]
    # the real ranks' first and last collectives are exact: 1 + 2 + 3, then 3 x 6
    assert by[0] == by[1] == by[2] == [6.0] * 4 and by[20] == by[21] == by[22] == [18.0] * 4, by
    # the forked child of rank 1 was refused before touching the round
    assert by[10].startswith("RuntimeError") and "belongs to pid" in by[10] and "forked child" in by[10], by[10]


@pytest.mark.slow   # ~5 s
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_is_refused():
    out = run(workers.other_user_joins, 2, SLOT)
    text = out[1][1]
    assert text.startswith("RuntimeError") and "refused rank 1: it belongs to user 0, not to user 65534" in text, text


@pytest.mark.slow   # ~6 s
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_user_is_refused_from_a_private_checkout(tmp_path):
    """The same, with the package and the tests in a directory only root may enter (a checkout in root's
    0700 home): the process that drops to nobody must need nothing from there afterwards. Its Python
    starts without site (-S), so that no installed copy of the package can stand in for the private one."""
    import ncclavg
    import torch

    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    shutil.copytree(os.path.dirname(ncclavg.__file__), home / "ncclavg")
    # the module of the installed ncclavg's torch.backends entry point, which `import torch` loads: from
    # this copy too (an editable install's finder is not active under -S)
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(ncclavg.__file__)), "_ncclavg_autoload.py"), home)
    (home / "tests").mkdir()
    for name in ("_transport_shm_misuse_workers.py", "_transport_shm_workers.py", "_transport_shm_util.py"):
        shutil.copy(os.path.join(HERE, name), home / "tests" / name)
    site = os.path.dirname(os.path.dirname(torch.__file__))   # torch and numpy, readable by everyone
    code = (f"import sys; sys.path[:0] = [{str(home)!r}, {str(home / 'tests')!r}]; sys.path.append({site!r})\n"
            "import _transport_shm_misuse_workers as w\nfrom _transport_shm_util import run\n"
            f"print(run(w.other_user_joins, 2, {SLOT})[1][1])\n")
    # from a directory without the package: sys.path[0] is the working directory
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "refused rank 1: it belongs to user 0, not to user 65534" in res.stdout, res.stdout + res.stderr[-2000:]


def test_a_creator_killed_during_setup_leaves_nothing_behind():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = channel_name()
    shm_before = set(os.listdir("/dev/shm"))
    p = ctx.Process(target=workers.creator_killed, args=(0, 2, name, SLOT, q))
    p.start()
    try:
        assert q.get(timeout=60)[1] == "created"
        assert left_behind(name), "the door should be open while the creator lives"
    finally:
        p.kill()   # SIGKILL: no destructor, no cleanup of any kind
        p.join(30)
    assert set(os.listdir("/dev/shm")) <= shm_before, "a name appeared in /dev/shm"
    assert not left_behind(name)
    with pytest.raises(RuntimeError, match="no door is open"):
        _C.ShmChannel(name, 1, 2, SLOT, 1234)


def test_each_rank_reserves_its_own_slots():
    out = run(workers.first_touch, 2, SLOT, gate=True)
    before, after = out[0][1]
    assert before == [2 * SLOT, 0], before   # rank 0 did not allocate rank 1's slots ...
    assert after == [2 * SLOT, 2 * SLOT], after   # ... rank 1 did, when it joined


@pytest.mark.slow   # ~4 s of a peer held back while the waiter's CPU time is read
def test_a_waiting_rank_sleeps():
    # Rank 1 waits 3 s for rank 0. Spinning 50 us, yielding until 1 ms, then a futex sleep woken at least
    # every 100 ms for the liveness check: about 30 wake-ups of ~0.1 ms, a few ms of CPU in all. The
    # bound, 1% of the wait (30 ms), is the target; a waiter that polls with short sleeps instead (as
    # this channel did: 5-7% of a core) or spins (100%) fails it.
    out = run(_transport_shm_workers.waits_idle, 2, SLOT, 3.0)
    _, cpu, switches, wall = out[1]
    assert wall >= 2.5, wall
    assert cpu < 0.01 * wall, f"rank 1 used {cpu * 1e3:.1f} ms of CPU while waiting {wall:.1f} s"
    assert switches >= 1, switches


@needs_root_unshare
def test_a_reused_pid_is_not_taken_for_the_peer():
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                           os.path.join(HERE, "_transport_shm_pid_reuse.py"), channel_name()],
                          capture_output=True, text=True, timeout=180)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, proc.stdout + proc.stderr
    _, reused, elapsed, text = line.split(" ", 3)
    if reused != "True":
        pytest.skip("another process took the pid first (the namespace was not quiet)")
    # found by the 100 ms liveness check, not by the 20 s deadline
    assert "rank 1 stopped responding" in text and "exited" in text, text
    assert float(elapsed) < 10.0, elapsed


@pytest.mark.slow   # ~7 s: a whole job in a new pid namespace
@needs_root_unshare
def test_a_job_in_another_pid_namespace_leaves_this_one_alone():
    # Containers that share /dev/shm but not their pid namespace once removed each other's segments
    # (judging "dead" by pid). A job here sets up; a whole job runs in a new pid namespace meanwhile;
    # this job goes on.
    ctx = mp.get_context("spawn")
    q, gate = ctx.Queue(), ctx.Event()
    name = channel_name()
    procs = [ctx.Process(target=workers.long_job, args=(r, 2, name, SLOT, q, gate)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert q.get(timeout=60)[1] == "ready"
        other = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                                f"import sys; sys.path.insert(0, {HERE!r}); import _transport_shm_misuse_workers as w; "
                                f"w.namespace_job({channel_name()!r}, {SLOT})"],
                               capture_output=True, text=True, timeout=120)
        assert "JOB [(0, [3.0, 3.0, 3.0]), (1, [3.0, 3.0, 3.0])]" in other.stdout, other.stdout + other.stderr
        gate.set()
        results = sorted(q.get(timeout=60) for _ in range(2))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [r[1] for r in results] == [[6.0] * 3, [6.0] * 3], results
    assert not left_behind(name)


def test_heartbeat_keys_agree_between_ranks_that_build_different_groups():
    from ncclavg.transport import liveness

    saved = dict(liveness._SEQ)
    try:
        # rank 0 builds a communicator over {0, 1}, then one over every rank; rank 2 builds only the second
        liveness._SEQ.clear()
        first_on_0 = (liveness._next_index("0,1"), liveness._next_index("world"))
        liveness._SEQ.clear()
        first_on_2 = liveness._next_index("world")
        assert first_on_0[1] == first_on_2 == 0
        assert liveness._next_index("world") == 1   # a second one over the same ranks: its own keys
    finally:
        liveness._SEQ.clear()
        liveness._SEQ.update(saved)


def test_a_forked_child_can_drop_its_copy_of_an_open_channel():
    # Rank 0's door is served by a thread; a child forked meanwhile (a DataLoader worker, say) has a copy
    # of the channel object but not the thread, and must be able to destroy it without std::terminate.
    ch = _C.ShmChannel(channel_name(), 0, 2, SLOT, 1)
    pid = os.fork()
    if pid == 0:
        try:
            del ch
            os._exit(0)
        except BaseException:   # noqa: BLE001
            os._exit(3)
    deadline = time.monotonic() + 30   # joining the absent thread would hang the child: bounded here
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    ch.close_door()
    assert done[0] == pid and os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0, done
