import os
import subprocess
import sys

import pytest
import torch

from ncclavg import LayoutMismatchError
from ncclavg.bucketing import ALIGN_BYTES, BucketPlan

MiB = 2**20


def make_params(shapes, dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def check_invariants(plan, params):
    seen = set()
    assert len(plan.slots) == len(params)
    for b in plan.buckets:
        item = torch.empty((), dtype=b.dtype).element_size()
        assert b.nbytes == b.numel * item and b.nbytes % ALIGN_BYTES == 0
        prev_end = 0
        # slots are in backward order: descending parameter index, increasing offsets
        idx = [s.index for s in b.slots]
        assert idx == sorted(idx, reverse=True)
        for s in b.slots:
            assert s.bucket == b.index and plan.slots[s.index] is s
            assert (s.offset * item) % ALIGN_BYTES == 0
            assert s.offset >= prev_end and s.offset + s.numel <= b.numel
            prev_end = s.offset + s.numel
            assert s.shape == tuple(params[s.index].shape) and s.dtype == params[s.index].dtype
            seen.add(s.index)
    assert seen == set(range(len(params)))


def test_reverse_order_and_alignment():
    shapes = [(3, 5), (0,), (1,), (7,), (0, 4), (130,), (2, 2, 2)]
    params = make_params(shapes)
    plan = BucketPlan.build(params)
    check_invariants(plan, params)
    assert len(plan.buckets) == 1
    assert [s.index for s in plan.buckets[0].slots] == [6, 5, 4, 3, 2, 1, 0]
    # offsets: each slot starts at the next multiple of 64 fp32 elements (256 bytes)
    offs = {s.index: s.offset for s in plan.buckets[0].slots}
    assert offs[6] == 0 and offs[5] == 64 and offs[4] == 256 and offs[3] == 256 and offs[2] == 320
    assert plan.param_numel == sum(p.numel() for p in params)


def test_first_bucket_small_then_cap():
    # 40 params of 64 KiB each (fp32): first bucket 128 KiB, then 512 KiB buckets
    params = make_params([(16384,)] * 40)
    plan = BucketPlan.build(params, bucket_cap_mb=0.5, first_bucket_mb=0.125)
    check_invariants(plan, params)
    sizes = [len(b.slots) for b in plan.buckets]
    assert sizes[0] == 2 and all(s == 8 for s in sizes[1:-1]) and sum(sizes) == 40
    assert plan.buckets[0].slots[0].index == 39
    assert plan.buckets[-1].slots[-1].index == 0


def test_param_larger_than_cap_gets_own_bucket():
    params = make_params([(10,), (1 << 20,), (10,)])
    plan = BucketPlan.build(params, bucket_cap_mb=1, first_bucket_mb=1)
    check_invariants(plan, params)
    assert [[s.index for s in b.slots] for b in plan.buckets] == [[2], [1], [0]]


def test_group_by_dtype_and_grad_dtype():
    params = [torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3),
              torch.zeros(5, dtype=torch.float16)]
    plan = BucketPlan.build(params)
    check_invariants(plan, params)
    assert sorted(str(b.dtype) for b in plan.buckets) == ["torch.bfloat16", "torch.float16", "torch.float32"]
    for b in plan.buckets:
        assert all(s.dtype == b.dtype for s in b.slots)
    # grad_dtype: one bf16 bucket group; slots keep the parameter dtype; 128-element alignment
    plan2 = BucketPlan.build([torch.zeros(10), torch.zeros(3)], grad_dtype="bf16")
    assert len(plan2.buckets) == 1 and plan2.buckets[0].dtype == torch.bfloat16
    assert plan2.slots[0].dtype == torch.float32 and plan2.slots[0].offset == 128
    assert plan2.buckets[0].numel == 256


def test_size_zero_only():
    params = make_params([(0,), (0, 3)])
    plan = BucketPlan.build(params)
    check_invariants(plan, params)
    assert plan.total_numel == 0
    storage = plan.allocate()[0]
    assert plan.slot_view(storage, 1).shape == (0, 3)


def test_slot_views_do_not_overlap():
    torch.manual_seed(0)
    shapes = [tuple(int(x) for x in torch.randint(0, 9, (torch.randint(1, 4, ()).item(),))) for _ in range(60)]
    params = make_params(shapes)
    plan = BucketPlan.build(params, bucket_cap_mb=0.001, first_bucket_mb=0.0005)
    check_invariants(plan, params)
    storages = plan.allocate()
    for i in range(len(params)):
        plan.slot_view(storages[plan.slots[i].bucket], i).fill_(i + 1)
    for i in range(len(params)):
        v = plan.slot_view(storages[plan.slots[i].bucket], i)
        assert bool((v == i + 1).all())


def test_fingerprint_changes_with_layout():
    base = BucketPlan.build(make_params([(3, 4), (5,)])).fingerprint
    assert 0 <= base < 2**64
    assert BucketPlan.build(make_params([(3, 4), (5,)])).fingerprint == base
    assert BucketPlan.build(make_params([(4, 3), (5,)])).fingerprint != base          # shape
    assert BucketPlan.build(make_params([(5,), (3, 4)])).fingerprint != base          # order
    assert BucketPlan.build(make_params([(3, 4), (5,)], torch.float16)).fingerprint != base  # dtype
    big = make_params([(16384,)] * 8)
    assert (BucketPlan.build(big, first_bucket_mb=0.0625).fingerprint
            != BucketPlan.build(big, first_bucket_mb=0.125).fingerprint)             # boundaries


def test_fingerprint_stable_across_processes():
    code = ("import torch; from ncclavg.bucketing import BucketPlan;"
            "print(BucketPlan.build([torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)],"
            " names=['a', 'b']).fingerprint)")
    # another process with another string-hash salt computes the same fingerprint
    env = dict(os.environ, PYTHONHASHSEED=str(hash("x") % 1000 + 1))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert r.returncode == 0, r.stderr
    here = BucketPlan.build([torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16)]).fingerprint
    assert int(r.stdout.strip()) == here


def test_check_same_layout_names_first_mismatch():
    names = ["w0", "w1", "w2"]
    plan = BucketPlan.build(make_params([(2, 3), (4,), (5,)]), names=names)
    plan.check_same_layout(make_params([(2, 3), (4,), (5,)]), tower=1)
    with pytest.raises(LayoutMismatchError) as e:
        plan.check_same_layout(make_params([(2, 3), (4, 1), (6,)]), names=names, tower=2)
    msg = str(e.value)
    assert "tower 2" in msg and "parameter 1" in msg and "'w1'" in msg and "(4, 1)" in msg and "(4,)" in msg
    with pytest.raises(LayoutMismatchError, match=r"parameter 2 .*float16"):
        plan.check_same_layout([torch.zeros(2, 3), torch.zeros(4), torch.zeros(5, dtype=torch.float16)])
    with pytest.raises(LayoutMismatchError, match=r"has 2 parameters .* has 3.*missing parameter 2 \('w2'\)"):
        plan.check_same_layout(make_params([(2, 3), (4,)]), tower=1)
    with pytest.raises(LayoutMismatchError, match=r"extra parameter 3"):
        plan.check_same_layout(make_params([(2, 3), (4,), (5,), (1,)]), tower=1)
    assert issubclass(LayoutMismatchError, ValueError)


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match=r"params\[1\]"):
        BucketPlan.build([torch.zeros(2), "x"])
    with pytest.raises(TypeError, match=r"params\[0\].*float64"):
        BucketPlan.build([torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(TypeError, match="params"):
        BucketPlan.build(torch.zeros(3))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketPlan.build([torch.zeros(2)], bucket_cap_mb=0)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        BucketPlan.build([torch.zeros(2)], first_bucket_mb=-1)
    with pytest.raises(TypeError, match="grad_dtype"):
        BucketPlan.build([torch.zeros(2)], grad_dtype="int8")
    with pytest.raises(ValueError, match="names"):
        BucketPlan.build([torch.zeros(2)], names=["a", "b"])
