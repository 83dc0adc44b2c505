"""Bodies of the `ncclavg` backend's matrix tests (tests/process_group/test_backend_matrix.py): every collective x
every dtype x every op the docs list, (a) called alike on every rank, against a wide reference computed
here from every rank's input (Python integers for integer dtypes, float64 for floating ones), and (b)
with one rank making another call: an error on every rank, naming both calls, well within the timeout.
The references are written apart from the backend's code on purpose: they share nothing with it."""
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from _process_group_workers import init_backend

R = dist.ReduceOp
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]
COMPLEX = [torch.complex64, torch.complex128]
INTS = [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64, torch.uint64]
DTYPES = FLOATS + FLOAT8 + COMPLEX + INTS + [torch.bool]
FLOAT_OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT", "PREMUL_SUM"]
INT_OPS = ["SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"]
PREMUL = 0.5


def ops_for(dtype):
    """The ops docs/stock_pytorch.md lists for a dtype."""
    if dtype.is_complex:
        return ["SUM", "AVG", "PREMUL_SUM"]
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def reduce_op(name):
    return dist._make_nccl_premul_sum(PREMUL) if name == "PREMUL_SUM" else getattr(R, name)


# ---------------------------------------------------------------------------------------------- inputs
def make_input(rank, numel, dtype, seed, op="SUM"):
    """Rank `rank`'s input. Floats: multiples of 1/4 in [-4, 4) (PRODUCT: +-1, +-2, 1/2), exact in every
    dtype here, so the only error is the result's rounding. Integers: the whole range of the type, so
    that sums and products wrap and averages would overflow a narrow sum; bool: 0 and 1."""
    g = np.random.default_rng(seed * 7919 + rank)
    if dtype == torch.bool:
        return torch.from_numpy(g.integers(0, 2, numel).astype(np.bool_))
    if dtype.is_floating_point or dtype.is_complex:
        if op == "PRODUCT":
            vals = g.choice(np.array([1.0, -1.0, 2.0, 0.5, -2.0]), numel)
        else:
            vals = g.integers(-16, 16, numel) * 0.25
        t = torch.from_numpy(vals)
        if dtype.is_complex:
            t = torch.complex(t, t.flip(0) * 0.5)
        return t.to(dtype)
    info = torch.iinfo(dtype)
    npd = np.dtype(str(dtype).replace("torch.", ""))
    vals = g.integers(info.min, info.max, numel, dtype=npd, endpoint=True)
    return torch.from_numpy(vals)


# ---------------------------------------------------------------------------------------------- references
def _ints(t):
    return [int(v) for v in t.tolist()]


def _wrap(values, dtype):
    """Python integers wrapped into `dtype` (two's complement), as a tensor."""
    bits = torch.iinfo(dtype).bits
    signed = torch.iinfo(dtype).min < 0
    out = []
    for v in values:
        v %= 1 << bits
        if signed and v >= 1 << (bits - 1):
            v -= 1 << bits
        out.append(v)
    return torch.from_numpy(np.array(out, dtype=np.dtype(str(dtype).replace("torch.", "")))) if out else \
        torch.empty(0, dtype=dtype)


def reference(xs, name, dtype):
    """The exact result (integers: Python integers, wrapped for SUM and PRODUCT; AVG rounded toward zero;
    floats: float64 / complex128), for comparison with `close`."""
    world = len(xs)
    n = xs[0].numel()
    if dtype == torch.bool:
        rows = [_ints(x) for x in xs]
        cols = list(zip(*rows)) if n else []
        if name in ("SUM", "MAX", "BOR", "AVG"):
            return torch.tensor([any(c) for c in cols], dtype=torch.bool)
        if name in ("PRODUCT", "MIN", "BAND"):
            return torch.tensor([all(c) for c in cols], dtype=torch.bool)
        return torch.tensor([sum(c) % 2 == 1 for c in cols], dtype=torch.bool)
    if not (dtype.is_floating_point or dtype.is_complex):
        cols = list(zip(*[_ints(x) for x in xs])) if n else []
        if name == "SUM":
            return _wrap([sum(c) for c in cols], dtype)
        if name == "PRODUCT":
            out = []
            for c in cols:
                p = 1
                for v in c:
                    p *= v
                out.append(p)
            return _wrap(out, dtype)
        if name == "AVG":   # toward zero, exact
            return _wrap([(abs(sum(c)) // world) * (1 if sum(c) >= 0 else -1) for c in cols], dtype)
        if name in ("MIN", "MAX"):
            return _wrap([(min if name == "MIN" else max)(c) for c in cols], dtype)
        out = []
        for c in cols:
            acc = c[0]
            for v in c[1:]:
                acc = acc & v if name == "BAND" else acc | v if name == "BOR" else acc ^ v
            out.append(acc)
        return _wrap(out, dtype)
    wide = torch.stack([x.to(torch.complex128 if dtype.is_complex else torch.float64) for x in xs])
    if name in ("SUM", "PREMUL_SUM"):
        return wide.sum(0) * (PREMUL if name == "PREMUL_SUM" else 1.0)
    if name == "AVG":
        return wide.sum(0) / world
    if name == "PRODUCT":
        return wide.prod(0)
    return wide.amin(0) if name == "MIN" else wide.amax(0)


def close(ours, want, dtype):
    """Integers and bool: equal. Floating point: each result is the exact value rounded once or twice to
    `dtype` (an fp32 accumulation, then the element type), so within one unit of the last place of the
    dtype at the value: eps(dtype) * |want| (eps is the spacing at 1.0; the spacing at x is <= eps * |x|),
    and the inputs are multiples of 1/4 so no result lies in the subnormal range but 0, which is exact."""
    if ours.dtype != dtype or ours.shape != want.shape:
        return False
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.equal(ours, want)
    got = ours.to(want.dtype)
    eps = torch.finfo(dtype if dtype.is_floating_point else torch.empty(0, dtype=dtype).real.dtype).eps
    return bool(((got - want).abs() <= eps * want.abs()).all())


# ---------------------------------------------------------------------------------------------- same call
def run_same_calls(rank, world, sizes):
    """Every collective x dtype x op, called alike on every rank, against the references."""
    checked = 0
    for di, dtype in enumerate(DTYPES):
        for numel in sizes:
            checked += _reductions(rank, world, dtype, numel, seed=di * 100 + numel)
            checked += _movement(rank, world, dtype, numel, seed=di * 100 + numel + 1)
    dist.barrier()
    return checked


def _reductions(rank, world, dtype, numel, seed):
    checked = 0
    for name in ops_for(dtype):
        xs = [make_input(r, numel * world, dtype, seed, name) for r in range(world)]
        whole = reference(xs, name, dtype)
        mine = xs[rank]
        what = (str(dtype), name, numel)
        # all_reduce
        t = mine.clone()
        dist.all_reduce(t, op=reduce_op(name))
        assert close(t, whole, dtype), ("all_reduce",) + what
        # reduce to the last rank: the others keep their input
        root = world - 1
        t = mine.clone()
        dist.reduce(t, dst=root, op=reduce_op(name))
        assert close(t, whole, dtype) if rank == root else torch.equal(t, mine), ("reduce",) + what
        # reduce_scatter_tensor and reduce_scatter: this rank's slice
        shard = whole[rank * numel:(rank + 1) * numel]
        out = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine.clone(), op=reduce_op(name))
        assert close(out, shard, dtype), ("reduce_scatter_tensor",) + what
        out = torch.empty(numel, dtype=dtype)
        dist.reduce_scatter(out, list(mine.clone().chunk(world)) if numel else [mine[:0]] * world,
                            op=reduce_op(name))
        assert close(out, shard, dtype), ("reduce_scatter",) + what
        # all_reduce_coalesced: two tensors of one dtype
        a, b = mine[:numel].clone(), mine[numel:].clone()
        dist.all_reduce_coalesced([a, b], op=reduce_op(name))
        assert close(a, whole[:numel], dtype) and close(b, whole[numel:], dtype), ("all_reduce_coalesced",) + what
        checked += 5
    return checked


def _movement(rank, world, dtype, numel, seed):
    xs = [make_input(r, numel, dtype, seed) for r in range(world)]
    mine = xs[rank]
    what = (str(dtype), numel)
    for root in range(world):
        t = mine.clone()
        dist.broadcast(t, src=root)
        assert torch.equal(t, xs[root]), ("broadcast", root) + what
    out = torch.empty(world * numel, dtype=dtype)
    dist.all_gather_into_tensor(out, mine)
    assert torch.equal(out, torch.cat(xs)), ("all_gather_into_tensor",) + what
    outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, mine)
    assert all(torch.equal(o, x) for o, x in zip(outs, xs)), ("all_gather",) + what
    root = world - 1
    got = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
    dist.gather(mine, got, dst=root)
    assert rank != root or all(torch.equal(o, x) for o, x in zip(got, xs)), ("gather",) + what
    pieces = [make_input(r + 10, numel, dtype, seed) for r in range(world)]
    out = torch.empty(numel, dtype=dtype)
    dist.scatter(out, pieces if rank == root else None, src=root)
    assert torch.equal(out, pieces[rank]), ("scatter",) + what
    # all_to_all_single: rank r's k-th block goes to rank k
    blocks = [make_input(r, numel * world, dtype, seed + 5) for r in range(world)]
    out = torch.empty(numel * world, dtype=dtype)
    dist.all_to_all_single(out, blocks[rank])
    want = torch.cat([blocks[r][rank * numel:(rank + 1) * numel] for r in range(world)])
    assert torch.equal(out, want), ("all_to_all_single",) + what
    outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
    dist.all_to_all(outs, list(blocks[rank].chunk(world)) if numel else [blocks[rank]] * world)
    assert all(torch.equal(o, blocks[r][rank * numel:(rank + 1) * numel]) for r, o in enumerate(outs)), \
        ("all_to_all",) + what
    dist.barrier()
    return 8


def same_calls_job(rank, world, port, sizes, layout=None):
    init_backend(rank, world, port, timeout_s=120, layout=layout)
    checked = run_same_calls(rank, world, sizes)
    assert checked > 0


# ---------------------------------------------------------------------------------------------- mismatches
# (what the call is named in the error, the call on a group). Each pair below: the first rank(s) make the
# first call, the last rank the second; some pairs move the very same bytes on the channel.
def _calls(world):
    i4, i8, u8 = torch.int32, torch.int64, torch.uint8
    last = world - 1
    first_only = lambda g, x: x if dist.get_rank(g) == 0 else None   # noqa: E731 (the root's list)
    return {
        "barrier": ("barrier", lambda g: dist.barrier(group=g)),
        "all_reduce 1 float32": ("all_reduce(SUM) of 1 float32", lambda g: dist.all_reduce(torch.ones(1), group=g)),
        "all_reduce 0 float32": ("all_reduce(SUM) of 0 float32", lambda g: dist.all_reduce(torch.ones(0), group=g)),
        "all_reduce 10 float32": ("all_reduce(SUM) of 10 float32",
                                  lambda g: dist.all_reduce(torch.ones(10), group=g)),
        "all_reduce MAX 4 float32": ("all_reduce(MAX) of 4 float32",
                                     lambda g: dist.all_reduce(torch.ones(4), op=R.MAX, group=g)),
        "all_reduce 4 int32": ("all_reduce(SUM) of 4 int32",
                               lambda g: dist.all_reduce(torch.ones(4, dtype=i4), group=g)),
        "all_reduce MAX 4 int32": ("all_reduce(MAX) of 4 int32",
                                   lambda g: dist.all_reduce(torch.ones(4, dtype=i4), op=R.MAX, group=g)),
        "all_reduce 2 int64": ("all_reduce(SUM) of 2 int64",
                               lambda g: dist.all_reduce(torch.ones(2, dtype=i8), group=g)),
        "all_gather_into_tensor 16 uint8": ("all_gather_into_tensor of 16 uint8", lambda g: dist.all_gather_into_tensor(
            torch.empty(16 * world, dtype=u8), torch.ones(16, dtype=u8), group=g)),
        "all_gather 4 float32": ("all_gather of 4 float32", lambda g: dist.all_gather(
            [torch.empty(4) for _ in range(world)], torch.ones(4), group=g)),
        "broadcast float32 from 0": (f"broadcast of {4 * world} float32 from root 0",
                                     lambda g: dist.broadcast(torch.ones(4 * world), src=0, group=g)),
        "broadcast int32 from 0": (f"broadcast of {4 * world} int32 from root 0",
                                   lambda g: dist.broadcast(torch.ones(4 * world, dtype=i4), src=0, group=g)),
        "broadcast float32 from last": (f"broadcast of {4 * world} float32 from root {last}",
                                        lambda g: dist.broadcast(torch.ones(4 * world), src=last, group=g)),
        "scatter 4 float32": ("scatter of 4 float32 from root 0", lambda g: dist.scatter(
            torch.empty(4), first_only(g, [torch.ones(4)] * world), src=0, group=g)),
        "reduce to 0": ("reduce(SUM) of 4 float32 to root 0", lambda g: dist.reduce(torch.ones(4), dst=0, group=g)),
        "reduce to last": (f"reduce(SUM) of 4 float32 to root {last}",
                           lambda g: dist.reduce(torch.ones(4), dst=last, group=g)),
        "all_to_all_single 4 float32": (f"all_to_all_single of {4 * world} float32", lambda g: dist.all_to_all_single(
            torch.empty(4 * world), torch.ones(4 * world), group=g)),
        # count 0 on one rank: each must still meet its peers' call (an early return used to skip it)
        "broadcast 0 float32": ("broadcast of 0 float32 from root 0",
                                lambda g: dist.broadcast(torch.ones(0), src=0, group=g)),
        "all_gather_into_tensor 0 float32": ("all_gather_into_tensor of 0 float32", lambda g: dist.all_gather_into_tensor(
            torch.empty(0), torch.ones(0), group=g)),
        "all_gather_into_tensor 4 float32": ("all_gather_into_tensor of 4 float32", lambda g: dist.all_gather_into_tensor(
            torch.empty(4 * world), torch.ones(4), group=g)),
        "scatter 0 float32": ("scatter of 0 float32 from root 0", lambda g: dist.scatter(
            torch.empty(0), first_only(g, [torch.ones(0)] * world), src=0, group=g)),
        "reduce_scatter_tensor 0 float32": ("reduce_scatter_tensor(SUM) of 0 float32",
                                            lambda g: dist.reduce_scatter_tensor(torch.empty(0), torch.ones(0), group=g)),
        "reduce_scatter_tensor 4 float32": ("reduce_scatter_tensor(SUM) of 4 float32",
                                            lambda g: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world),
                                                                                 group=g)),
    }


# the cases that paired silently before (an empty tensor, and calls that move the same bytes), then
# pairs that differ in one field only (op, dtype, root, count)
PAIRS_QUICK = [
    ("all_reduce 0 float32", "all_reduce 10 float32"),
    ("barrier", "all_reduce 1 float32"),
    ("all_reduce 4 int32", "all_gather_into_tensor 16 uint8"),
    ("all_reduce MAX 4 float32", "all_gather 4 float32"),
    ("scatter 4 float32", "broadcast float32 from 0"),
    ("all_reduce 4 int32", "all_reduce 2 int64"),
    ("all_reduce MAX 4 int32", "all_reduce 4 int32"),
    ("broadcast float32 from 0", "broadcast int32 from 0"),
    ("broadcast float32 from 0", "broadcast float32 from last"),
    ("reduce to 0", "reduce to last"),
    ("all_to_all_single 4 float32", "barrier"),
    ("reduce_scatter_tensor 4 float32", "all_reduce MAX 4 float32"),
    ("broadcast 0 float32", "broadcast float32 from 0"),
    ("all_gather_into_tensor 0 float32", "all_gather_into_tensor 4 float32"),
    ("scatter 0 float32", "scatter 4 float32"),
    ("reduce_scatter_tensor 0 float32", "reduce_scatter_tensor 4 float32"),
]


def mismatch_job(rank, world, port, pairs, outdir, layout=None, timeout_s=20):
    """For each pair: a fresh group, rank world-1 makes the second call, the others the first; every rank
    must fail with both calls named, well within the group's timeout. Reports go to `outdir`."""
    import json

    init_backend(rank, world, port, timeout_s=120, layout=layout)
    table = _calls(world)
    results = []
    for first, second in pairs:
        g = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        name, call = table[second] if rank == world - 1 else table[first]
        t0 = time.monotonic()
        try:
            call(g)
            results.append({"pair": [first, second], "error": None, "elapsed": time.monotonic() - t0})
        except Exception as e:   # noqa: BLE001 (judged by the test)
            results.append({"pair": [first, second], "type": type(e).__name__, "error": str(e),
                            "elapsed": time.monotonic() - t0,
                            "names": [table[first][0], table[second][0]]})
        dist.destroy_process_group(g)
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
