"""What the replica check costs (Note [The replica check] in ncclavg/transport/replicas.py).

    python bench/replica_check.py                    # -> bench/results/replica_check-<machine>-<date>.{json,md}
    python bench/replica_check.py --sizes 4M --steps 100

1. The digest pass (`_C.digest`, Note [Replica digest]) over buffers of --sizes bytes, against the torch
   ways of fingerprinting the same bytes: torch.hash_tensor (torch's one-pass hash of a tensor, XOR of the
   bits: no order, so two swapped values are not seen) on the bytes viewed as int64, and hashlib.blake2b
   of the bytes (what a hand-rolled check does; one thread), and against the read bandwidth of the same
   run: torch.sum over the bytes viewed as float32 (one read-only pass, every thread). Timed in
   interleaved rounds, medians; every row gives GB/s and its ratio to the read pass.
2. The check inside training: `ncclavg train`'s default job (the digits MLP, two CPU towers, batch 64)
   for --steps steps with the check off, then the check itself (check_tower_replicas, both rounds'
   work: the towers' and the master's digests, a one-process exchange) timed alone; its share of the
   step time at the default interval (TowerTrainer's replica_check_every=100), and its cost per
   parameter byte.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import median_seconds  # noqa: E402
from ncclavg import _C  # noqa: E402

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "128M": 128 << 20}


def digest_rows(sizes, rounds: int) -> list:
    rows = []
    for name in sizes:
        nbytes = SIZES[name] if name in SIZES else int(name)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        as64, as32 = data.view(torch.int64), data.view(torch.float32)
        spans = [(data.data_ptr(), nbytes)]
        contenders = {
            "ncclavg digest": lambda: _C.digest(spans),
            "torch.hash_tensor": lambda: torch.hash_tensor(as64),
            "hashlib.blake2b": lambda: hashlib.blake2b(data.numpy(), digest_size=8).digest(),
            "read (torch.sum)": lambda: as32.sum(),
        }
        for fn in contenders.values():
            fn()
        times = {k: [] for k in contenders}
        for _ in range(rounds):   # interleaved: every contender once per round
            for k, fn in contenders.items():
                times[k].append(median_seconds(fn, reps=1, warmup=0))
        med = {k: statistics.median(v) for k, v in times.items()}
        read_gbs = nbytes / med["read (torch.sum)"] / 1e9
        for k, t in med.items():
            gbs = nbytes / t / 1e9
            rows.append({"size": name, "bytes": nbytes, "contender": k, "ms": t * 1e3, "GB_s": gbs,
                         "of_read": gbs / read_gbs, "vs_ncclavg": med["ncclavg digest"] / t})
    return rows


def training_row(steps: int) -> dict:
    from ncclavg.train.data import TensorLoader, load_digits
    from ncclavg.train.distributed import check_tower_replicas
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    d = load_digits()
    tr = TowerTrainer(build_model("mlp", seed=0), devices=["cpu", "cpu"], replica_check_every=0)
    loader = TensorLoader(d.x_train, d.y_train, batch_size=64, seed=0)
    batches = iter(loader)
    step_s = []
    for i in range(steps + 5):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        rec = tr.train_step(batch)
        if i >= 5:   # warm-up
            step_s.append(rec["step_s"])
    check_tower_replicas(tr)
    check_s = median_seconds(lambda: check_tower_replicas(tr), reps=50, warmup=0)
    param_bytes = sum(p.numel() * p.element_size() for tower in tr.tower_params for p in tower)
    param_bytes += sum(f.numel() * f.element_size() for f in tr.engine.master.flat)
    step = statistics.median(step_s)
    tr.close()
    return {"steps": steps, "step_ms": step * 1e3, "check_ms": check_s * 1e3, "digested_bytes": param_bytes,
            "ns_per_byte": check_s / param_bytes * 1e9, "interval": 100,
            "share_at_default_interval": check_s / (100 * step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M,128M", help="buffer sizes: 1M, 16M, 128M or bytes")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per size")
    ap.add_argument("--steps", type=int, default=200, help="training steps timed")
    ap.add_argument("--out", type=Path, default=None, help="results stem (default bench/results/replica_check-...)")
    args = ap.parse_args()
    cpu = platform.processor() or platform.machine()
    print(f"threads={torch.get_num_threads()} simd={_C.simd_level()} cpu={cpu}", flush=True)
    rows = digest_rows(args.sizes.split(","), args.rounds)
    for r in rows:
        print(f"{r['size']:>5} {r['contender']:<18} {r['ms']:9.3f} ms {r['GB_s']:7.2f} GB/s  "
              f"{r['of_read']:5.2f} of the read pass  ncclavg's time / its {r['vs_ncclavg']:5.2f}", flush=True)
    train = training_row(args.steps)
    print(f"ncclavg train's default job: step {train['step_ms']:.2f} ms, check {train['check_ms']:.3f} ms "
          f"({train['digested_bytes']} bytes digested, {train['ns_per_byte']:.3f} ns/byte): "
          f"{train['share_at_default_interval']:.4%} of the step time every {train['interval']} steps", flush=True)
    stem = args.out or ROOT / "bench" / "results" / f"replica_check-{_dt.date.today().isoformat()}"
    result = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
              "threads": torch.get_num_threads(), "simd": _C.simd_level(), "digest": rows, "train": train,
              "command": " ".join(["python", "bench/replica_check.py", *sys.argv[1:]])}
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {stem}.json", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
