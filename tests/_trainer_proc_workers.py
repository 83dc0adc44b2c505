"""Bodies of the multi-process TowerTrainer tests (spawned children import this module)."""
import hashlib
import os

import torch

from _dist_util import init_rank

DATA = {"even": (96, 24), "uneven": (101, 23)}


def digits_loader(data, seed=3):
    from ncclavg.train.data import TensorLoader, load_digits

    n, bs = DATA[data]
    d = load_digits()
    return TensorLoader(d.x_train[:n], d.y_train[:n], batch_size=bs, seed=seed)


def fingerprint(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_job(rank, world, port, counts, hp, master, data, steps, out_dir, shard=False, overlap=True):
    """Trains the digits MLP with counts[rank] CPU towers in this process; rank 0 saves what the test
    compares. Checks in every process: replicas identical to the master, bit for bit, in every process."""
    init_rank(rank, world, port)
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    # a different init seed per process: the trainer must start every process from rank 0's weights
    tr = TowerTrainer(build_model("mlp", seed=rank), devices=["cpu"] * counts[rank], master=master,
                      timeout=60, shard_master=shard, overlap=overlap, **hp)
    assert tr.describe()["shard_master"] == shard
    assert (tr.processes, tr.rank, tr.total_towers, tr.num_towers) == (world, rank, sum(counts), counts[rank])
    assert tr.tower_offset == sum(counts[:rank])
    records = []

    from ncclavg.train.callbacks import Callback

    class Recorder(Callback):
        def on_step_end(self, trainer, record):
            records.append(record)

    tr.fit(digits_loader(data), epochs=100, max_steps=steps, callbacks=[Recorder()])
    got = tr.master_params()
    for t in range(tr.num_towers):
        assert all(torch.equal(p.detach().float(), m) for p, m in zip(tr.tower_params[t], got)), t
    prints = tr.comm.allgather_object(fingerprint(got))
    assert len(set(prints)) == 1, f"processes hold different master weights: {prints}"
    state = tr.state_dict()   # a collective with sharded masters: the moments are gathered
    if rank == 0:
        torch.save({"master": got, "state": state, "records": [{k: r[k] for k in ("loss", "accuracy", "samples")} for r in records]},
                   os.path.join(out_dir, "result.pt"))
    tr.close()


def trainer_peer_lost(rank, world, port, out_dir, victim, how, timeout):
    """TowerTrainer over `world` processes (1 CPU tower each) saving a checkpoint every 2 steps; at step 5
    `victim` SIGKILLs or SIGSTOPs itself. Every survivor reports the error it got and how long it took."""
    import signal
    import time
    import traceback

    from _fault_util import report
    from ncclavg.train.callbacks import Callback, CheckpointCallback
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    init_rank(rank, world, port, timeout_s=120)   # gloo's own timeout far above ours: ours must fire
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], timeout=timeout, lr=1e-3)
    t0 = []

    class Die(Callback):
        def on_step_end(self, trainer, record):
            if trainer.step == 5:
                t0.append(time.monotonic())
                if rank == victim:
                    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

    saver = CheckpointCallback(os.path.join(out_dir, "ck"), every_epochs=None, every_steps=2)
    try:
        tr.fit(digits_loader("even"), epochs=50, callbacks=[saver, Die()])
        fields = {"type": "no error"}
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        fields = {"type": type(e).__name__, "msg": str(e), "elapsed": time.monotonic() - t0[0],
                  "trace": traceback.format_exc()[-1500:]}
    report(out_dir, rank, **fields)
    os._exit(1 if fields["type"] != "no error" else 0)


def debug_replicas_job(rank, world, port, out_dir):
    """NCCLAVG_DEBUG's replica check after every step: silent while the processes agree,
    ReplicaMismatchError on every process once rank 1's master copy drifted."""
    from _fault_util import report
    from ncclavg.errors import ReplicaMismatchError
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    init_rank(rank, world, port)
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu"], timeout=60)
    tr.comm.debug = True
    batches = iter(digits_loader("even"))
    tr.train_step(next(batches))   # agree: no error
    if rank == 1:
        with torch.no_grad():
            tr.engine.master.flat[0][0] += 1.0
    try:
        tr.train_step(next(batches))
        outcome = "no error"
    except ReplicaMismatchError as e:
        outcome = str(e)
    report(out_dir, rank, outcome=outcome, checks=tr.replica_checks)
