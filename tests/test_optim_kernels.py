"""The fused optimizer core (_C.adam_step / sgd_step / grad_stats / cast_copy) against a float32 replay of
its arithmetic (bit for bit), a float64 reference, torch, and every SIMD level against the scalar one."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ncclavg import _C
from ncclavg.buffers import as_buffer as B
from optim_reference import (bits_equal, effective_grad, f32, norm64, ref_adam, ref_sgd, simd_level, simd_levels,
                             to_np)

SIZES = [0, 1, 7, 15, 16, 17, 33, 100, 4097]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def rand_grads(n, towers, dtype, gen, scale=1.0):
    return [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(towers)]


def adam_call(p, grads, m, v, vmax=None, step=1, out=None, **kw):
    hp = {**ADAM, **kw}
    amsgrad = hp.pop("amsgrad", False)
    return _C.adam_step([B(p)], [[B(g)] for g in grads], [B(m)], [B(v)], [B(vmax)] if amsgrad else [],
                        [float(step)], [B(out)] if out is not None else [], amsgrad=amsgrad, **hp)


# ---- bit-exact replay of the arithmetic (scalar level)

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("towers", [1, 3, 4])
def test_adam_matches_float32_replay(n, dtype, towers):
    gen = torch.Generator().manual_seed(n * 31 + towers)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    rp, rm, rv = to_np(p), to_np(m), to_np(v)
    with simd_level("scalar"):
        for step in range(1, 4):
            grads = rand_grads(n, towers, dtype, gen)
            adam_call(p, grads, m, v, step=step, grad_scale=2.0)
            ref_adam(rp, rm, rv, None, effective_grad(grads, 2.0), step=step, lr=ADAM["lr"], beta1=0.9,
                     beta2=0.999, eps=1e-8, wd=0.05)
    assert bits_equal(p, torch.from_numpy(rp)) and bits_equal(m, torch.from_numpy(rm))
    assert bits_equal(v, torch.from_numpy(rv))


@pytest.mark.parametrize("decoupled,amsgrad,beta1,wd", [(False, False, 0.9, 0.1), (True, True, 0.9, 0.0),
                                                         (False, True, 0.3, 0.0), (True, False, 0.0, 0.2)])
def test_adam_variants_match_float32_replay(decoupled, amsgrad, beta1, wd):
    gen = torch.Generator().manual_seed(7)
    n = 1000
    p = torch.randn(n, generator=gen)
    m, v, vmax = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    rp, rm, rv, rmax = to_np(p), to_np(m), to_np(v), to_np(vmax)
    with simd_level("scalar"):
        for step in range(1, 6):
            g = rand_grads(n, 1, torch.float32, gen, scale=1.0 / step)
            adam_call(p, g, m, v, vmax, step=step, beta1=beta1, weight_decay=wd, decoupled=decoupled,
                      amsgrad=amsgrad)
            ref_adam(rp, rm, rv, rmax, effective_grad(g), step=step, lr=ADAM["lr"], beta1=beta1, beta2=0.999,
                     eps=1e-8, wd=wd, decoupled=decoupled, amsgrad=amsgrad)
    assert bits_equal(p, torch.from_numpy(rp)) and bits_equal(m, torch.from_numpy(rm))
    if amsgrad:
        assert bits_equal(vmax, torch.from_numpy(rmax))


@pytest.mark.parametrize("momentum,dampening,wd,nesterov", [(0.0, 0.0, 0.0, False), (0.9, 0.0, 0.01, True),
                                                            (0.9, 0.3, 0.0, False), (0.5, 0.0, 0.1, False)])
def test_sgd_matches_float32_replay(momentum, dampening, wd, nesterov):
    gen = torch.Generator().manual_seed(3)
    n = 777
    p, buf = torch.randn(n, generator=gen), torch.empty(n)
    rp, rbuf = to_np(p), np.zeros(n, dtype=f32)
    with simd_level("scalar"):
        for step in range(4):
            grads = rand_grads(n, 2, torch.bfloat16, gen)
            _C.sgd_step([B(p)], [[B(g)] for g in grads], [B(buf)] if momentum else [], [step == 0] if momentum else [],
                        [], lr=0.1, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov)
            ref_sgd(rp, rbuf, effective_grad(grads), lr=0.1, momentum=momentum, dampening=dampening, wd=wd,
                    nesterov=nesterov, first=step == 0)
    assert bits_equal(p, torch.from_numpy(rp))
    if momentum:
        assert bits_equal(buf, torch.from_numpy(rbuf))


# ---- tower mean and float64 references

@pytest.mark.parametrize("towers", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_tower_mean_is_float64_mean_rounded_once(towers, dtype):
    gen = torch.Generator().manual_seed(towers)
    n = 5000
    grads = rand_grads(n, towers, dtype, gen)
    grads[0][:100] *= 1e6  # wide exponent spread: a float32 sum would round
    expect = torch.stack([g.double() for g in grads]).mean(0).float()
    for level in simd_levels():
        with simd_level(level):
            p = torch.full((n,), -0.0)  # -0 + (-1 * mean) keeps the sign of a zero mean
            _C.sgd_step([B(p)], [[B(g)] for g in grads], [], [], [], lr=1.0)
            assert bits_equal(-p, expect), level


def test_crafted_exact_inputs_bitwise():
    """Small integers times powers of two: mean, unscale and Adam's first step are exact."""
    n = 67
    towers = [torch.arange(n, dtype=torch.float32) * 4 + k for k in range(4)]
    p = torch.zeros(n)
    m, v = torch.zeros(n), torch.zeros(n)
    _C.adam_step([B(p)], [[B(t)] for t in towers], [B(m)], [B(v)], [], [1.0], [], lr=1.0, beta1=0.5, beta2=0.75,
                 eps=1e-30, weight_decay=0.0, grad_scale=4.0)
    mean = torch.arange(n, dtype=torch.float32) + 0.375  # (4i + 1.5) / 4
    assert bits_equal(m, 0.5 * mean) and bits_equal(v, 0.25 * mean * mean)
    # step 1: m_hat = g, v_hat = g^2 -> p = -g/|g| (eps negligible): exactly -1 everywhere
    assert bits_equal(p, -torch.ones(n))


def test_adam_close_to_float64_reference():
    gen = torch.Generator().manual_seed(11)
    n = 3000
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    p64, m64, v64 = p.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.99, 1e-8, 0.1
    # Note [Running error bound of the Adam kernel]
    # A bound on |p - p64| per element, carried along the float64 reference: every float32 operation of
    # om::adam_update (csrc/common/optim_math.h: no FMA, the per-step scalars rounded to float once) adds
    # at most u = 2^-24 times the magnitude of its result, and earlier errors propagate linearly
    # (first order in u; the neglected u^2 terms are < 1e-5 of the bound here):
    #   m = m + w1*(g - m): rounding of w1, of g - m and of the product: 3u*w1*|g - m|; the sum: u*|m|;
    #                       the old error decays by 1 - w1 = b1
    #   v = v*b2 + (c2*g)*g: all terms >= 0, so a relative bound: +3u per step (3u at step 1: v = 0)
    #   denom = sqrt(v)/bc2_sqrt + eps: relative ev/2 + 4u (sqrt, bc2_sqrt, division, the sum)
    #   upd = (-step_size*m)/denom: relative ev/2 + 4u + 3u (step_size, product, division), plus the
    #                               error of m times step_size/denom
    #   p = p*decay + upd: 2u*|p| (decay's rounding, the product), the error of upd, u*|p_new| (the sum)
    # The assert adds those u^2 terms; the float64 reference itself is ~2^-29 times more accurate. The
    # bound reaches 1.3e-5 (mostly the decay factor's rounding, 20 times on |p| ~ 4); a wrong bias
    # correction or decay moves p by ~lr = 1e-3 and more.
    u = 2.0 ** -24
    err_p, err_m, rel_v = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), 0.0
    for step in range(1, 21):
        g = torch.randn(n, generator=gen)
        adam_call(p, [g], m, v, step=step, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
        g64 = g.double()
        err_p = err_p + 2 * u * p64.abs()  # the decay of the old p (its old error decays with it, below)
        p64 *= 1 - lr * wd
        err_p *= 1 - lr * wd
        err_m = b1 * err_m + 3 * u * (1 - b1) * (g64 - m64).abs()
        m64 = b1 * m64 + (1 - b1) * g64
        err_m += u * m64.abs()
        v64 = b2 * v64 + (1 - b2) * g64 ** 2
        rel_v += 3 * u
        step_size, denom = lr / (1 - b1 ** step), v64.sqrt() / math.sqrt(1 - b2 ** step) + eps
        upd = step_size * m64 / denom
        p64 -= upd
        err_p += upd.abs() * (rel_v / 2 + 7 * u) + step_size * err_m / denom + u * p64.abs()
    assert bool(((p.double() - p64).abs() <= (1 + 1e-5) * err_p).all())


# ---- every SIMD level against scalar, bit for bit

@pytest.mark.parametrize("level", [lv for lv in simd_levels() if lv != "scalar"])
@pytest.mark.parametrize("dtype,towers", [(torch.float32, 1), (torch.bfloat16, 4), (torch.float16, 3),
                                          (torch.float32, 2)])
def test_simd_levels_equal_scalar(level, dtype, towers):
    gen = torch.Generator().manual_seed(towers)
    sizes = [0, 1, 7, 15, 16, 17, 31, 33, 4097, 70001]  # 70001: several threads' slices
    results = {}
    for lv in ("scalar", level):
        g2 = torch.Generator().manual_seed(123)
        ps = [torch.randn(n, generator=g2) for n in sizes]
        ms, vs, vx = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
        bufs = [torch.empty(n) for n in sizes]
        sp = [p.clone() for p in ps]
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        outs16 = [torch.empty(n, dtype=torch.float16) for n in sizes]
        info = []
        with simd_level(lv):
            for step in range(1, 4):
                grads = [[(torch.randn(n, generator=g2) * 3).to(dtype) for n in sizes] for _ in range(towers)]
                gb = [[B(g) for g in tw] for tw in grads]
                info.append(_C.adam_step([B(p) for p in ps], gb, [B(x) for x in ms], [B(x) for x in vs],
                                         [B(x) for x in vx], [float(step)] * len(sizes), [B(o) for o in outs],
                                         lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01, amsgrad=True,
                                         grad_scale=3.0, max_grad_norm=50.0, check_finite=True))
                _C.sgd_step([B(p) for p in sp], gb, [B(b) for b in bufs], [step == 1] * len(sizes),
                            [B(o) for o in outs16], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True,
                            max_grad_norm=10.0)
                info.append(_C.grad_stats(gb, 2.0, 1.0))
        results[lv] = (ps, ms, vs, vx, outs, sp, bufs, outs16, info)
    a, b = results["scalar"], results[level]
    for group_a, group_b in zip(a[:-1], b[:-1]):
        for x, y in zip(group_a, group_b):
            assert bits_equal(x, y)
    assert a[-1] == b[-1]  # norms and clip factors identical (Note [Norm reduction ...])


_ENV_SCRIPT = """
import hashlib, importlib.util, sys
import numpy as np
# the extension alone (the package __init__ would import torch: seconds per process)
spec = importlib.util.spec_from_file_location("ncclavg._C", sys.argv[1])
_C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_C)
B = lambda a: _C.Buffer(a.ctypes.data, a.size, {np.float32: 0, np.float16: 1}[a.dtype.type], -1, False)
rng = np.random.default_rng(0)
n = 4099
p = rng.standard_normal(n).astype(np.float32)
m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
gs = [rng.standard_normal(n).astype(np.float16) for _ in range(3)]
for s in range(1, 4):
    _C.adam_step([B(p)], [[B(g)] for g in gs], [B(m)], [B(v)], [], [float(s)], [], lr=1e-2, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
print(_C.simd_level(), hashlib.sha256(p.tobytes() + m.tobytes() + v.tobytes()).hexdigest())
"""


def test_env_var_forces_the_level():
    """NCCLAVG_SIMD picks the optimizer kernels' level too, and every level computes the same bits."""
    digests = set()
    for level in simd_levels():
        env = {**os.environ, "NCCLAVG_SIMD": level}
        r = subprocess.run([sys.executable, "-c", _ENV_SCRIPT, _C.__file__], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        got_level, digest = r.stdout.split()
        assert got_level == level
        digests.add(digest)
    assert len(digests) == 1


def test_norm_independent_of_thread_count():
    gen = torch.Generator().manual_seed(5)
    grads = rand_grads(300_001, 3, torch.bfloat16, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _C.grad_stats([[B(g)] for g in grads], 1.0, 1.0)
        torch.set_num_threads(max(2, threads))
        many = _C.grad_stats([[B(g)] for g in grads], 1.0, 1.0)
    finally:
        torch.set_num_threads(threads)
    assert one == many
    # Both sum N exact float64 squares of the float32 mean (N - 1 roundings: relative (N - 1) * 2^-53 at
    # most) and take a sqrt (halves that, adds 2^-53): (N + 1) * 2^-53 between the two, ~3e-11.
    n = grads[0].numel()
    assert one["grad_norm"] == pytest.approx(norm64([grads]), rel=(n + 1) * 2.0 ** -53)


# ---- clipping, unscale, inf/NaN skip

def test_clip_matches_torch_clip_grad_norm():
    gen = torch.Generator().manual_seed(2)
    sizes = [10, 1000, 17]
    grads = [torch.randn(n, generator=gen) * 5 for n in sizes]
    ref = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.5)
    ps = [torch.zeros(n) for n in sizes]
    r = _C.sgd_step([B(p) for p in ps], [[B(g) for g in grads]], [], [], [], lr=1.0, max_grad_norm=1.5)
    # The norm in float64: the squares of floats are exact, fsum rounds their sum once and sqrt once (1.5
    # ulp of float64); the core's N - 1 additions and sqrt add at most ((N - 1)/2 + 1) * 2^-53. torch's
    # float32 norm is only within ~N * 2^-24 of it: it is not the reference for the norm.
    n = sum(sizes)
    exact = math.sqrt(math.fsum(x for g in grads for x in g.double().square().tolist()))
    assert r["grad_norm"] == pytest.approx(exact, rel=((n - 1) / 2 + 3) * 2.0 ** -53)
    # Both clip with float32 min(1, max / (norm + 1e-6)) (a sum and a division: 2 roundings each) and one
    # product per element (1 rounding each): the factors differ by the relative difference of the two
    # float32 norms (measured here) plus 4u, the clipped grads by that plus 2u, u = 2^-24.
    norm_diff = abs(float(torch.tensor(r["grad_norm"], dtype=torch.float32)) - total.item()) / total.item()
    for p, rr in zip(ps, ref):
        torch.testing.assert_close(-p, rr.grad, rtol=norm_diff + 6 * 2.0 ** -24, atol=0)
    st = _C.grad_stats([[B(g) for g in grads]], 1.0, 1.5)
    # the same first pass over the same gradients (slice order fixed: Note [Norm reduction independent of
    # the SIMD level]): the same float32 factor
    assert st["finite"] and st["clip_coef"] == r["clip_coef"]
    # below the threshold: factor exactly 1
    assert _C.grad_stats([[B(g) for g in grads]], 1.0, 1e9)["clip_coef"] == 1.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["first", "tail_last", "middle", "one_tower"])
def test_nonfinite_skips_and_changes_nothing(bad, where):
    gen = torch.Generator().manual_seed(9)
    sizes = [64, 4097]  # 4097: the bad value can sit in the scalar tail
    towers = [[torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes] for _ in range(3)]
    if where == "first":
        towers[0][0][0] = bad
    elif where == "tail_last":
        towers[1][1][-1] = bad
    elif where == "middle":
        towers[2][1][2000] = bad
    else:
        towers[2][0][33] = bad
    ps = [torch.randn(n, generator=gen) for n in sizes]
    ms = [torch.randn(n, generator=gen) for n in sizes]
    vs = [torch.rand(n, generator=gen) for n in sizes]
    outs = [torch.zeros(n, dtype=torch.bfloat16) for n in sizes]
    before = [t.clone() for t in ps + ms + vs]
    for level in simd_levels():
        with simd_level(level):
            r = _C.adam_step([B(p) for p in ps], [[B(g) for g in tw] for tw in towers], [B(m) for m in ms],
                             [B(v) for v in vs], [], [5.0, 5.0], [B(o) for o in outs], lr=0.1, beta1=0.9,
                             beta2=0.999, eps=1e-8, weight_decay=0.1, check_finite=True)
            assert r["skipped"] and not math.isfinite(r["grad_norm"])
            for x, y in zip(ps + ms + vs, before):
                assert bits_equal(x, y)
            for o, p in zip(outs, ps):  # the copy-out mirrors the (unchanged) params
                assert bits_equal(o, p.to(torch.bfloat16))
            r = _C.sgd_step([B(p) for p in ps], [[B(g) for g in tw] for tw in towers], [B(m) for m in ms],
                            [False, False], [], lr=0.1, momentum=0.9, max_grad_norm=1.0)
            assert r["skipped"]
            for x, y in zip(ps + ms + vs, before):
                assert bits_equal(x, y)


def test_overflow_after_unscale_is_caught():
    g = torch.full((40,), 3e38)
    p = torch.zeros(40)
    r = _C.sgd_step([B(p)], [[B(g)]], [], [], [], lr=1.0, grad_scale=0.5, check_finite=True)
    assert r["skipped"] and torch.equal(p, torch.zeros(40))


# ---- copy-out

@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_cast_copy_matches_torch_rounding(dtype):
    gen = torch.Generator().manual_seed(4)
    src = torch.randn(5003, generator=gen) * 1e3
    src[:6] = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-40])
    src[6:10] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11])  # ties
    for level in simd_levels():
        with simd_level(level):
            dst = torch.empty(src.numel(), dtype=dtype)
            _C.cast_copy([B(src)], [B(dst)])
            expect = src.to(dtype)
            nan = expect.isnan()
            assert torch.equal(dst.isnan(), nan)
            assert bits_equal(dst[~nan], expect[~nan])


def test_step_tensors_count_like_torch_and_not_when_skipped():
    n = 100
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    counter = torch.tensor(41.0)
    g = torch.randn(n)
    _C.adam_step([B(p)], [[B(g)]], [B(m)], [B(v)], [], [], [], step_tensors=[B(counter)], **ADAM)
    _C.adam_step([B(p2)], [[B(g)]], [B(m2)], [B(v2)], [], [42.0], [], **ADAM)
    assert counter.item() == 42.0 and bits_equal(p, p2)
    g[3] = math.nan
    r = _C.adam_step([B(p)], [[B(g)]], [B(m)], [B(v)], [], [], [], step_tensors=[B(counter)], check_finite=True,
                     **ADAM)
    assert r["skipped"] and counter.item() == 42.0 and bits_equal(p, p2)


def test_fused_copy_out_equals_cast_of_new_params():
    gen = torch.Generator().manual_seed(6)
    n = 1234
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    for dt in GRAD_DTYPES:
        out = torch.empty(n, dtype=dt)
        adam_call(p, [torch.randn(n, generator=gen)], m, v, out=out)
        assert bits_equal(out, p.to(dt))


# ---- bad input: ValueError naming the argument, nothing modified

def _adam_args(n=10):
    p, g, m, v = torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    return p, g, m, v


@pytest.mark.parametrize("field,value,name", [("lr", -1.0, "lr"), ("beta1", 1.0, "betas"), ("beta2", -0.1, "betas"),
                                              ("eps", 0.0, "eps"), ("eps", math.nan, "eps"),
                                              ("weight_decay", -1.0, "weight_decay"), ("grad_scale", 0.0, "grad_scale"),
                                              ("max_grad_norm", -1.0, "max_grad_norm"), ("lr", math.inf, "lr")])
def test_bad_hyperparameters(field, value, name):
    p, g, m, v = _adam_args()
    kw = {**ADAM, field: value} if field in ADAM else {**ADAM, field: value}
    with pytest.raises(ValueError, match=name):
        _C.adam_step([B(p)], [[B(g)]], [B(m)], [B(v)], [], [1.0], [], **kw)
    assert torch.equal(p, torch.ones(10)) and torch.equal(m, torch.zeros(10))


def test_bad_buffers():
    p, g, m, v = _adam_args()
    call = lambda **over: _C.adam_step(**{"params": [B(p)], "grads": [[B(g)]], "exp_avg": [B(m)],  # noqa: E731
                                          "exp_avg_sq": [B(v)], "max_exp_avg_sq": [], "steps": [1.0], "out": [],
                                          **ADAM, **over})
    cases = [
        (dict(grads=[[B(torch.ones(11))]]), "grads\\[0\\]\\[0\\]"),
        (dict(grads=[[B(g)], [B(torch.ones(10, dtype=torch.bfloat16))]]), "grads\\[1\\]\\[0\\]"),
        (dict(grads=[]), "grads"),
        (dict(exp_avg=[B(torch.zeros(9))]), "exp_avg\\[0\\]"),
        (dict(exp_avg_sq=[]), "exp_avg_sq"),
        (dict(params=[B(torch.ones(10, dtype=torch.bfloat16))]), "params\\[0\\]"),
        (dict(exp_avg=[B(p)]), "shares memory"),
        (dict(grads=[[B(m)]]), "shares memory"),
        (dict(out=[B(torch.empty(3))]), "out\\[0\\]"),
        (dict(steps=[0.0]), "steps\\[0\\]"),
        (dict(steps=[]), "steps"),
        (dict(max_exp_avg_sq=[B(torch.zeros(10))]), "max_exp_avg_sq"),
        (dict(amsgrad=True), "max_exp_avg_sq"),
        (dict(params=[_C.Buffer(p.data_ptr(), 10, 0, -1, True)]), "params\\[0\\]"),
        (dict(steps=[], step_tensors=[B(torch.zeros(2))]), "step_tensors\\[0\\]"),
        (dict(step_tensors=[B(torch.zeros(1))]), "steps"),
        (dict(steps=[], step_tensors=[B(m[:1])]), "shares memory"),
    ]
    for over, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call(**over)
        assert torch.equal(p, torch.ones(10)) and torch.equal(m, torch.zeros(10)) and torch.equal(v, torch.zeros(10))


def test_bad_sgd_arguments():
    p, g, buf, _ = _adam_args()
    with pytest.raises(ValueError, match="nesterov"):
        _C.sgd_step([B(p)], [[B(g)]], [B(buf)], [True], [], lr=0.1, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="nesterov"):
        _C.sgd_step([B(p)], [[B(g)]], [B(buf)], [True], [], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum_buffers"):
        _C.sgd_step([B(p)], [[B(g)]], [], [], [], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        _C.sgd_step([B(p)], [[B(g)]], [], [], [], lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="first"):
        _C.sgd_step([B(p)], [[B(g)]], [B(buf)], [], [], lr=0.1, momentum=0.9)
    assert torch.equal(p, torch.ones(10))
    with pytest.raises(ValueError, match="dsts\\[0\\]"):
        _C.cast_copy([B(p)], [B(torch.empty(4))])
