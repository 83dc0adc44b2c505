"""SIGKILL during TowerTrainer checkpoint saves, at random points (run as a script by
test_faults_checkpoint.py, with a hard timeout there).

    python _ckpt_kill_worker.py OUTDIR SEED TRIALS

1. Trains the uninterrupted reference run to STEPS steps and keeps a digest of the master weights
   after every step.
2. TRIALS times: forks a child that resumes from the newest complete checkpoint in OUTDIR/ckpt (or starts
   fresh), trains with a checkpoint after every step, and tells the parent through a pipe when each
   save() starts ('s') and returns ('e'). After a random number of saves the parent waits a random
   delay drawn from [0, measured save time) and SIGKILLs the child. Then it checks that the newest
   complete checkpoint loads, that its step never went backwards, and that its master weights are the
   reference run's at that step, bit for bit.
3. Resumes once more (in this process) and trains to STEPS: every step must match the reference.
Prints one JSON line with the findings. Forking (not spawning) keeps 20 trials cheap; the parent sets
OMP_NUM_THREADS=1 and never starts a thread pool before forking.
"""
import hashlib
import json
import os
import random
import select
import signal
import sys
import time
import traceback

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)

from ncclavg import TowerTrainer  # noqa: E402
from ncclavg.train import checkpoint as ckpt  # noqa: E402
from ncclavg.train.callbacks import Callback, CheckpointCallback  # noqa: E402
from ncclavg.train.data import TensorLoader  # noqa: E402

STEPS = 120


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 768), nn.Tanh(), nn.Linear(768, 256), nn.Tanh())
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(self.body(x))


def data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(400, 128, generator=g), torch.randint(0, 10, (400,), generator=g)


def loader():
    return TensorLoader(*data(), batch_size=16, seed=3)   # 25 batches per epoch


def digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def new_trainer():
    torch.manual_seed(0)
    return TowerTrainer(Net(), devices=["cpu", "cpu"], optimizer="adamw", lr=1e-3, lr_schedule="cosine",
                        weight_decay=0.01, seed=4, concurrent=False, bucket_cap_mb=0.5, first_bucket_mb=0.25)


class Digests(Callback):
    def __init__(self):
        self.by_step = {}

    def on_step_end(self, trainer, record):
        self.by_step[trainer.step] = digest(trainer.master_params())


def fit(trainer, callbacks):
    trainer.fit(loader(), epochs=STEPS // 25 + 1, max_steps=STEPS, callbacks=callbacks)


def child(ckdir, wfd):
    orig = ckpt.save

    def signalling_save(path, state):   # CheckpointManager.save calls the module-level save()
        os.write(wfd, b"s")
        out = orig(path, state)
        os.write(wfd, b"e")
        return out

    ckpt.save = signalling_save
    manager = ckpt.CheckpointManager(ckdir, keep=2)
    trainer = TowerTrainer.load(ckdir, Net()) if manager.latest() else new_trainer()
    fit(trainer, [CheckpointCallback(ckdir, every_epochs=None, every_steps=1, keep=2)])


def read_byte(fd, deadline):
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            b = os.read(fd, 1)
            return b or b""   # b"": the child closed the pipe (exited)


def main(outdir, seed, trials):
    rng = random.Random(seed)
    ckdir = os.path.join(outdir, "ckpt")
    os.makedirs(ckdir)
    ref = Digests()
    reference = new_trainer()
    fit(reference, [ref])
    # how long one save takes here: the range of the random kill delays
    t0 = time.perf_counter()
    for i in range(3):
        ckpt.save(os.path.join(outdir, f"calibrate{i}.ckpt"), reference.state_dict())
    save_s = (time.perf_counter() - t0) / 3
    reference.close()

    result = {"save_s": save_s, "trials": [], "errors": []}
    last_step = 0
    for trial in range(trials):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                child(ckdir, w)
            except BaseException:
                traceback.print_exc()
                code = 3
            os._exit(code)
        os.close(w)
        saves = rng.randint(1, 3)
        delay = rng.uniform(0.0, save_s)
        deadline = time.monotonic() + 60
        seen, events = 0, []
        while seen < saves:
            b = read_byte(r, deadline)
            if not b:
                break
            events.append(b.decode())
            seen += b == b"s"
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        while True:   # what the child managed to say before it died
            b = read_byte(r, time.monotonic() + 0.2)
            if not b:
                break
            events.append(b.decode())
        os.close(r)
        inside = events[-1] == "s" if events else False   # killed between a save's start and its return
        entry = {"trial": trial, "saves": saves, "delay": delay, "killed": os.WIFSIGNALED(status),
                 "inside_save": inside, "events": "".join(events)}
        try:
            # atomicity: no file under a final name is ever partial (latest() would hide it by falling back)
            for _, p in ckpt.CheckpointManager(ckdir, keep=2).list():
                try:
                    with open(p, "rb") as f:
                        ckpt.verify_bytes(f.read(), p)
                except ckpt.CheckpointError as e:
                    result["errors"].append(f"trial {trial}: a partial file under a final name: {e}")
            path = ckpt.CheckpointManager(ckdir, keep=2).latest()
            if path is None:
                entry["latest"] = None
            else:
                state = ckpt.load(path)
                step = int(state["step"])
                entry["latest"] = step
                entry["matches_reference"] = digest(state["master"]["params"]) == ref.by_step.get(step)
                if step < last_step:
                    result["errors"].append(f"trial {trial}: newest checkpoint went back from {last_step} to {step}")
                last_step = step
        except Exception as e:  # noqa: BLE001 - the test reports it
            result["errors"].append(f"trial {trial}: {type(e).__name__}: {e}")
        result["trials"].append(entry)

    # resume once more and finish: every step must be the reference's
    resumed = TowerTrainer.load(ckdir, Net())
    start = resumed.step
    digests = Digests()
    fit(resumed, [CheckpointCallback(ckdir, every_epochs=None, every_steps=10, keep=2), digests])
    result["final"] = {"start": start, "end": resumed.step,
                       "mismatched_steps": [s for s, d in digests.by_step.items() if ref.by_step.get(s) != d]}
    result["temps_left"] = sorted(n for n in os.listdir(ckdir) if ".tmp-" in n)
    result["files_left"] = sorted(n for n in os.listdir(ckdir) if ".tmp-" not in n)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
