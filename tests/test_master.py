"""ncclavg.MasterWeights: bucket-aligned fp32 master copy, fused tower averaging + step + copy-out."""
import copy
import math
from dataclasses import dataclass

import pytest
import torch

import ncclavg
from ncclavg import BucketPlan, MasterWeights
from optim_reference import bits_equal, rel_err
from test_optim import Fp32Bound, assert_matches_torch, f64_resumed, f64_twin

SHAPES = [(3, 5), (17,), (100, 3), (1,), (16, 16), (4097,), (2, 7, 9)]


@dataclass
class FakeSlot:
    bucket: int
    offset: int
    numel: int
    shape: tuple


@dataclass
class FakeBucket:
    numel: int


class FakePlan:
    """A hand-made layout with odd padding: the interface MasterWeights needs from a BucketPlan."""

    def __init__(self, shapes, per_bucket=3, pad=5):
        self.slots, self.buckets = [], []
        for start in range(0, len(shapes), per_bucket):
            off = pad
            for s in shapes[start:start + per_bucket]:
                n = math.prod(s)
                self.slots.append(FakeSlot(len(self.buckets), off, n, tuple(s)))
                off += n + pad
            self.buckets.append(FakeBucket(off))


def make_params(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def tower_grads(plan, towers, dtype, gen):
    """grads[t][b]: flat bucket gradients (zero padding) and the per-parameter float64-mean reference."""
    grads = []
    for _ in range(towers):
        row = [torch.zeros(b.numel, dtype=dtype) for b in plan.buckets]
        for s in plan.slots:
            row[s.bucket][s.offset:s.offset + s.numel] = torch.randn(s.numel, generator=gen).to(dtype)
        grads.append(row)
    mean = []
    for s in plan.slots:
        parts = torch.stack([grads[t][s.bucket][s.offset:s.offset + s.numel].double() for t in range(towers)])
        mean.append(parts.mean(0).float().view(s.shape))
    return grads, mean


def torch_twin(params):
    return [torch.nn.Parameter(p.clone()) for p in params]


@pytest.mark.parametrize("kind,torch_cls,hp", [
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("adam", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
])
@pytest.mark.parametrize("plan_kind,dtype,towers", [("fake", torch.bfloat16, 4), ("real", torch.float32, 3),
                                                    ("none", torch.float16, 1), ("real", torch.bfloat16, 2)])
def test_20_steps_match_torch_on_float64_mean(kind, torch_cls, hp, plan_kind, dtype, towers):
    params = make_params(1)
    plan = {"fake": FakePlan(SHAPES), "real": BucketPlan.build(params, bucket_cap_mb=0.01, first_bucket_mb=0.001),
            "none": None}[plan_kind]
    mw = MasterWeights(params, plan, optimizer=kind, **hp)
    ref, ref64 = torch_twin(params), f64_twin(params)
    # float64: see Note [Running error bound of a float32 optimizer] in test_optim.py
    opt, opt64 = torch_cls(ref, **hp), Fp32Bound(torch_cls(ref64, **hp))
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        grads, mean = tower_grads(mw.plan, towers, dtype, gen)
        info = mw.step(grads)
        assert not info["skipped"]
        for r, r64, g in zip(ref, ref64, mean):
            r.grad, r64.grad = g, g.double()
        opt.step()
        opt64.step()
    assert_matches_torch(mw.param_views(), ref, ref64, opt64.bound(ref64))
    assert mw.steps == [20] * mw.num_buckets


def test_default_layout_is_one_bucket_of_aligned_slots():
    params = make_params(3)
    mw = MasterWeights(params)
    assert len(mw.flat) == 1 and mw.flat[0].dtype == torch.float32
    for s in mw.plan.slots:
        assert (s.offset * 4) % 256 == 0
    for v, p in zip(mw.param_views(), params):
        assert torch.equal(v, p) and v.data_ptr() >= mw.flat[0].data_ptr()
    assert not mw.flat[0].is_pinned()  # no CUDA here: pin=None means unpinned
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin"):
            MasterWeights(params, pin=True)


def test_master_copy_of_low_precision_params():
    params = [p.to(torch.bfloat16) for p in make_params(4)]
    mw = MasterWeights(params, BucketPlan.build(params))
    for v, p in zip(mw.param_views(), params):
        assert v.dtype == torch.float32 and torch.equal(v, p.float())


def test_fused_copy_out_and_copy_out():
    params = make_params(5)
    plan = FakePlan(SHAPES)
    mw = MasterWeights(params, plan, lr=1e-2)
    gen = torch.Generator().manual_seed(6)
    grads, _ = tower_grads(plan, 2, torch.bfloat16, gen)
    outs = [torch.empty(b.numel, dtype=torch.bfloat16) for b in plan.buckets]
    mw.step(grads, out=outs)
    for o, f in zip(outs, mw.flat):
        assert bits_equal(o, f.to(torch.bfloat16))
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        for o, f in zip(mw.copy_out(dt), mw.flat):
            assert bits_equal(o, f.to(dt))
    one = mw.copy_out(torch.float16, bucket=1)
    assert len(one) == 1 and bits_equal(one[0], mw.flat[1].half())
    with pytest.raises(ValueError, match="out\\[0\\]"):
        mw.copy_out(out=[torch.empty(3)], bucket=0)


def test_bucket_by_bucket_equals_all_at_once():
    params = make_params(7)
    plan = FakePlan(SHAPES)
    a = MasterWeights(params, plan, lr=1e-2)
    b = MasterWeights(params, plan, lr=1e-2)
    gen = torch.Generator().manual_seed(8)
    same_clip, steps = True, 3
    for _ in range(steps):
        grads, _ = tower_grads(plan, 3, torch.bfloat16, gen)
        clip = a.step(grads, max_grad_norm=2.0)["clip_coef"]
        norm = math.sqrt(sum(b.grad_norm([g[k] for g in grads], bucket=k) ** 2 for k in range(b.num_buckets)))
        for k in range(b.num_buckets):
            out = torch.empty(plan.buckets[k].numel, dtype=torch.bfloat16)
            info = b.step([g[k] for g in grads], bucket=k, max_grad_norm=2.0, grad_norm=norm, out=out)
            assert info["steps"] == [b.steps[k]]
            assert bits_equal(out, b.flat[k].to(torch.bfloat16))
            same_clip = same_clip and info["clip_coef"] == clip
    # The two differ only in how the global norm is summed (float64, agreeing to ~1e-15), which is then
    # rounded to float32 for the clip factor: the same factor, hence the same float operations on every
    # element, unless the two norms straddle a float32 rounding boundary (chance ~1e-8 per step).
    if same_clip:
        assert all(bits_equal(x, y) for x, y in zip(a.flat, b.flat))
    else:  # factors 1-2 ulp apart: per step <= 1 ulp of |p| (the rounding of p + update) plus 2^-22 of
        # the update (< |p| / 2): 2^-22 relative per step
        assert all(rel_err(x, y) <= steps * 2.0 ** -22 for x, y in zip(a.flat, b.flat))
    with pytest.raises(ValueError, match="max_grad_norm"):
        b.step([g[0] for g in grads], bucket=0, max_grad_norm=1.0)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_in_one_tower_skips_and_changes_nothing(kind, bad):
    params = make_params(9)
    plan = FakePlan(SHAPES)
    mw = MasterWeights(params, plan, optimizer=kind, lr=1e-2, **({"momentum": 0.9} if kind == "sgd" else {}))
    gen = torch.Generator().manual_seed(10)
    grads, _ = tower_grads(plan, 4, torch.bfloat16, gen)
    mw.step(grads)
    before = copy.deepcopy(mw.state_dict())
    flat_before = [f.clone() for f in mw.flat]
    grads, _ = tower_grads(plan, 4, torch.bfloat16, gen)
    last = plan.slots[-1]
    grads[2][last.bucket][last.offset + last.numel - 1] = bad  # one tower, last element of the last param
    info = mw.step(grads, max_grad_norm=1.0)
    assert info["skipped"] and info["steps"] == [1] * mw.num_buckets
    for f, g in zip(mw.flat, flat_before):
        assert bits_equal(f, g)
    after = mw.state_dict()
    for i, st in before["optimizer"]["state"].items():
        for k, v in st.items():
            assert bits_equal(after["optimizer"]["state"][i][k], v)


def test_state_dict_interchange_with_torch_and_other_plans():
    params = make_params(11)
    mw = MasterWeights(params, FakePlan(SHAPES), lr=1e-2, amsgrad=True)
    gen = torch.Generator().manual_seed(12)
    for _ in range(4):
        grads, _ = tower_grads(mw.plan, 2, torch.float32, gen)
        mw.step(grads)
    sd = copy.deepcopy(mw.state_dict())
    # into torch.optim.AdamW over the saved params: the continuation matches
    ref = [torch.nn.Parameter(p.clone()) for p in sd["params"]]
    opt = torch.optim.AdamW(ref, lr=1e-2, amsgrad=True)
    opt.load_state_dict(copy.deepcopy(sd["optimizer"]))
    ref64, opt64 = f64_resumed(torch.optim.AdamW, sd["params"], sd["optimizer"], lr=1e-2, amsgrad=True)
    # into a MasterWeights with a different plan
    other = MasterWeights(make_params(99), BucketPlan.build(params, bucket_cap_mb=0.005), lr=5.0, amsgrad=True)
    other.load_state_dict(copy.deepcopy(sd))
    assert other.hp["lr"] == 1e-2 and set(other.steps) == {4}
    for _ in range(4):
        grads, mean = tower_grads(mw.plan, 1, torch.float32, gen)
        mw.step(grads)
        for r, r64, g in zip(ref, ref64, mean):
            r.grad, r64.grad = g, g.double()
        opt.step()
        opt64.step()
        flat = [torch.zeros(b.numel) for b in other.plan.buckets]
        for s, g in zip(other.plan.slots, mean):
            flat[s.bucket][s.offset:s.offset + s.numel] = g.reshape(-1)
        other.step([flat])
    bound = opt64.bound(ref64)  # Note [Running error bound of a float32 optimizer] in test_optim.py
    assert_matches_torch(mw.param_views(), ref, ref64, bound)
    assert_matches_torch(other.param_views(), ref, ref64, bound)
    # and back: a torch optimizer's state into a MasterWeights
    back = MasterWeights([r.detach() for r in ref], lr=1.0, amsgrad=True)
    back.load_state_dict({"params": [r.detach() for r in ref], "optimizer": opt.state_dict()})
    assert back.steps == [8]


def test_with_gradient_averager_storage():
    """Two CPU towers' bucket storages go straight into the fused average + step."""
    torch.manual_seed(13)
    model = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3))
    towers = [copy.deepcopy(model) for _ in range(2)]
    comm = ncclavg.Communicator.local(2)
    avg = ncclavg.GradientAverager(comm, towers, bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    mw = MasterWeights(list(model.parameters()), avg.plan, lr=1e-2)
    # The gradients come from the model, so rounding differences feed back through it: no running bound
    # (test_optim.py) follows that. A measured noise floor instead, as in Note [Tolerance of training
    # equivalence tests] (tests/train/test_trainer.py): the reference run again in float64 gives its own
    # float32 error, `floor`. The towers are one more float32 implementation (each sums its half's gradient,
    # then the two are averaged: another order than one backward of both losses), as far from the float64
    # run as the reference is (measured: equal to 3 digits), so within 2 floors of the reference (triangle
    # inequality); never below one fp32 ulp, 2^-23 relative. Over 60 seeds, with torch's default and AVX2
    # kernels: at most 0.51 of that. One tower's gradient instead of the mean moves params by ~lr = 1e-2.
    refs = [copy.deepcopy(model), copy.deepcopy(model).double()]
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-2) for r in refs]
    for _ in range(3):
        xs = [torch.randn(8, 10) for _ in towers]
        with avg.no_sync():
            for tw, x in zip(towers, xs):
                tw(x).square().mean().backward()
        storages = [[avg.bucket_storage(t, b) for b in range(len(avg.plan.buckets))] for t in range(2)]
        mw.step(storages)
        for ref, opt in zip(refs, opts):
            opt.zero_grad()
            losses = [ref(x.to(next(ref.parameters()).dtype)).square().mean() for x in xs]
            (sum(losses) / 2).backward()
            opt.step()
        for tw in towers:
            for p, v in zip(tw.parameters(), mw.param_views()):
                p.data.copy_(v)
        avg.zero_grad()
    ref, ref64 = (list(r.parameters()) for r in refs)
    floor = max(2.0 ** -23, max(rel_err(r, r64) for r, r64 in zip(ref, ref64)))
    for v, r in zip(mw.param_views(), ref):
        assert rel_err(v, r) <= 2 * floor, (rel_err(v, r), floor)
    avg.close()
    comm.close()


# ---- bad input

def test_bad_arguments():
    params = make_params(14)
    plan = FakePlan(SHAPES)
    with pytest.raises(ValueError, match="optimizer"):
        MasterWeights(params, optimizer="lamb")
    with pytest.raises(TypeError, match="momentum"):
        MasterWeights(params, optimizer="adamw", momentum=0.9)
    for hp, name in [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"), (dict(eps=0.0), "eps")]:
        with pytest.raises(ValueError, match=name):
            MasterWeights(params, **hp)
    with pytest.raises(ValueError, match="plan"):
        MasterWeights(params[:-1], plan)
    with pytest.raises(ValueError, match="params\\[0\\]"):
        MasterWeights([torch.zeros(4, 4)] + params[1:], plan)
    with pytest.raises(ValueError, match="params\\[1\\]"):
        MasterWeights([torch.zeros(1), torch.zeros(2, dtype=torch.int64)])
    mw = MasterWeights(params, plan)
    gen = torch.Generator().manual_seed(15)
    grads, _ = tower_grads(plan, 2, torch.float32, gen)
    flat_before = [f.clone() for f in mw.flat]
    bad_numel = [[g if k else g[:-1] for k, g in enumerate(row)] for row in grads]
    with pytest.raises(ValueError, match="tower_grads\\[0\\]\\[0\\]"):
        mw.step(bad_numel)
    bad_dtype = [[g.double() if t == 1 else g for g in row] for t, row in enumerate(grads)]
    with pytest.raises(ValueError, match="tower_grads\\[1\\]\\[0\\]"):
        mw.step(bad_dtype)
    with pytest.raises(ValueError, match="tower_grads\\[1\\]"):
        mw.step([grads[0], grads[1][:1]])
    with pytest.raises(ValueError, match="bucket"):
        mw.step(grads, bucket=7)
    with pytest.raises(ValueError, match="out"):
        mw.step(grads, out=[torch.empty(1)])
    mw.hp["lr"] = -0.5
    with pytest.raises(ValueError, match="lr"):
        mw.step(grads)
    mw.hp["lr"] = 1e-3
    for f, g in zip(mw.flat, flat_before):
        assert bits_equal(f, g)
    assert mw.steps == [0] * mw.num_buckets
    with pytest.raises(ValueError, match="state_dict"):
        mw.load_state_dict({"params": [torch.zeros(1)], "optimizer": {"state": {}, "param_groups": [{}]}})


def test_sgd_state_dict_into_torch_sgd():
    params = make_params(16)
    hp = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    mw = MasterWeights(params, FakePlan(SHAPES), optimizer="sgd", **hp)
    gen = torch.Generator().manual_seed(17)
    for _ in range(3):
        grads, _ = tower_grads(mw.plan, 2, torch.bfloat16, gen)
        mw.step(grads)
    sd = copy.deepcopy(mw.state_dict())
    ref = [torch.nn.Parameter(p.clone()) for p in sd["params"]]
    opt = torch.optim.SGD(ref, **hp)
    opt.load_state_dict(sd["optimizer"])
    ref64, opt64 = f64_resumed(torch.optim.SGD, sd["params"], sd["optimizer"], **hp)
    for _ in range(3):
        grads, mean = tower_grads(mw.plan, 2, torch.bfloat16, gen)
        mw.step(grads)
        for r, r64, g in zip(ref, ref64, mean):
            r.grad, r64.grad = g, g.double()
        opt.step()
        opt64.step()
    # Note [Running error bound of a float32 optimizer] in test_optim.py
    assert_matches_torch(mw.param_views(), ref, ref64, opt64.bound(ref64))


@pytest.mark.gpu
def test_pinned_storage_and_device_gradients():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    params = make_params(18)
    plan = FakePlan(SHAPES)
    mw = MasterWeights(params, plan, lr=1e-2)
    assert all(f.is_pinned() for f in mw.flat)
    ref = MasterWeights(params, plan, lr=1e-2, pin=False)
    gen = torch.Generator().manual_seed(19)
    grads, _ = tower_grads(plan, 2, torch.bfloat16, gen)
    mw.step([[g.cuda() for g in row] for row in grads])
    ref.step(grads)
    for a, b in zip(mw.flat, ref.flat):
        assert bits_equal(a, b)
    out = mw.copy_out(torch.bfloat16)
    assert all(o.is_pinned() for o in out)
