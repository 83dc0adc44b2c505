"""ncclavg.optim.CPUAdamW / CPUAdam / CPUSGD against torch.optim.AdamW / Adam / SGD."""
import copy
import math
import random

import pytest
import torch

from ncclavg.optim import CPUSGD, CPUAdam, CPUAdamW
from optim_reference import bits_equal, simd_level, simd_levels

_rng = random.Random(2024)
SHAPES = [(3, 5), (17,), (300, 3), (1,), (16, 16), (4097,), (2, 7, 9)] + [
    tuple(_rng.randint(1, 40) for _ in range(_rng.randint(1, 3))) for _ in range(4)]


def make_params(seed, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def twins(seed, shapes=SHAPES):
    a = make_params(seed, shapes)
    return a, [torch.nn.Parameter(p.detach().clone()) for p in a]


def f64_twin(params):
    """Exact float64 copies of params: a torch optimizer over them is the exact-arithmetic reference."""
    return [torch.nn.Parameter(p.detach().double()) for p in params]


def set_grads(gen, *param_lists, scale=1.0):
    """The same gradient (drawn in float32) on every list of params, in each list's dtype (exact)."""
    for ps in zip(*param_lists):
        g = torch.randn(ps[0].shape, generator=gen) * scale
        for q in ps:
            q.grad = g.to(q.dtype)


U = 2.0 ** -24  # float32 unit roundoff


# Note [Running error bound of a float32 optimizer]
# ncclavg and torch.optim compute the same float32 operations (Note [Optimizer arithmetic follows torch] in
# csrc/common/optim_math.h) but not bit for bit: torch's CPU kernels contract some multiply-adds into
# FMAs, which ones depending on the CPU (its default / AVX2 / AVX-512 kernels); ncclavg never does. Both
# are float32 roundings of one exact trajectory, which the test computes with the same torch optimizer on
# float64 copies of the parameters and gradients (2^-29 times more accurate: exact for this purpose).
# Fp32Bound carries, along that float64 run, a per-element bound on how far a float32 run of the same
# formulas can be from it: every float32 operation (and every per-step scalar rounded to float) adds at
# most u = 2^-24 times the magnitude of its result, and errors already in p, exp_avg, exp_avg_sq or the
# momentum buffer propagate linearly through the formulas (the gradients here do not depend on p). That
# is first order in u: the neglected terms are u times the bound per operation, < 1e-5 of it over 20
# steps, which bound() adds. An FMA only removes roundings, so the bound holds for ncclavg and for torch
# on any CPU: |ncclavg - float64| <= bound, and |ncclavg - torch fp32| <= 2 bounds (triangle inequality).
# A gradient an implementation scales first (clipping) enters with the relative error of its factor,
# `grad_rel`. The bound is a few 1e-6 of max |p| after 20 steps (measured errors reach 0.4 to 1.0 of
# it: it is tight), while a real bug (a missing bias correction, a wrong lr, decay or momentum term, a
# skipped element) moves params by ~lr = 1e-2.
class Fp32Bound:
    """The float64 reference optimizer `opt64` (torch's Adam/AdamW/SGD) plus the bound of Note [Running error
    bound of a float32 optimizer]; call step() instead of opt64.step()."""

    def __init__(self, opt64):
        self.opt, self.err = opt64, {}

    def step(self, grad_rel=0.0):
        before = {}
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = {k: v.clone() for k, v in self.opt.state.get(p, {}).items() if torch.is_tensor(v)}
                    before[p] = (p.detach().clone(), state, group["lr"])
        self.opt.step()
        for group in self.opt.param_groups:
            for p in group["params"]:
                if p in before:
                    self._propagate(p, group, *before[p], grad_rel)

    def bound(self, params, key="p"):
        """Per tensor, the bound on |float32 - float64| of the params (or of the state tensor `key`)."""
        return [(1 + 1e-5) * self.err.get(p, {}).get(key, torch.zeros_like(p, dtype=torch.float64)) for p in params]

    @torch.no_grad()
    def _propagate(self, p, group, p0, st0, lr, grad_rel):
        u, e, st = U, self.err.setdefault(p, {}), self.opt.state[p]
        zero = torch.zeros_like(p0)
        g = -p.grad if group["maximize"] else p.grad
        eg, ep, wd = grad_rel * g.abs(), e.get("p", zero), group["weight_decay"]
        decoupled = group.get("decoupled_weight_decay", False) and not isinstance(self.opt, torch.optim.SGD)
        if wd and decoupled:                  # p = p * (1 - lr*wd): the factor's rounding and the product's
            ep = (1 - lr * wd) * (ep + 2 * u * p0.abs())
        elif wd:                              # g = g + wd*p: wd's rounding, the product's, the sum's
            g = g + wd * p0
            eg = eg + wd * ep + 2 * u * wd * p0.abs() + u * g.abs()
        if isinstance(self.opt, torch.optim.SGD):
            mu, damp = group["momentum"], group["dampening"]
            if mu:
                b, b0 = st["momentum_buffer"], st0.get("momentum_buffer")
                if b0 is None:                # first step: b = g
                    e["b"] = eg
                else:                         # b = b*mu + (1 - damp)*g: two factors, two products, the sum
                    e["b"] = (mu * e.get("b", zero) + (1 - damp) * eg + 2 * u * mu * b0.abs() + u * b.abs()
                              + (2 * u * (1 - damp) * g.abs() if damp else 0))
                if group["nesterov"]:         # g = g + mu*b
                    g, eg = g + mu * b, eg + mu * e["b"] + 2 * u * mu * b.abs() + u * (g + mu * b).abs()
                else:
                    g, eg = b, e["b"]
            e["p"] = ep + lr * eg + 2 * u * lr * g.abs() + u * p.abs()  # p = p + (-lr)*g
            return
        b1, b2 = group["betas"]
        t = float(st["step"])
        m, v, w = st["exp_avg"], st["exp_avg_sq"], 1 - b1
        d = (g - st0.get("exp_avg", zero)).abs()
        # m = lerp(m, g, w): m + w*(g - m) (w < 0.5) or g - (g - m)*(1 - w): three roundings and the sum's
        e["m"] = w * eg + (1 - w) * e.get("m", zero) + 3 * u * (w if w < 0.5 else 1.0) * d + u * m.abs()
        # v = v*b2 + ((1 - b2)*g)*g: b2's rounding and the product's, (1 - b2)'s and two products', the sum's
        e["v"] = (b2 * e.get("v", zero) + 2 * (1 - b2) * g.abs() * eg + 2 * u * b2 * st0.get("exp_avg_sq", zero)
                  + 3 * u * (1 - b2) * g * g + u * v)
        big_v, ev = v, e["v"]
        if group["amsgrad"]:                  # the max of two values is off by the larger of their errors
            big_v, ev = st["max_exp_avg_sq"], torch.maximum(e.get("vmax", zero), e["v"])
            e["vmax"] = ev
        # denom = sqrt(v)/sqrt(bc2) + eps: |sqrt(v + dv) - sqrt(v)| <= min(dv / (2 sqrt v), sqrt(dv)), then the
        # roundings of sqrt, of sqrt(bc2), of the quotient, of eps and of the sum
        sq, bc2_sqrt = big_v.sqrt(), math.sqrt(1 - b2 ** t)
        esq = torch.minimum(ev / (2 * sq).clamp_min(1e-300), ev.sqrt()) + u * sq
        denom = sq / bc2_sqrt + group["eps"]
        edenom = esq / bc2_sqrt + 2 * u * sq / bc2_sqrt + u * group["eps"] + u * denom
        # p = p + (-step_size*m)/denom: step_size's rounding, the product's, the quotient's, then the sum's
        step_size = lr / (1 - b1 ** t)
        upd = step_size * m / denom
        e["p"] = ep + step_size * (e["m"] / denom + m.abs() * edenom / denom ** 2) + 3 * u * upd.abs() + u * p.abs()


def assert_within(got, want, bounds, factor=1.0):
    """|got - want| <= factor * bound, element by element; see Note [Running error bound of a float32 optimizer]."""
    for a, b, e in zip(got, want, bounds):
        diff = (a.detach().double() - b.detach().double()).abs()
        assert bool((diff <= factor * e).all()), (tuple(a.shape), float((diff / e).nan_to_num(posinf=1e300).max()))


def assert_matches_torch(ours, theirs, ref64, bounds):
    """ncclavg within the bound of the float64 run, and within two bounds of torch's float32 run."""
    assert_within(ours, ref64, bounds)
    assert_within(ours, theirs, bounds, factor=2.0)


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
    pc = f64_twin(pb)
    a, b, c = ours(pa, **kw), theirs(pb, **kw), Fp32Bound(theirs(pc, **kw))
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        set_grads(gen, pa, pb, pc)
        a.step()
        b.step()
        c.step()
    assert_matches_torch(pa, pb, pc, c.bound(pc))
    assert_matches_torch([a.state[p]["exp_avg_sq"] for p in pa], [b.state[q]["exp_avg_sq"] for q in pb],
                         [c.opt.state[q]["exp_avg_sq"] for q in pc], c.bound(pc, "v"))
    for p, q in zip(pa, pb):
        assert a.state[p]["step"].item() == b.state[q]["step"].item() == 20


def test_adam_fused_torch_too():
    pa, pb = twins(3)
    pc = f64_twin(pb)
    a, b = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2, fused=True)
    c = Fp32Bound(torch.optim.AdamW(pc, lr=1e-2))
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        set_grads(gen, pa, pb, pc)
        a.step()
        b.step()
        c.step()
    assert_matches_torch(pa, pb, pc, c.bound(pc))


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_20_steps_match_torch(kw):
    pa, pb = twins(5)
    pc = f64_twin(pb)
    a, b, c = CPUSGD(pa, **kw), torch.optim.SGD(pb, **kw), Fp32Bound(torch.optim.SGD(pc, **kw))
    gen = torch.Generator().manual_seed(6)
    for _ in range(20):
        set_grads(gen, pa, pb, pc)
        a.step()
        b.step()
        c.step()
    assert_matches_torch(pa, pb, pc, c.bound(pc))
    if kw.get("momentum"):
        assert_matches_torch([a.state[p]["momentum_buffer"] for p in pa], [b.state[q]["momentum_buffer"] for q in pb],
                             [c.opt.state[q]["momentum_buffer"] for q in pc], c.bound(pc, "b"))


def test_param_groups_scheduler_and_missing_grads():
    pa, pb = twins(7)
    pc = f64_twin(pb)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 5e-3, "weight_decay": 0.0}]  # noqa: E731
    a, b = CPUAdamW(groups(pa), lr=1e-2), torch.optim.AdamW(groups(pb), lr=1e-2)
    c = Fp32Bound(torch.optim.AdamW(groups(pc), lr=1e-2))
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.05, 0.01], total_steps=20) for o in (a, b, c.opt)]
    gen = torch.Generator().manual_seed(8)
    for step in range(20):
        set_grads(gen, pa, pb, pc)
        if step % 3 == 0:  # a param without a gradient is left alone (and gets no state)
            pa[1].grad = pb[1].grad = pc[1].grad = None
        for o in (a, b, c):
            o.step()
        for sch in scheds:
            sch.step()
    assert_matches_torch(pa, pb, pc, c.bound(pc))
    assert a.param_groups[1]["lr"] == b.param_groups[1]["lr"]
    assert a.state[pa[1]]["step"].item() == b.state[pb[1]]["step"].item()


def exact_norm(params, scale=1.0):
    """The L2 norm of the params' grads / scale to 1.5 ulp of float64: a float's square is exact in float64,
    math.fsum rounds the sum once, sqrt once (scale: a power of two, exact)."""
    return math.sqrt(math.fsum(x for p in params for x in (p.grad.double() / scale).square().reshape(-1).tolist()))


def clip_rel(norm, exact):
    """Relative error of a float32 clip factor min(1, max / (norm + 1e-6)) computed from `norm` (float32,
    relative error |norm - exact| / exact), then multiplied into a gradient: the norm's error, the
    rounding of the norm to float32, of the sum and of the quotient, and of the product: 4u."""
    return abs(norm - exact) / exact + 4 * U


def test_grad_scale_and_clipping_match_torch_sequence():
    pa, pb = twins(9)
    pc = f64_twin(pb)
    a, b, c = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2), Fp32Bound(torch.optim.AdamW(pc, lr=1e-2))
    gen = torch.Generator().manual_seed(10)
    scale = 1024.0
    n = sum(p.numel() for p in pa)
    for _ in range(20):
        set_grads(gen, pa, pb, pc, scale=scale)
        exact = exact_norm(pa, scale)
        info = a.step(grad_scale=scale, max_grad_norm=5.0)
        inv = torch.tensor(1.0 / scale, dtype=torch.float32)
        for q in pb:  # GradScaler.unscale_, then clip_grad_norm_
            q.grad.mul_(inv)
        total = torch.nn.utils.clip_grad_norm_(pb, 5.0).item()
        b.step()
        for q in pc:
            q.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(pc, 5.0)  # float64: exact for this purpose
        c.step(grad_rel=max(clip_rel(info["grad_norm"], exact), clip_rel(total, exact)))
        # The core sums the N exact squares in float64 (relative error <= (N-1) * 2^-53, first order), its
        # sqrt halves that and adds 2^-53; with exact_norm's 1.5 * 2^-53: (N-1)/2 + 2.5, rounded up to
        # + 3 for the second-order terms. torch's float32 norm (`total`) is only within ~N * 2^-24 of it.
        assert info["grad_norm"] == pytest.approx(exact, rel=((n - 1) / 2 + 3) * 2.0 ** -53)
        assert not info["skipped"]
    assert_matches_torch(pa, pb, pc, c.bound(pc))


def test_sgd_clipping_matches_torch():
    pa, pb = twins(11)
    pc = f64_twin(pb)
    kw = dict(lr=0.1, momentum=0.9, nesterov=True)
    a, b, c = CPUSGD(pa, **kw), torch.optim.SGD(pb, **kw), Fp32Bound(torch.optim.SGD(pc, **kw))
    gen = torch.Generator().manual_seed(12)
    for _ in range(20):
        set_grads(gen, pa, pb, pc, scale=3.0)
        exact = exact_norm(pa)
        info = a.step(max_grad_norm=1.0)
        total = torch.nn.utils.clip_grad_norm_(pb, 1.0).item()
        b.step()
        torch.nn.utils.clip_grad_norm_(pc, 1.0)
        c.step(grad_rel=max(clip_rel(info["grad_norm"], exact), clip_rel(total, exact)))
    assert_matches_torch(pa, pb, pc, c.bound(pc))


def test_strided_grad_is_accepted():
    pa, pb = twins(22, [(1000, 3)])
    pc = f64_twin(pb)
    a, b, c = CPUAdamW(pa, lr=1e-2), torch.optim.AdamW(pb, lr=1e-2), Fp32Bound(torch.optim.AdamW(pc, lr=1e-2))
    g = torch.randn(3, 1000).t()  # same shape, column-major
    pa[0].grad, pb[0].grad, pc[0].grad = g, g.contiguous(), g.double()
    for o in (a, b, c):
        o.step()
    assert_matches_torch(pa, pb, pc, c.bound(pc))


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


def f64_resumed(torch_cls, params, state_dict, **kw):
    """A float64 torch optimizer resuming from (params, state_dict) (torch casts the loaded state to the
    params' dtype), with a bound starting at zero: every run resumes from the same float32 values."""
    q = f64_twin(params)
    opt = torch_cls(q, **kw)
    opt.load_state_dict(copy.deepcopy(state_dict))
    return q, Fp32Bound(opt)


def test_state_dict_round_trip_with_torch_both_ways():
    # state_dict() returns references (as torch's does): deep copies stand for a save/load.
    gen = torch.Generator().manual_seed(15)
    # ours -> torch
    pa, pb = twins(16)
    a, b = CPUAdamW(pa, lr=1e-2, amsgrad=True), torch.optim.AdamW(pb, lr=1e-2, amsgrad=True)
    for _ in range(5):
        set_grads(gen, pa, pb)
        a.step()
    for p, q in zip(pa, pb):
        q.data.copy_(p.data)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    px, x = f64_resumed(torch.optim.AdamW, pa, a.state_dict(), lr=1e-2, amsgrad=True)
    for _ in range(5):
        set_grads(gen, pa, pb, px)
        for o in (a, b, x):
            o.step()
    assert_matches_torch(pa, pb, px, x.bound(px))
    # torch -> ours
    c_params = [torch.nn.Parameter(q.detach().clone()) for q in pb]
    c = CPUAdamW(c_params, lr=123.0)
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    assert c.param_groups[0]["lr"] == 1e-2
    px, x = f64_resumed(torch.optim.AdamW, pb, b.state_dict(), lr=1e-2, amsgrad=True)
    for _ in range(5):
        set_grads(gen, c_params, pb, px)
        for o in (c, b, x):
            o.step()
    assert_matches_torch(c_params, pb, px, x.bound(px))
    # SGD both ways
    pa, pb = twins(17)
    a, b = CPUSGD(pa, lr=0.1, momentum=0.9), torch.optim.SGD(pb, lr=0.1, momentum=0.9)
    for _ in range(3):
        set_grads(gen, pa, pb)
        b.step()
    for p, q in zip(pa, pb):
        p.data.copy_(q.data)
    a.load_state_dict(copy.deepcopy(b.state_dict()))
    px, x = f64_resumed(torch.optim.SGD, pb, b.state_dict(), lr=0.1, momentum=0.9)
    for _ in range(3):
        set_grads(gen, pa, pb, px)
        for o in (a, b, x):
            o.step()
    assert_matches_torch(pa, pb, px, x.bound(px))
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
