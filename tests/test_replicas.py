"""The replica check (Note [The replica check] in ncclavg/transport/replicas.py): the native digest against
a NumPy reference of Note [Replica digest], the comparison's verdicts and texts, TowerTrainer's periodic
check in one process, and ncclavg.ddp.check_replicas over torch.distributed with two processes."""
import numpy as np
import pytest
import torch

from _dist_util import init_rank, run_ranks
from ncclavg import _C
from ncclavg.errors import ReplicaMismatchError
from ncclavg.transport.replicas import Replica, check_replicas

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _splitmix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _reference_digest(data: bytes) -> int:
    """Note [Replica digest], written from its text with Python's integers (exact, reduced mod 2^64)."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8")
    s = 0
    for i, w in enumerate(words.tolist()):
        s = (s + _splitmix((w + (i + 1) * GOLDEN) & M64)) & M64
    return _splitmix(s ^ _splitmix(len(data)))


def _digest(t: torch.Tensor) -> int:
    b = t.contiguous().view(torch.uint8)
    return _C.digest([(b.data_ptr(), b.numel())])[0]


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 15, 16, 17, 4096 + 3, 300_001])
def test_the_digest_is_the_notes_formula(nbytes):
    # 300 001 bytes is past the native pass's threading threshold: the threads' slices must add up to the
    # same sum (a sum mod 2^64 is exact in any order, so equality is the test, no tolerance)
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    t = torch.from_numpy(data.copy())
    assert _digest(t) == _reference_digest(data.tobytes())


def test_one_changed_bit_anywhere_and_two_swapped_words_change_the_digest():
    x = torch.randn(5004, dtype=torch.float32)
    base = _digest(x)
    for where in (0, 1, 2500, 5003):
        y = x.clone()
        y.view(torch.int32)[where] ^= 1   # the lowest mantissa bit
        assert _digest(y) != base, where
    y = x.clone().view(torch.int64)
    y[[3, 7]] = y[[7, 3]]
    assert _digest(y) != base
    zero = torch.zeros(4)
    assert _digest(zero) != _digest(-zero)   # bits, not values: -0.0 is another replica's byte


def test_the_combined_digest_depends_on_the_parts_order():
    a, b = torch.randn(10), torch.randn(12)
    spans = [(a.data_ptr(), a.nbytes), (b.data_ptr(), b.nbytes)]
    ab, ba = _C.digest(spans), _C.digest(spans[::-1])
    assert ab[:2] == ba[:2][::-1] and ab[2] != ba[2]
    with pytest.raises(ValueError, match="spans"):
        _C.digest([(0, 8)])


def _run_all(processes, on_mismatch="raise"):
    """check_replicas on every pretend process, rounds in lockstep: returns each process's outcome."""
    import threading

    n = len(processes)
    rounds: dict = {}
    barrier = threading.Barrier(n)
    outcomes = [None] * n

    def body(p):
        count = [0]

        def allgather(obj):
            k = count[0]
            count[0] += 1
            rounds.setdefault(k, [None] * n)[p] = obj
            barrier.wait(timeout=10)
            return list(rounds[k])

        try:
            outcomes[p] = check_replicas(processes[p], allgather, p, on_mismatch)
        except ReplicaMismatchError as e:
            outcomes[p] = e

    threads = [threading.Thread(target=body, args=(p,)) for p in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return outcomes


def _tower(label, tensors):
    return Replica(label, "tower", tensors, [f"w{i}" for i in range(len(tensors))])


def test_agreeing_replicas_pass_and_one_drifted_is_named_with_its_first_part_on_every_process():
    w = [torch.randn(33), torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(7, dtype=torch.float16)]
    same = [[_tower("tower 0", [t.clone() for t in w])] for _ in range(4)]
    assert _run_all(same) == [None] * 4
    drifted = [[_tower("tower 0", [t.clone() for t in w])] for _ in range(4)]
    drifted[2][0].parts[1][3, 1] += 1
    out = _run_all(drifted)
    for p, e in enumerate(out):
        assert isinstance(e, ReplicaMismatchError), (p, e)
        assert f"(this is rank {p})" in str(e)
        assert "rank 2 tower 0 differs from rank 0 tower 0, rank 1 tower 0, rank 3 tower 0: first at part 1 (w1)" in str(e)


def test_a_replica_that_differs_in_several_parts_is_named_at_its_first_and_warn_returns_the_text():
    w = [torch.randn(8) for _ in range(3)]
    procs = [[_tower("tower 0", [t.clone() for t in w]), _tower("tower 1", [t.clone() for t in w])] for _ in range(2)]
    procs[1][1].parts[2][0] += 1
    procs[1][1].parts[1][0] += 1
    out = _run_all(procs, on_mismatch="warn")
    for p in range(2):
        assert isinstance(out[p], str) and "rank 1 tower 1 differs from" in out[p] and "first at part 1 (w1)" in out[p]


def test_kinds_are_compared_apart_and_bad_arguments_are_refused():
    w = torch.randn(6)
    procs = [[_tower("tower 0", [w.clone()]), Replica("master weights", "master", [w.clone() + p], ["b0"])]
             for p in range(2)]
    out = _run_all(procs)
    assert all(isinstance(e, ReplicaMismatchError) for e in out)
    assert "rank 1 master weights differs from rank 0 master weights: first at part 0 (b0)" in str(out[0])
    assert "tower" not in str(out[0]).split(": the replicas differ")[1]
    with pytest.raises(ValueError, match="on_mismatch"):
        check_replicas([], lambda obj: [obj], 0, "ignore")
    with pytest.raises(ValueError, match="names"):
        Replica("x", "tower", [w], [])


# ---------------------------------------------------------------------- TowerTrainer, one process
def _trainer(**kw):
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    return TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], **kw)


def _batches(n=4):
    from ncclavg.train.data import TensorLoader, load_digits

    d = load_digits()
    return iter(TensorLoader(d.x_train[:64 * n], d.y_train[:64 * n], batch_size=64, seed=0))


@pytest.mark.parametrize("amp", [None, "bf16", "fp16"])
def test_the_trainer_checks_its_replicas_every_n_steps_and_they_agree_with_every_dtype(amp):
    tr = _trainer(amp=amp, replica_check_every=2)
    batches = _batches()
    records = [tr.train_step(next(batches)) for _ in range(4)]
    assert tr.replica_checks == 2
    assert [r.get("replicas_checked", False) for r in records] == [False, True, False, True]


def test_the_trainer_names_a_drifted_tower_and_its_parameter():
    tr = _trainer(replica_check_every=1)
    batches = _batches()
    tr.train_step(next(batches))
    with torch.no_grad():
        tr.tower_params[1][2].view(-1)[0] += 1.0
    name = tr.names[2]
    # one more step: the CPU master's copy-out rewrites every tower from the master, so the drift must be
    # checked before it: the check itself, as the trainer runs it
    from ncclavg.train.distributed import check_tower_replicas

    with pytest.raises(ReplicaMismatchError, match=rf"rank 0 tower 1 differs from rank 0 tower 0: first at part 2 \({name}\)"):
        check_tower_replicas(tr)
    assert "tower 1" in check_tower_replicas(tr, "warn")


def test_the_trainer_refuses_a_bad_interval_or_policy():
    with pytest.raises(ValueError, match="replica_check_every"):
        _trainer(replica_check_every=-1)
    with pytest.raises(ValueError, match="on_replica_mismatch"):
        _trainer(on_replica_mismatch="ignore")


# ---------------------------------------------------------------------- stock DDP, two processes
def _ddp_job(rank, world, port, out_dir):
    import json
    import os

    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ncclavg.ddp
    from ncclavg.errors import ReplicaMismatchError

    init_rank(rank, world, port)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    outcome = {"agree": ncclavg.ddp.check_replicas(model, buffers=True)}
    if rank == 1:
        with torch.no_grad():
            model.module[2].bias[1] += 1e-3
    try:
        ncclavg.ddp.check_replicas(model, step=7)
        outcome["drift"] = "no error"
    except ReplicaMismatchError as e:
        outcome["drift"] = str(e)
    outcome["warn"] = ncclavg.ddp.check_replicas(model, on_mismatch="warn")
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump(outcome, f)


def test_stock_ddp_replicas_are_checked_across_processes(tmp_path):
    import json

    run_ranks(_ddp_job, 2, args=(str(tmp_path),), timeout_s=120)
    for r in range(2):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["agree"] is None, got
        assert got["drift"].startswith(f"the replica check at step 7: the replicas differ (this is rank {r})"), got
        assert "rank 1 model differs from rank 0 model: first at part 3 (module.2.bias)" in got["drift"], got
        assert "module.2.bias" in got["warn"], got


# ---------------------------------------------------------------------- TowerTrainer, 2 x 2 pretend hosts
def _hosts_trainer_job(rank, world, port, layout, out_dir):
    import json
    import os

    import ncclavg.comm.gloo as gloo_backend
    from ncclavg.errors import ReplicaMismatchError
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    init_rank(rank, world, port)
    gloo_backend.host_identity = lambda: f"test-host-{layout[rank]}"   # 2 x 2 hosts: lanes between them
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], timeout=60, replica_check_every=1)
    batches = _batches()
    tr.train_step(next(batches))
    tr.train_step(next(batches))   # two checks passed
    last = len(tr.engine.master.flat) - 1
    changed = next(sl for sl in tr.plan.slots if sl.bucket == last and sl.offset <= 7 < sl.offset + sl.numel)
    if rank == 2:
        with torch.no_grad():
            tr.engine.master.flat[last][7] += 1.0   # element 7 of the master's last bucket
    try:
        tr.train_step(next(batches))
        outcome = "no error"
    except ReplicaMismatchError as e:
        outcome = str(e)
    with open(os.path.join(out_dir, f"r{rank}.json"), "w") as f:
        json.dump({"outcome": outcome, "checks": tr.replica_checks, "transport": tr.comm.transport,
                   "bucket": last, "param": changed.index, "name": tr.names[changed.index]}, f)


@pytest.mark.slow
def test_a_changed_master_on_one_of_2x2_hosts_is_named_with_its_bucket_on_every_rank(tmp_path):
    import json

    run_ranks(_hosts_trainer_job, 4, args=([0, 0, 1, 1], str(tmp_path)), timeout_s=180)
    for r in range(4):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        out = got["outcome"]
        assert got["checks"] == 3 and got["transport"].startswith("shm+"), got
        assert out.startswith(f"the replica check after step 3: the replicas differ (this is rank {r}): "), out
        assert "rank 2 master weights differs from rank 0 master weights, rank 1 master weights, rank 3 master " \
               f"weights: first at part {got['bucket']} (master bucket {got['bucket']})" in out, out
        # the tower's weights are copied from the changed master: the parameter holding that element
        assert "rank 2 tower 2 differs from rank 0 tower 0, rank 1 tower 1, rank 3 tower 3: first at part " \
               f"{got['param']} ({got['name']})" in out, out
