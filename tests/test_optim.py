"""ncclavg.optim.CPUAdamW / CPUAdam / CPUSGD against torch.optim.AdamW / Adam / SGD."""
import copy
import math
import random

import pytest
import torch

from ncclavg.optim import CPUSGD, CPUAdam, CPUAdamW
from optim_reference import bits_equal, rel_err, simd_level, simd_levels

_rng = random.Random(2024)
SHAPES = [(3, 5), (17,), (300, 3), (1,), (16, 16), (4097,), (2, 7, 9)] + [
    tuple(_rng.randint(1, 40) for _ in range(_rng.randint(1, 3))) for _ in range(4)]


def make_params(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def twins(seed, shapes=SHAPES):
    a = make_params(seed, shapes)
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


def set_grads(pa, pb, gen, scale=1.0):
    for a, b in zip(pa, pb):
        g = torch.randn(a.shape, generator=gen) * scale
        a.grad = g.clone()
        b.grad = g.clone()


def assert_close_params(pa, pb, tol=1e-6):
    for a, b in zip(pa, pb):
        assert rel_err(a, b) < tol, (a.shape, rel_err(a, b))


ADAM_CASES = [
    (CPUAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (CPUAdamW, torch.optim.AdamW, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, amsgrad=True)),
    (CPUAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05)),
    (CPUAdam, torch.optim.Adam, dict(lr=1e-2, betas=(0.3, 0.9), maximize=True)),
    (CPUAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.0, 0.5), weight_decay=0.0)),
]
SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=1e-3, maximize=True),
]


@pytest.mark.parametrize("ours,theirs,kw", ADAM_CASES)
def test_adam_20_steps_match_torch(ours, theirs, kw):
    pa, pb = twins(1)
    a, b = ours(pa, **kw), theirs(pb, **kw)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        set_grads(pa, pb, gen)
        a.step()
        b.step()
    assert_close_params(pa, pb)
    for p, q in zip(pa, pb):
        assert a.state[p]["step"].item() == b.state[q]["step"].item() == 20
        assert rel_err(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"]) < 1e-6


def test_adam_fused_torch_too():
    pa, pb = twins(3)
    a, b = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        set_grads(pa, pb, gen)
        a.step()
        b.step()
    assert_close_params(pa, pb)


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_20_steps_match_torch(kw):
    pa, pb = twins(5)
    a, b = CPUSGD(pa, **kw), torch.optim.SGD(pb, **kw)
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        set_grads(pa, pb, gen)
        a.step()
        b.step()
    assert_close_params(pa, pb)
    if kw.get("momentum"):
        for p, q in zip(pa, pb):
            assert rel_err(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]) < 1e-6


def test_param_groups_scheduler_and_missing_grads():
    pa, pb = twins(7)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 5e-3, "weight_decay": 0.0}]  # noqa: E731
    a, b = CPUAdamW(groups(pa), lr=1e-2), torch.optim.AdamW(groups(pb), lr=1e-2)
    sa = torch.optim.lr_scheduler.OneCycleLR(a, max_lr=[0.05, 0.01], total_steps=20)
    sb = torch.optim.lr_scheduler.OneCycleLR(b, max_lr=[0.05, 0.01], total_steps=20)
    gen = torch.Generator().manual_seed(8)
    for step in range(20):
        set_grads(pa, pb, gen)
        if step % 3 == 0:  # a param without a gradient is left alone (and gets no state)
            pa[1].grad = pb[1].grad = None
        a.step()
        b.step()
        sa.step()
        sb.step()
    assert_close_params(pa, pb)
    assert a.param_groups[1]["lr"] == b.param_groups[1]["lr"]
    assert a.state[pa[1]]["step"].item() == b.state[pb[1]]["step"].item()


def test_grad_scale_and_clipping_match_torch_sequence():
    pa, pb = twins(9)
    a, b = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2)
    gen = torch.Generator().manual_seed(10)
    scale = 1024.0
    for _ in range(20):
        set_grads(pa, pb, gen, scale=scale)
        info = a.step(grad_scale=scale, max_grad_norm=5.0)
        inv = torch.tensor(1.0 / scale, dtype=torch.float32)
        for q in pb:  # GradScaler.unscale_, then clip_grad_norm_
            q.grad.mul_(inv)
        total = torch.nn.utils.clip_grad_norm_(pb, 5.0)
        b.step()
        assert info["grad_norm"] == pytest.approx(total.item(), rel=1e-5)
        assert not info["skipped"]
    assert_close_params(pa, pb)


def test_sgd_clipping_matches_torch():
    pa, pb = twins(11)
    a, b = CPUSGD(pa, lr=0.1, momentum=0.9, nesterov=True), torch.optim.SGD(pb, lr=0.1, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(12)
    for _ in range(20):
        set_grads(pa, pb, gen, scale=3.0)
        a.step(max_grad_norm=1.0)
        torch.nn.utils.clip_grad_norm_(pb, 1.0)
        b.step()
    assert_close_params(pa, pb)


def test_strided_grad_is_accepted():
    pa, pb = twins(22, [(1000, 3)])
    a, b = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2)
    g = torch.randn(3, 1000).t()  # same shape, column-major
    pa[0].grad, pb[0].grad = g, g.contiguous()
    a.step()
    b.step()
    assert_close_params(pa, pb)


def test_closure_returns_loss():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = CPUSGD([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 5.0
    assert torch.equal(p.detach(), torch.tensor([0.0, 0.0]))


@pytest.mark.parametrize("opt_cls,kw", [(CPUAdamW, dict(lr=1e-2)), (CPUAdamW, dict(lr=1e-2, amsgrad=True)),
                                        (CPUSGD, dict(lr=0.1, momentum=0.9))])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_nonfinite_grad_skips_step(opt_cls, kw, bad):
    pa = make_params(13)
    opt = opt_cls(pa, skip_nonfinite=True, **kw)
    gen = torch.Generator().manual_seed(14)
    for p in pa:
        p.grad = torch.randn(p.shape, generator=gen)
    pa[-1].grad.view(-1)[-1] = bad  # first step: state must not even be created
    info = opt.step()
    assert info["skipped"] and len(opt.state) == 0
    for p in pa:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    sd_before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in pa]
    pa[5].grad[4096] = bad  # the last element of a 4097-element param (the scalar tail)
    assert opt.step(max_grad_norm=1.0)["skipped"]
    for p, q in zip(pa, params_before):
        assert bits_equal(p.detach(), q)
    sd_after = opt.state_dict()
    for i, st in sd_before["state"].items():
        for k, v in st.items():
            assert bits_equal(sd_after["state"][i][k], v), k


@pytest.mark.parametrize("opt_cls,torch_cls,kw", [(CPUAdamW, torch.optim.AdamW, dict(lr=1e-2)),
                                                  (CPUSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9))])
def test_default_does_what_torch_does_with_a_nan(opt_cls, torch_cls, kw):
    # Off by default, as in torch.optim: the NaN reaches the parameter it belongs to, like torch's.
    ours, theirs = make_params(3), make_params(3)
    for p, q in zip(ours, theirs):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
        p.grad.view(-1)[0] = q.grad.view(-1)[0] = math.nan
    info = opt_cls(ours, **kw).step()
    torch_cls(theirs, **kw).step()
    assert not info["skipped"]
    for p, q in zip(ours, theirs):
        assert torch.equal(torch.isnan(p.detach()), torch.isnan(q.detach()))
        assert torch.isnan(p.detach()).any()


def test_state_dict_round_trip_with_torch_both_ways():
    # state_dict() returns references (as torch's does): deep copies stand for a save/load.
    gen = torch.Generator().manual_seed(15)
    # ours -> torch
    pa, pb = twins(16)
    a, b = CPUAdamW(pa, lr=1e-2, amsgrad=True), torch.optim.AdamW(pb, lr=1e-2, amsgrad=True)
    for _ in range(5):
        set_grads(pa, pb, gen)
        a.step()
    for p, q in zip(pa, pb):
        q.data.copy_(p.data)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for _ in range(5):
        set_grads(pa, pb, gen)
        a.step()
        b.step()
    assert_close_params(pa, pb)
    # torch -> ours
    c_params = [torch.nn.Parameter(q.detach().clone()) for q in pb]
    c = CPUAdamW(c_params, lr=123.0)
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    assert c.param_groups[0]["lr"] == 1e-2
    for _ in range(5):
        set_grads(c_params, pb, gen)
        c.step()
        b.step()
    assert_close_params(c_params, pb)
    # SGD both ways
    pa, pb = twins(17)
    a, b = CPUSGD(pa, lr=0.1, momentum=0.9), torch.optim.SGD(pb, lr=0.1, momentum=0.9)
    for _ in range(3):
        set_grads(pa, pb, gen)
        b.step()
    for p, q in zip(pa, pb):
        p.data.copy_(q.data)
    a.load_state_dict(copy.deepcopy(b.state_dict()))
    for _ in range(3):
        set_grads(pa, pb, gen)
        a.step()
        b.step()
    assert_close_params(pa, pb)
    b.load_state_dict(copy.deepcopy(a.state_dict()))


def test_simd_levels_give_identical_steps():
    results = []
    for level in simd_levels():
        with simd_level(level):
            pa = make_params(18)
            opt = CPUAdamW(pa, lr=1e-2)
            gen = torch.Generator().manual_seed(19)
            for _ in range(3):
                for p in pa:
                    p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).float()
                opt.step(max_grad_norm=2.0)
            results.append([p.detach().clone() for p in pa])
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert bits_equal(x, y)


# ---- bad input: ValueError naming the argument, nothing changed

def test_bad_constructor_arguments():
    p = [torch.nn.Parameter(torch.zeros(4))]
    for kw, name in [(dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"), (dict(betas=(0.9, -0.1)), "betas"),
                     (dict(eps=0.0), "eps"), (dict(weight_decay=-1.0), "weight_decay")]:
        with pytest.raises(ValueError, match=name):
            CPUAdamW(p, **kw)
    with pytest.raises(ValueError, match="nesterov"):
        CPUSGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        CPUSGD(p, lr=0.1, momentum=-1.0)


@pytest.mark.parametrize("param,what", [
    (torch.zeros(4, 4).t(), "contiguous"),
    (torch.zeros(4, dtype=torch.float64), "float32"),
    (torch.zeros(4, dtype=torch.bfloat16), "float32"),
    (torch.zeros(4, dtype=torch.int32), "float32"),
    (torch.zeros(4, device="meta"), "CPU"),
])
def test_bad_params(param, what):
    with pytest.raises(ValueError, match=what) as e:
        CPUAdamW([torch.zeros(3), param])
    assert "params[1]" in str(e.value)
    with pytest.raises(ValueError, match="params"):
        CPUSGD([param], lr=0.1)
    opt = CPUSGD([torch.zeros(3)], lr=0.1)
    with pytest.raises(ValueError, match="param_groups\\[1\\]"):
        opt.add_param_group({"params": [param]})


def test_bad_group_values_at_step_leave_everything_unchanged():
    pa = make_params(20)
    opt = CPUAdamW(pa, lr=1e-2)
    gen = torch.Generator().manual_seed(21)
    for p in pa:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in pa]
    for key, value, name in [("lr", -0.1, "lr"), ("betas", (0.9, 1.0), "betas"), ("eps", -1e-8, "eps")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=name):
            opt.step()
        opt.param_groups[0][key] = good
    good_grad = pa[2].grad
    pa[2].grad = good_grad.to_sparse()
    with pytest.raises(ValueError, match="grad"):
        opt.step()
    pa[2].grad = good_grad
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.step(max_grad_norm=-1.0)
    for p, q in zip(pa, params_before):
        assert bits_equal(p.detach(), q)
    after = opt.state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert bits_equal(after["state"][i][k], v)
