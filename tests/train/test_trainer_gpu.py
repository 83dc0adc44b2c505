"""TowerTrainer on GPUs: towers on every visible GPU against a CPU reference, both master kinds, resume,
amp, and `ncclavg train` defaulting to the GPUs; and several towers sharing cuda:0 (the local backend's
average kernel, no NCCL) through the same paths: master="cpu" (the offload pipeline), master="device",
amp bf16 / fp16, and `ncclavg train --devices cuda:0,cuda:0`. Skipped with the reason where there is no
CUDA device, no CUDA build or (for the NCCL tests) no NCCL; nothing here touches a GPU at import."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.gpu


def gpu_devices() -> list:
    import ncclavg
    from ncclavg import _ext

    if not ncclavg.cuda_built():
        pytest.skip("this build of ncclavg has no CUDA part")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not ncclavg.cuda_available():
        pytest.skip("no CUDA device visible")
    if not _ext.nccl_info()["loaded"]:
        pytest.skip("no NCCL library found")
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _data():
    from ncclavg.train.data import load_digits

    s = load_digits()
    return s.x_train[:101], s.y_train[:101]


def _reference(opt_kw, steps, arch="mlp", batch_size=23, seed=3, grad_clip=None, chunks=1, device="cpu"):
    """Plain single-model torch training on `device`, each batch's gradient accumulated over `chunks` slices
    (weighted by their share of the batch, the towers' split); CPU copies of the final params."""
    import torch
    from torch import nn

    from ncclavg.train.data import TensorLoader
    from ncclavg.train.models import build_model
    from ncclavg.train.towers import split_sizes

    model = build_model(arch, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=opt_kw["lr"], momentum=0.9, nesterov=True) \
        if opt_kw["optimizer"] == "sgd" else torch.optim.AdamW(model.parameters(), lr=opt_kw["lr"], weight_decay=0.0)
    n = 0
    loader = TensorLoader(*_data(), batch_size=batch_size, seed=seed)
    while n < steps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            lo = 0
            for size in split_sizes(len(y), chunks):
                if size:
                    (nn.functional.cross_entropy(model(x[lo:lo + size]), y[lo:lo + size]) * (size / len(y))).backward()
                lo += size
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            n += 1
            if n == steps:
                break
    return [p.detach().cpu().clone() for p in model.parameters()]


def _rel_distance(got, want):
    """The largest, over parameter tensors, L2 norm of the difference over the norm of `want`."""
    return max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, want))


def _noise_floor(want, gpu, **kw):
    """Note [Tolerance of training equivalence tests] (tests/train/test_trainer.py): the largest distance from
    the CPU reference `want` of equally valid float32 runs of the same training: the batch's gradient in 2, 3
    and 4 slices on the CPU, and the whole batch on one GPU (its matmuls sum in another order); never below
    one fp32 ulp (2^-23 relative)."""
    runs = [_reference(chunks=c, **kw) for c in (2, 3, 4)] + [_reference(device=gpu, **kw)]
    return max(2.0 ** -23, max(_rel_distance(r, want) for r in runs))


def _train_like_the_reference(devices, master, opt_kw, check=None):
    """Trains the digits MLP for 10 steps on `devices`; every tower then holds the master weights on its
    device, and the master is one more float32 run of the reference's training: within 2 noise floors of
    it (Note [Tolerance of training equivalence tests]). `check(trainer)` runs before training."""
    import torch

    from ncclavg.train.data import TensorLoader
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    want = _reference(opt_kw, 10)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        floor = _noise_floor(want, devices[0], opt_kw=opt_kw, steps=10)
        with TowerTrainer(build_model("mlp", seed=0), devices=devices, master=master, **opt_kw) as tr:
            if check is not None:
                check(tr)
            tr.fit(TensorLoader(*_data(), batch_size=23, seed=3), epochs=10, max_steps=10)
            got = tr.master_params()
            for t, dev in enumerate(devices):
                assert all(p.device == torch.device(dev) for p in tr.tower_params[t])
                assert all(torch.equal(p.detach().cpu().float(), m) for p, m in zip(tr.tower_params[t], got))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert _rel_distance(got, want) <= 2 * floor, (_rel_distance(got, want), floor)


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("opt_kw", [dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True),
                                    dict(optimizer="adamw", lr=3e-3, weight_decay=0.0)])
def test_gpu_towers_match_cpu_single_tower(master, opt_kw):
    _train_like_the_reference(gpu_devices(), master, opt_kw)


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_gpu_resume_continues_the_run(tmp_path, master):
    import torch

    from ncclavg.train.data import TensorLoader
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    devices = gpu_devices()
    cfg = dict(devices=devices, master=master, optimizer="adamw", lr=3e-3, grad_clip=1.0)
    # float32 convolutions and matmuls (no TF32): the runs below are float32 runs of one training
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        full = TowerTrainer(build_model("cnn", seed=0), **cfg)
        full.fit(TensorLoader(*_data(), batch_size=20, seed=1), epochs=5, max_steps=8)
        part = TowerTrainer(build_model("cnn", seed=0), **cfg)
        part.fit(TensorLoader(*_data(), batch_size=20, seed=1), epochs=5, max_steps=4)
        path = part.save(str(tmp_path / "g.ckpt"))
        resumed = TowerTrainer.load(path, build_model("cnn", seed=9), devices=devices)
        resumed.fit(TensorLoader(*_data(), batch_size=20, seed=1), epochs=5, max_steps=8)
        kw = dict(opt_kw=dict(optimizer="adamw", lr=3e-3), steps=8, arch="cnn", batch_size=20, seed=1, grad_clip=1.0)
        want = _reference(**kw)
        floor = _noise_floor(want, devices[0], **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
    # Bit for bit where the GPU kernels are deterministic; GPU reductions (atomics) need not be. Both are
    # float32 runs of the same 8 steps, each within 2 noise floors of the reference (Note [Tolerance of
    # training equivalence tests]), so within 4 floors of each other (triangle inequality).
    assert _rel_distance(full.master_params(), resumed.master_params()) <= 4 * floor
    for tr in (full, part, resumed):
        tr.close()


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_gpu_amp_learns(master, amp):
    from ncclavg.train.data import TensorLoader, load_digits
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    devices = gpu_devices()
    s = load_digits()
    with TowerTrainer(build_model("cnn", seed=0), devices=devices, master=master, amp=amp, lr=3e-3) as tr:
        hist = tr.fit(TensorLoader(s.x_train, s.y_train, batch_size=64, seed=0), epochs=3)
        ev = tr.evaluate(TensorLoader(s.x_test, s.y_test, batch_size=256, shuffle=False))
    assert hist[-1]["loss"] < hist[0]["loss"] and ev["accuracy"] > 0.9


def test_gpu_train_cli_defaults_to_all_gpus(capsys):
    from ncclavg.cli import main

    devices = gpu_devices()
    assert main(["train", "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"summary: test_accuracy=(\d\.\d{3}) epochs=\d+ samples_per_s=[\d.]+ wall_s=[\d.]+ "
                 r"processes=1 towers=(\d+) devices=(\S+)$", last)
    assert m, last
    assert float(m.group(1)) >= 0.95
    assert int(m.group(2)) == len(devices) and m.group(3) == ",".join(devices)


# ---------------------------------------------------------------- several towers sharing one GPU
def one_gpu() -> str:
    """cuda:0 when this build and torch can use it (no NCCL needed: towers on one GPU average locally)."""
    import ncclavg

    if not ncclavg.cuda_built():
        pytest.skip("this build of ncclavg has no CUDA part")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not ncclavg.cuda_available():
        pytest.skip("no CUDA device visible")
    return "cuda:0"


@pytest.mark.parametrize("master", ["cpu", "device"])
def test_towers_sharing_one_gpu_match_cpu_single_tower(master):
    """The towers (3 slices of 8/8/7 of each batch on one GPU, averaged in float32 with their weights, see
    Note [Uneven batches]) are one more float32 run of the same training."""
    def local_backend(tr):
        assert (tr.engine.comm.backend, tr.engine.comm.size) == ("local", 3)

    _train_like_the_reference([one_gpu()] * 3, master, dict(optimizer="adamw", lr=3e-3, weight_decay=0.0),
                              check=local_backend)


@pytest.mark.parametrize("master", ["cpu", "device"])
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_towers_sharing_one_gpu_learn(master, amp):
    from ncclavg.train.data import TensorLoader, load_digits
    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    gpu = one_gpu()
    s = load_digits()
    with TowerTrainer(build_model("cnn", seed=0), devices=[gpu] * 2, master=master, amp=amp, lr=3e-3) as tr:
        assert tr.engine.comm.backend == "local"
        hist = tr.fit(TensorLoader(s.x_train, s.y_train, batch_size=64, seed=0), epochs=3)
        ev = tr.evaluate(TensorLoader(s.x_test, s.y_test, batch_size=256, shuffle=False))
    # No equivalence bound holds for 16-bit autocast (every matmul rounds differently); the thresholds are
    # test_gpu_amp_learns's: the loss falls and 3 epochs reach > 0.9 test accuracy (a broken average or
    # loss scale stays near the 0.1 of chance).
    assert hist[-1]["loss"] < hist[0]["loss"] and ev["accuracy"] > 0.9


def test_train_cli_two_towers_on_one_gpu(capsys):
    from ncclavg.cli import main

    gpu = one_gpu()
    assert main(["train", "--devices", f"{gpu},{gpu}", "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.match(r"summary: test_accuracy=(\d\.\d{3}) epochs=\d+ samples_per_s=[\d.]+ wall_s=[\d.]+ "
                 r"processes=1 towers=(\d+) devices=(\S+)$", last)
    assert m, last
    # the default digits demo, as test_gpu_train_cli_defaults_to_all_gpus: >= 0.95 on the held-out fifth
    assert float(m.group(1)) >= 0.95
    assert int(m.group(2)) == 2 and m.group(3) == f"{gpu},{gpu}"


def test_a_failed_cpu_master_step_breaks_the_pipeline_for_good():
    """Note [A failed CPU master step]: a bucket's update that raises ends the step with that error, and
    the next step raises naming it instead of consuming the failed step's leftover work."""
    import torch

    from ncclavg.train.models import build_model
    from ncclavg.train.trainer import TowerTrainer

    gpu = one_gpu()
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    with TowerTrainer(build_model("mlp", seed=0), devices=[gpu] * 2, master="cpu", bucket_cap_mb=0.01) as tr:
        tr.train_step((x, y))
        engine = tr.engine   # the GpuOffloadEngine (master="cpu" on CUDA towers)
        assert len(engine.plan.buckets) >= 3, "the MLP must span several buckets"
        real = engine.master.step

        def fail_second_bucket(*args, bucket, **kwargs):
            if bucket == 1:
                raise OSError("injected in bucket 1")
            return real(*args, bucket=bucket, **kwargs)

        engine.master.step = fail_second_bucket
        with pytest.raises(OSError, match="injected in bucket 1"):
            tr.train_step((x, y))
        engine.master.step = real
        with pytest.raises(RuntimeError, match=r"failed in an earlier step \(bucket 1 of \d+: OSError: injected"):
            tr.train_step((x, y))
