"""Property-based fuzzing (hypothesis) of shapes, dtypes and tower counts through the local
all_reduce_avg, GradientAverager and BucketPlan. Bounded example counts keep it to a few seconds."""
import math

import pytest
import torch

# hypothesis is a test extra of ncclavg but not on every machine (the GPU image has none): skip, not error
pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install 'ncclavg[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ncclavg import BucketPlan, Communicator, GradientAverager, LayoutMismatchError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
HALF_SUBNORMAL = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).filter(lambda s: math.prod(s) <= 3000)


def _values(shape, dtype, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _close_to_mean(got, inputs, comm_dtype=None):
    """Within the core's arithmetic of the float64 mean, element by element. The inputs are first rounded to
    the communication dtype when it is another one (its unit roundoff u_c times mean|x_i|); the core adds
    them in float32 (n - 1 roundings, <= gamma_{n-1} * sum|x_i|, Higham ch. 3) and divides once (2^-24 |mean|),
    within gamma_n * mean|x_i| together (gamma_n = n * 2^-24 / (1 - n * 2^-24)); rounds that to the
    communication dtype (u_c of it, or half a subnormal spacing where it underflows); and the cast back to
    got's dtype is exact (it has at least as many significand bits) unless it underflows there: half its
    subnormal spacing. A wrong divisor or a dropped tower is off by ~mean|x_i|."""
    dtype = got.dtype
    comm = comm_dtype or dtype
    assert comm in (dtype, torch.bfloat16)   # the only mixes here: see the docstring's last step
    x = torch.stack([t.double() for t in inputs])
    ref, scale = x.mean(0), x.abs().mean(0)
    n, u32, uc = len(inputs), UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[comm]
    err = (n * u32 / (1 - n * u32)) * scale
    if comm != dtype:
        err = uc * scale + (1 + uc) * err
    if comm != torch.float32:
        err = err + uc * (ref.abs() + err) + HALF_SUBNORMAL[comm]
    if comm != dtype:
        err = err + HALF_SUBNORMAL[dtype]
    return bool(((got.double() - ref).abs() <= err).all())


@FUZZ
@given(n=st.integers(1, 5), shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 100.0]), use_async=st.booleans())
def test_all_reduce_avg_local(n, shape, dtype, seed, scale, use_async):
    comm = Communicator.local(n)
    inputs = [_values(shape, dtype, seed + k, scale) for k in range(n)]
    xs = [x.clone() for x in inputs]
    if use_async:
        comm.all_reduce_avg_async(xs).wait()
    else:
        comm.all_reduce_avg(xs)
    for x in xs:
        assert x.shape == tuple(shape) and x.dtype == dtype
        assert torch.equal(x, xs[0])            # every tower holds the same bits
    assert _close_to_mean(xs[0], inputs)
    comm.close()


@FUZZ
@given(n=st.integers(1, 4), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), seed=st.integers(0, 10**6),
       dtype=st.sampled_from(DTYPES), k=st.integers(0, 6))
def test_all_reduce_avg_exact_inputs_bit_for_bit(n, shape, seed, dtype, k):
    """Small integers times a power of two whose sum n divides: the mean is exact in every dtype."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-16, 17, shape, generator=g).double() * 2.0 ** -k
    offsets = [torch.randint(-8, 9, shape, generator=g).double() * 2.0 ** -k for _ in range(n - 1)]
    parts = offsets + [-sum(offsets, torch.zeros(shape, dtype=torch.float64))]   # they sum to zero
    xs = [(base + p).to(dtype) for p in parts]
    assert all(torch.equal(x.double(), base + p) for x, p in zip(xs, parts))   # representable
    Communicator.local(n).all_reduce_avg(xs)
    for x in xs:
        assert torch.equal(x, base.to(dtype))


param_specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=12)


def _params(specs):
    return [torch.zeros(s, dtype=d, requires_grad=True) for s, d in specs]


@FUZZ
@given(specs=param_specs, cap=st.sampled_from([0.0005, 0.002, 0.01, 25.0]),
       first=st.sampled_from([0.0002, 0.001, 1.0]), grad_dtype=st.sampled_from([None] + DTYPES))
def test_bucket_plan_invariants(specs, cap, first, grad_dtype):
    params = _params(specs)
    plan = BucketPlan.build(params, bucket_cap_mb=cap, first_bucket_mb=first, grad_dtype=grad_dtype)
    assert len(plan.slots) == len(params)
    seen_groups = set()
    for b in plan.buckets:
        item = torch.empty((), dtype=b.dtype).element_size()
        assert b.numel * item % 256 == 0
        limit = (cap if (b.dtype, b.device) in seen_groups else first) * 2 ** 20
        seen_groups.add((b.dtype, b.device))
        end = 0
        for s in b.slots:   # reverse registration order, aligned, inside the bucket, no overlap
            assert s.bucket == b.index and plan.slots[s.index] is s
            assert s.offset * item % 256 == 0 and s.offset >= end
            end = s.offset + s.numel
            assert end <= b.numel
            assert b.dtype == (grad_dtype or params[s.index].dtype)
        assert [s.index for s in b.slots] == sorted((s.index for s in b.slots), reverse=True)
        if len(b.slots) > 1:   # a bucket over its size limit holds one oversized parameter only
            assert end * item <= int(limit)
    for i, (p, s) in enumerate(zip(params, plan.slots)):
        assert s.index == i and s.shape == tuple(p.shape) and s.numel == p.numel() and s.dtype == p.dtype
    assert plan.total_numel == sum(b.numel for b in plan.buckets)
    # deterministic, and sensitive to any layout change
    again = BucketPlan.build(_params(specs), bucket_cap_mb=cap, first_bucket_mb=first, grad_dtype=grad_dtype)
    assert again.fingerprint == plan.fingerprint
    plan.check_same_layout(_params(specs))
    j = len(specs) // 2
    changed = list(specs)
    changed[j] = (list(specs[j][0]) + [2], specs[j][1])
    other = BucketPlan.build(_params(changed), bucket_cap_mb=cap, first_bucket_mb=first, grad_dtype=grad_dtype)
    assert other.fingerprint != plan.fingerprint
    try:
        plan.check_same_layout(_params(changed), tower=3)
        raise AssertionError("check_same_layout accepted a different shape")
    except LayoutMismatchError as e:
        assert f"tower 3: parameter {j} has shape" in str(e), str(e)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 4), specs=param_specs, grad_dtype=st.sampled_from([None, torch.bfloat16]),
       seed=st.integers(0, 10**6), cap=st.sampled_from([0.0005, 0.01]))
def test_averager_grads_become_the_tower_mean(n, specs, grad_dtype, seed, cap):
    comm = Communicator.local(n)
    towers = [_params(specs) for _ in range(n)]
    avg = GradientAverager(comm, towers, bucket_cap_mb=cap, first_bucket_mb=cap / 2, grad_dtype=grad_dtype)
    grads = []
    for t in range(n):   # grads set by hand: the averager packs them into its buckets
        gs = [_values(p.shape, p.dtype, seed + 97 * t + i, 1.0) for i, p in enumerate(towers[t])]
        for p, g in zip(towers[t], gs):
            p.grad = g.clone()
        grads.append(gs)
    avg.average()
    for i in range(len(specs)):
        inputs = [grads[t][i] for t in range(n)]
        for t in range(n):
            got = towers[t][i].grad
            assert got.shape == inputs[0].shape and torch.equal(got, towers[0][i].grad)
        assert _close_to_mean(towers[0][i].grad, inputs, grad_dtype)
    avg.close()
    comm.close()
