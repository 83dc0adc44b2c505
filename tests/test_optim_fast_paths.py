"""The optimizer core's shortcuts give the bits of the long way, at every SIMD level:
- the float32 tower mean of 16-bit gradients (Note [Float32 tower mean when it is exact]) against the
  float64 mean rounded once, around the exactness limits;
- the inf/NaN check as a scan of the raw bits, with the norm summed by the update (Note [The inf/NaN
  check as a scan]) against grad_stats;
- Adam's compiled common configuration and unit gradient scale against the float32 replay.
Sizes are not multiples of the vector width, so the scalar tails are covered too."""
import math

import numpy as np
import pytest
import torch

from ncclavg import _C
from ncclavg.buffers import as_buffer as B
from ncclavg.optim import CPUAdamW
from optim_reference import bits_equal, effective_grad, ref_adam, simd_level, simd_levels, to_np

GRAD16 = [torch.bfloat16, torch.float16]


def mean64(grads) -> torch.Tensor:
    """float64 sum of the towers in order, divided by n, rounded to float32 once."""
    acc = to_np(grads[0]).astype(np.float64)
    for g in grads[1:]:
        acc = acc + to_np(g).astype(np.float64)
    return torch.from_numpy((acc / len(grads)).astype(np.float32))


def core_mean(grads) -> torch.Tensor:
    """The core's tower mean, read back through SGD with lr=1: p = -0 + (-1)*mean = -mean, bit for bit."""
    p = torch.full((grads[0].numel(),), -0.0)
    _C.sgd_step([B(p)], [[B(g)] for g in grads], [], [], [], lr=1.0)
    return -p


def spread_limit(dtype, towers) -> int:
    """Largest exponent spread with an exact float32 sum: 24 - p - ceil(log2 n)."""
    return (24 - (8 if dtype == torch.bfloat16 else 11)) - math.ceil(math.log2(towers))


def crafted_towers(dtype, towers, blocks, gen) -> list:
    """Blocks of 16 elements (plus a 7-element tail), each of one kind: exponent spreads at the limit of
    the float32 shortcut and one past it, full significands (sums that need all 24 bits), cancellation,
    zeros of both signs, tiny and huge values, and plain random ones."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    p = 8 if dtype == torch.bfloat16 else 11
    lim = spread_limit(dtype, towers)
    emin, emax = (-126, 127) if dtype == torch.bfloat16 else (-14, 15)
    n = 16 * blocks + 7
    x = np.zeros((towers, n))
    for b in range(blocks + 1):
        sl = slice(16 * b, min(n, 16 * b + 16))
        m = sl.stop - sl.start
        kind = b % 7
        full = (2.0 - 2.0 ** (1 - p))  # the largest significand
        low = 1.0 + 2.0 ** (1 - p)  # a significand whose last bit is set
        if kind in (0, 1):  # spread exactly at the limit (kind 0) or one past it (kind 1)
            hi = int(rng.integers(emin + lim + 1, emax - 3))
            lo = hi - lim - kind
            x[:, sl] = rng.choice([-1.0, 1.0], size=(towers, m)) * full * 2.0 ** hi
            # the smallest value at any position: first, its bits must survive every later addition
            x[rng.integers(0, towers, size=m), np.arange(sl.start, sl.stop)] = (
                rng.choice([-1.0, 1.0], size=m) * low * 2.0 ** lo)
        elif kind == 2:  # cancellation: x and -x, then small rests
            e = rng.integers(emin + 20, emax - 3, size=m)
            x[:, sl] = rng.integers(1, 2 ** (p - 1), size=(towers, m)) / 2.0 ** (p - 1) * 2.0 ** e
            x[1, sl] = -x[0, sl]
        elif kind == 3:  # zeros of both signs among values
            x[:, sl] = rng.standard_normal((towers, m)) * 1e-3
            x[:, sl] *= rng.random((towers, m)) < 0.5
            x[0, sl] = np.where(rng.random(m) < 0.5, -0.0, x[0, sl])
        elif kind == 4:  # tiny: subnormals and the smallest normals of the format
            x[:, sl] = rng.integers(-3, 4, size=(towers, m)) * 2.0 ** (emin - p + 1) * rng.integers(1, 9, size=(towers, m))
        elif kind == 5:  # huge: sums beyond the format's range (float32 keeps them for bfloat16)
            x[:, sl] = rng.choice([-1.0, 1.0], size=(towers, m)) * full * 2.0 ** emax
        else:  # random spreads
            x[:, sl] = rng.standard_normal((towers, m)) * 2.0 ** rng.integers(-18, 3, size=(towers, m))
    return [torch.from_numpy(row).to(dtype) for row in x]


@pytest.mark.parametrize("dtype", GRAD16)
@pytest.mark.parametrize("towers", [2, 3, 4, 5, 7, 8])
def test_float32_tower_mean_equals_float64_mean_at_the_limits(dtype, towers):
    gen = torch.Generator().manual_seed(towers * 17 + (dtype == torch.float16))
    grads = crafted_towers(dtype, towers, 70, gen)
    expect = mean64(grads)
    for level in simd_levels():
        with simd_level(level):
            assert bits_equal(core_mean(grads), expect), level


@pytest.mark.parametrize("dtype", GRAD16)
def test_float32_tower_mean_random_blocks_every_level(dtype):
    """Random gradients of similar magnitude (the shortcut almost everywhere), full Adam steps with a
    copy-out: every level equals the scalar one bit for bit."""
    n = 16 * 500 + 9
    results = {}
    for level in simd_levels():
        g2 = torch.Generator().manual_seed(4)
        p = torch.randn(n, generator=g2)
        m, v = torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=dtype)
        with simd_level(level):
            for step in range(1, 4):
                grads = [(torch.randn(n, generator=g2) * 1e-2).to(dtype) for _ in range(4)]
                _C.adam_step([B(p)], [[B(g)] for g in grads], [B(m)], [B(v)], [], [float(step)], [B(out)], lr=1e-3,
                             beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        results[level] = (p, m, v, out)
    for level, got in results.items():
        for x, y in zip(got, results["scalar"]):
            assert bits_equal(x, y), level


# ---- the inf/NaN scan

SCAN_SIZES = [1, 15, 17, 4097, 70001]  # 70001: several threads' slices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grads_finite_scan_agrees_with_grad_stats(dtype):
    gen = torch.Generator().manual_seed(21)
    towers = [[(torch.randn(n, generator=gen) * 100).to(dtype) for n in SCAN_SIZES] for _ in range(3)]
    bufs = [[B(g) for g in tw] for tw in towers]
    places = [(0, 0, 0), (2, 1, 14), (1, 2, 16), (0, 3, 4096), (2, 4, 70000), (1, 4, 35000)]
    for level in simd_levels():
        with simd_level(level):
            assert _C.grads_finite(bufs, 1.0) is True  # negative values among them: not inf
            for bad in (math.inf, -math.inf, math.nan):
                for t, s, i in places:
                    keep = towers[t][s][i].item()
                    towers[t][s][i] = bad
                    assert _C.grads_finite(bufs, 1.0) is False, (level, bad, t, s, i)
                    assert _C.grad_stats(bufs, 1.0, None)["finite"] is False
                    towers[t][s][i] = keep
            assert _C.grads_finite(bufs, 1.0) is True


def test_grads_finite_overflow_below_unit_scale():
    """A loss scale below 1 multiplies by more than 1, which can overflow: the full pass decides."""
    big, small = torch.full((40,), 3e38), torch.full((40,), 3e35)
    assert _C.grads_finite([[B(big)]], 1.0) is True
    assert _C.grads_finite([[B(big)]], 0.5) is False
    assert _C.grads_finite([[B(small)]], 0.5) is True


def norm_setup(dtype, towers, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [7, 4097, 70001, 33]
    grads = [[(torch.randn(n, generator=gen) * 3).to(dtype) for n in sizes] for _ in range(towers)]
    state = [[torch.randn(n, generator=gen) for n in sizes], [torch.zeros(n) for n in sizes],
             [torch.zeros(n) for n in sizes]]
    return sizes, grads, state


@pytest.mark.parametrize("dtype,towers", [(torch.float32, 1), (torch.bfloat16, 4), (torch.float16, 3),
                                          (torch.float32, 2), (torch.bfloat16, 1)])
@pytest.mark.parametrize("grad_scale,maximize,clip", [(1.0, False, 1.0), (8.0, True, 0.5)])
def test_check_reports_the_first_pass_norm(dtype, towers, grad_scale, maximize, clip):
    """skip_nonfinite's norm now comes from the update pass: the same bits as grad_stats (the old first
    pass), for Adam and SGD, at every level."""
    sizes, grads, (ps, ms, vs) = norm_setup(dtype, towers, towers * 5)
    gb = [[B(g) for g in tw] for tw in grads]
    expect = _C.grad_stats(gb, grad_scale, None)
    for level in simd_levels():
        with simd_level(level):
            r = _C.adam_step([B(p) for p in ps], gb, [B(m) for m in ms], [B(v) for v in vs], [], [1.0] * len(sizes),
                             [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=maximize,
                             grad_scale=grad_scale, check_finite=True, clip_coef=clip)
            assert not r["skipped"] and r["stats_computed"]
            assert r["grad_norm"] == expect["grad_norm"] and r["sumsq"] == expect["sumsq"], level
            r = _C.sgd_step([B(p) for p in ps], gb, [B(m) for m in ms], [True] * len(sizes), [], lr=0.1,
                            momentum=0.9, maximize=maximize, grad_scale=grad_scale, check_finite=True,
                            clip_coef=clip)
            assert r["grad_norm"] == expect["grad_norm"], level


def test_sumsq_start_continues_over_calls():
    """Segments stepped in two calls, the second continuing the first's sum: grad_stats' sum over all."""
    sizes, grads, (ps, ms, vs) = norm_setup(torch.bfloat16, 2, 8)
    gb = [[B(g) for g in tw] for tw in grads]
    expect = _C.grad_stats(gb, 1.0, None)
    for level in simd_levels():
        with simd_level(level):
            total = 0.0
            for part in (slice(0, 2), slice(2, 4)):
                r = _C.adam_step([B(p) for p in ps[part]], [row[part] for row in gb], [B(m) for m in ms[part]],
                                 [B(v) for v in vs[part]], [], [1.0, 1.0], [], lr=1e-3, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.0, sumsq_start=total)
                total = r["sumsq"]
            assert total == expect["sumsq"] and r["grad_norm"] == expect["grad_norm"], level


@pytest.mark.parametrize("kw,match", [(dict(sumsq_start=-1.0), "sumsq_start"),
                                      (dict(sumsq_start=math.inf), "sumsq_start"),
                                      (dict(sumsq_start=0.0, max_grad_norm=1.0), "sumsq_start")])
def test_sumsq_start_bad_values(kw, match):
    p, g, m, v = torch.zeros(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
    with pytest.raises(ValueError, match=match):
        _C.adam_step([B(p)], [[B(g)]], [B(m)], [B(v)], [], [1.0], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                     weight_decay=0.0, **kw)
    assert torch.equal(p, torch.zeros(5)) and torch.equal(m, torch.zeros(5))


def test_cpuadamw_groups_share_one_check_and_norm():
    """Two param groups: the scan covers both before either steps; the norm is grad_stats' over all
    gradients in group order; a NaN in the second group's scalar tail skips both."""
    gen = torch.Generator().manual_seed(31)
    a = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (70001, 19)]
    b = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (4097, 3)]
    opt = CPUAdamW([{"params": a}, {"params": b, "lr": 1e-2}], lr=1e-3, skip_nonfinite=True)
    for p in a + b:
        p.grad = torch.randn(p.shape, generator=gen)
    b[0].grad[-1] = math.nan
    assert opt.step()["skipped"] and len(opt.state) == 0
    b[0].grad[-1] = 0.5
    info = opt.step()
    expect = _C.grad_stats([[B(p.grad) for p in a + b]], 1.0, None)
    assert not info["skipped"] and info["grad_norm"] == expect["grad_norm"]
    before = [p.detach().clone() for p in a + b]
    states = [t.clone() for p in a + b for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    b[0].grad[4096] = -math.inf
    assert opt.step()["skipped"]
    for x, y in zip(a + b, before):
        assert bits_equal(x.detach(), y)
    for x, y in zip([t for p in a + b for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])], states):
        assert bits_equal(x, y)


# ---- Adam's compiled forms (Note [Adam's common configuration], Note [Unit gradient scale in Adam])

@pytest.mark.parametrize("decoupled,wd", [(True, 0.05), (True, 0.0), (False, 0.0), (False, 0.05)])
@pytest.mark.parametrize("beta1", [0.9, 0.3])
@pytest.mark.parametrize("grad_scale", [1.0, 2.0])
@pytest.mark.parametrize("dtype,towers", [(torch.float32, 1), (torch.bfloat16, 4)])
def test_adam_forms_match_float32_replay(decoupled, wd, beta1, grad_scale, dtype, towers):
    gen = torch.Generator().manual_seed(towers + int(10 * beta1))
    n = 16 * 6 + 5
    p0 = torch.randn(n, generator=gen)
    steps = [[(torch.randn(n, generator=gen) * 0.1).to(dtype) for _ in range(towers)] for _ in range(3)]
    rp, rm, rv = to_np(p0), np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step, grads in enumerate(steps, 1):
        ref_adam(rp, rm, rv, None, effective_grad(grads, grad_scale), step=step, lr=1e-2, beta1=beta1,
                 beta2=0.999, eps=1e-8, wd=wd, decoupled=decoupled)
    for level in simd_levels():
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        with simd_level(level):
            for step, grads in enumerate(steps, 1):
                _C.adam_step([B(p)], [[B(g)] for g in grads], [B(m)], [B(v)], [], [float(step)], [], lr=1e-2,
                             beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                             grad_scale=grad_scale)
        assert bits_equal(p, torch.from_numpy(rp)) and bits_equal(m, torch.from_numpy(rm)), level
        assert bits_equal(v, torch.from_numpy(rv)), level
