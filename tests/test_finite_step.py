"""The finiteness of the averaged gradients, noted by the passes that wrote them (Note [Finiteness of the
averaged gradients] in ncclavg/averager.py), and the steps that use it: MasterWeights.step and
CPUAdamW / CPUSGD(skip_nonfinite=True) with grads_finite=..., against the scan they replace.

A NaN, +inf or -inf planted in any tower, any bucket, first or last element, fp32 / bf16 / fp16 gradients,
or two large finite values whose float32 sum overflows: the averager says False, and a step given that
answer (or given nothing: the scan) is skipped with every weight, moment and count bit-identical. Clean
gradients: the step given True is bit-identical to the step that scanned."""
from __future__ import annotations

import itertools

import pytest
import torch

import ncclavg
from ncclavg import GradientAverager, MasterWeights
from ncclavg.optim import CPUAdamW, CPUSGD

SHAPES = [(37,), (5, 7), (300,), (3,), (129,)]   # odd sizes; with a 1 KiB cap several buckets
PLANTS = [float("nan"), float("inf"), float("-inf")]
NTOWERS = 3


def make_towers(dtype: torch.dtype, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    return [[torch.nn.Parameter(x.clone().to(dtype)) for x in init] for _ in range(NTOWERS)]


def grads_of(dtype: torch.dtype, seed: int) -> list:
    gen = torch.Generator().manual_seed(100 + seed)
    return [[(torch.randn(s, generator=gen) * 1e-2).to(dtype) for s in SHAPES] for _ in range(NTOWERS)]


def backward(towers: list, grads: list) -> None:
    """Each tower's gradient becomes grads[t] (d/dp sum(p * g) = g), written by autograd into the views."""
    for ps, gs in zip(towers, grads):
        sum((p * g).sum() for p, g in zip(ps, gs)).backward()


def averaged(dtype: torch.dtype, grads: list, cap_mb: float = 0.001) -> tuple:
    towers = make_towers(dtype)
    avg = GradientAverager(ncclavg.Communicator.local(NTOWERS), towers, bucket_cap_mb=cap_mb,
                           first_bucket_mb=cap_mb)
    backward(towers, grads)
    avg.average()
    return avg, towers


def master_of(avg: GradientAverager, towers: list, kind: str = "adamw") -> MasterWeights:
    return MasterWeights([p.detach().float() for p in towers[0]], plan=avg.plan, optimizer=kind, pin=False)


def master_state(mw: MasterWeights) -> list:
    keys = ("momentum_buffer",) if mw.kind == "sgd" else ("exp_avg", "exp_avg_sq")
    return [t.clone() for t in mw.flat] + [t.clone() for k in keys for t in getattr(mw, k)] + [list(mw.steps)]


def same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def storages(avg: GradientAverager) -> list:
    return [[avg.bucket_storage(t, b) for b in range(len(avg.plan.buckets))] for t in range(NTOWERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_clean_gradients_say_finite_and_step_as_the_scan_does(simd_level, dtype):
    grads = grads_of(dtype, 1)
    avg, towers = averaged(dtype, grads)
    assert len(avg.plan.buckets) > 2
    assert avg.bucket_finite == [True] * len(avg.plan.buckets) and avg.grads_finite is True
    for kind in ("adamw", "sgd"):
        flagged, scanned = master_of(avg, towers, kind), master_of(avg, towers, kind)
        for mw, known in ((flagged, True), (scanned, None)):
            info = mw.step(storages(avg), grads_finite=known)
            assert not info["skipped"]
        assert same(master_state(flagged), master_state(scanned)), kind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_value_in_any_tower_and_bucket_skips_the_step(dtype, plant):
    bucket_count = None
    for tower, index, last in itertools.product(range(NTOWERS), range(len(SHAPES)), (False, True)):
        grads = grads_of(dtype, 2)
        g = grads[tower][index].view(-1)
        g[g.numel() - 1 if last else 0] = plant
        avg, towers = averaged(dtype, grads)
        bucket_count = len(avg.plan.buckets)
        bucket = avg.plan.slots[index].bucket
        assert avg.grads_finite is False
        assert [f is False for f in avg.bucket_finite] == [b == bucket for b in range(bucket_count)]
        for known in (avg.grads_finite, None):   # the flag, and the scan it replaces
            mw = master_of(avg, towers)
            before = master_state(mw)
            info = mw.step(storages(avg), grads_finite=known)
            assert info["skipped"], (tower, index, last, known)
            assert same(before, master_state(mw)), (tower, index, last, known)
    assert bucket_count > 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_average_that_overflows_skips_although_no_tower_holds_an_inf(dtype):
    """Two large finite values in two towers: their float32 sum is inf, so is the mean. The towers' own
    gradients are all finite: only a check of what the average wrote (or of the averaged storage) sees it."""
    grads = grads_of(dtype, 3)
    for t in (0, 1):
        grads[t][2].view(-1)[-1] = 3e38
    assert all(bool(torch.isfinite(g).all()) for row in grads for g in row)
    avg, towers = averaged(dtype, grads)
    assert avg.grads_finite is False
    for known in (False, None):
        mw = master_of(avg, towers)
        before = master_state(mw)
        assert mw.step(storages(avg), grads_finite=known)["skipped"]
        assert same(before, master_state(mw))


def test_float16_towers_cannot_overflow_their_average():
    """float16's largest value in every tower: the float32 sum holds it, the mean is finite again."""
    grads = grads_of(torch.float16, 4)
    for t in range(NTOWERS):
        grads[t][0].view(-1)[0] = 65504.0
    avg, _ = averaged(torch.float16, grads)
    assert avg.grads_finite is True


def optimizer_state(opt: torch.optim.Optimizer, params: list) -> list:
    out = [p.detach().clone() for p in params]
    for p in params:
        for k, v in sorted(opt.state.get(p, {}).items()):
            out.append(v.clone() if isinstance(v, torch.Tensor) else v)
    return out


@pytest.mark.parametrize("cls", [CPUAdamW, CPUSGD])
def test_cpu_optimizers_use_the_flag_and_stay_exact(simd_level, cls):
    kw = {"lr": 1e-2, "momentum": 0.9} if cls is CPUSGD else {"lr": 1e-2}
    # clean: the flagged step equals the scanned one, bit for bit, state included
    avg, towers = averaged(torch.float32, grads_of(torch.float32, 5))
    runs = []
    for known in (True, None):
        params = [torch.nn.Parameter(p.detach().clone()) for p in towers[0]]
        for p, q in zip(params, towers[0]):
            p.grad = q.grad   # the averager's views
        opt = cls(params, skip_nonfinite=True, **kw)
        info = opt.step(grads_finite=known)
        assert not info["skipped"] and info["grad_norm"] is not None
        runs.append((optimizer_state(opt, params), info["grad_norm"]))
    assert same(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    # a NaN in tower 2: skipped with the flag and with the scan, after a clean step (state to keep)
    grads = grads_of(torch.float32, 6)
    grads[2][1].view(-1)[3] = float("nan")
    avg, towers = averaged(torch.float32, grads)
    assert avg.grads_finite is False
    for known in (False, None):
        params = [torch.nn.Parameter(p.detach().clone()) for p in towers[0]]
        opt = cls(params, skip_nonfinite=True, **kw)
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        assert not opt.step()["skipped"]
        for p, q in zip(params, towers[0]):
            p.grad = q.grad   # the averager's views
        before = optimizer_state(opt, params)
        assert opt.step(grads_finite=known)["skipped"], known
        assert same(before, optimizer_state(opt, params)), known


def test_the_flag_is_forgotten_by_zero_grad_and_by_the_next_backward():
    grads = grads_of(torch.float32, 7)
    towers = make_towers(torch.float32)
    avg = GradientAverager(ncclavg.Communicator.local(NTOWERS), towers, bucket_cap_mb=0.001, first_bucket_mb=0.001)
    backward(towers, grads)
    avg.average()
    assert avg.grads_finite is True
    backward(towers, grads)   # a new backward: the hooks reset it
    assert avg.grads_finite is None and avg.bucket_finite == [None] * len(avg.plan.buckets)
    avg.average()
    assert avg.grads_finite is True
    avg.zero_grad()
    assert avg.grads_finite is None


def test_cast_buckets_flag_the_narrowing_and_the_unpacked_grads():
    """grad_dtype=bfloat16 for float32 parameters: a float32 gradient above bfloat16's range becomes inf in
    the bucket (the pack rounds it), the mean is inf, and the unpack into the float32 .grad says so."""
    towers = make_towers(torch.float32)
    avg = GradientAverager(ncclavg.Communicator.local(NTOWERS), towers, bucket_cap_mb=0.001, first_bucket_mb=0.001,
                           grad_dtype=torch.bfloat16)
    grads = grads_of(torch.float32, 8)
    backward(towers, grads)
    avg.average()
    assert avg.grads_finite is True
    grads[0][4].view(-1)[0] = 3.3961776e38   # bfloat16's overflow limit: rounds to inf
    backward(towers, grads)
    avg.average()
    assert avg.grads_finite is False and not bool(torch.isfinite(towers[1][4].grad).all())


def test_grads_finite_is_validated():
    avg, towers = averaged(torch.float32, grads_of(torch.float32, 9))
    mw = master_of(avg, towers)
    with pytest.raises(TypeError, match="grads_finite: expected a bool or None, got int"):
        mw.step(storages(avg), grads_finite=1)
    opt = CPUAdamW([torch.nn.Parameter(torch.zeros(3))], skip_nonfinite=True)
    with pytest.raises(TypeError, match="grads_finite: expected a bool or None, got str"):
        opt.step(grads_finite="yes")
