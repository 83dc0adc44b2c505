import copy
import logging

import pytest
import torch
import torch.nn as nn

from ncclavg import Communicator, GradientAverager, LayoutMismatchError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gamma(k, u=2.0 ** -24):
    """gamma_k = k*u / (1 - k*u): the bound on the relative error of k float32 roundings (Higham, ch. 3)."""
    return k * u / (1 - k * u)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The models are tiny: torch's intra-op pool only adds barrier waits (badly so on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_shapes(n, gen):
    """n parameter shapes incl. size-0 and size-1 tensors."""
    shapes = []
    for i in range(n):
        r = int(torch.randint(0, 10, (), generator=gen))
        if i % 17 == 3:
            shapes.append((0,) if r % 2 else (3, 0))
        elif i % 13 == 5:
            shapes.append((1,))
        else:
            shapes.append(tuple(int(x) for x in torch.randint(1, 12, (1 + r % 3,), generator=gen)))
    return shapes


def make_tower(shapes, dtype):
    return [torch.zeros(s, dtype=dtype, requires_grad=True) for s in shapes]


def backward_with_grads(params, grads):
    """A backward pass whose gradient of params[i] is exactly grads[i]."""
    loss = sum((p * g).sum() for p, g in zip(params, grads))
    loss.backward()


def is_view_of(t, storage):
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
    return t.numel() == 0 or lo <= t.data_ptr() < hi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nparams", [1, 300])
@pytest.mark.parametrize("overlap", [True, False])
def test_local_average_equals_float64_mean(n, dtype, nparams, overlap):
    gen = torch.Generator().manual_seed(n * 1000 + nparams + DTYPES.index(dtype))
    shapes = random_shapes(nparams, gen)
    towers = [make_tower(shapes, dtype) for _ in range(n)]
    avg = GradientAverager(Communicator.local(n), towers, bucket_cap_mb=0.002, first_bucket_mb=0.001,
                           overlap=overlap)
    for step in range(2):
        grads = [[(torch.randn(s, generator=gen) * 4).to(dtype) for s in shapes] for _ in range(n)]
        for t in range(n):
            backward_with_grads(towers[t], grads[t])
        avg.average()
        for i, s in enumerate(shapes):
            stack = torch.stack([grads[t][i].double() for t in range(n)])
            truth, scale = stack.mean(0), stack.abs().mean(0)
            expect = (sum(grads[t][i].float() for t in range(n)) / n).to(dtype)
            for t in range(n):
                g = towers[t][i].grad
                assert g.dtype == dtype and g.shape == s
                assert torch.equal(g, expect), (t, i, s)
                if dtype == torch.float32:
                    # n - 1 float32 additions then one division: |error| <= gamma_{n-1} * sum|x_i| / n for the
                    # sum, plus u * |mean| for the division; both within gamma_n * mean|x_i| (u = 2^-24,
                    # gamma_k = k*u / (1 - k*u)). A wrong divisor or a dropped tower is off by ~|mean|.
                    assert bool(((g.double() - truth).abs() <= gamma(n) * scale).all())
                assert is_view_of(g, avg.bucket_storage(t, avg.plan.slots[i].bucket))
        for t in range(n):
            for p in towers[t]:
                p.grad = None   # set_to_none: the next backward's grads are foreign, packed, re-seated
    assert avg.stats["steps"] == 2 and avg.stats["bytes_reduced"] == 2 * avg.plan.total_bytes
    if n > 1 and nparams > 1:
        assert avg.stats["fallback_packs"] > 0
        if overlap:
            assert avg.stats["buckets_overlapped"] > 0


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def sgd_reference(model, batches, chunks=1, dtype=torch.float32):
    """Plain SGD of one copy of `model` on the full batches, each batch's gradient accumulated over `chunks`
    equal slices (each slice's mean loss / chunks), in `dtype`."""
    m = copy.deepcopy(model).to(dtype)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        for c in range(chunks):
            sl = slice(c * len(y) // chunks, (c + 1) * len(y) // chunks)
            (nn.functional.cross_entropy(m(x[sl].to(dtype)), y[sl]) / chunks).backward()
        opt.step()
    return list(m.parameters())


@pytest.mark.parametrize("model_cls,shape,classes", [(MLP, (12,), 3), (SmallCNN, (3, 8, 8), 5)])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_towers_on_split_batch_equal_one_model_on_full_batch(model_cls, shape, classes, n, overlap):
    torch.manual_seed(0)
    model = model_cls()
    towers = [copy.deepcopy(model) for _ in range(n)]
    avg = GradientAverager(Communicator.local(n), towers, bucket_cap_mb=0.004, first_bucket_mb=0.001,
                           overlap=overlap)
    opts = [torch.optim.SGD(t.parameters(), lr=0.1) for t in towers]
    gen = torch.Generator().manual_seed(1)
    batches = []
    for step in range(5):
        x = torch.randn(16, *shape, generator=gen)
        y = torch.randint(0, classes, (16,), generator=gen)
        batches.append((x, y))
        for t, (tower, opt) in enumerate(zip(towers, opts)):
            opt.zero_grad()
            sl = slice(t * 16 // n, (t + 1) * 16 // n)
            nn.functional.cross_entropy(tower(x[sl]), y[sl]).backward()
        avg.average()
        for opt in opts:
            opt.step()
    # Towers == one model on the full batch, up to float32 rounding that 5 steps carry through the model:
    # a measured noise floor, as in Note [Tolerance of training equivalence tests] (tests/train/
    # test_trainer.py). The floor is the largest distance from the reference (batch in one piece) of
    # equally valid runs: the batch's gradient accumulated over 2 and 4 slices, and the float64 run (the
    # reference's own float32 error). The towers are one more such run (nearest to the 2/4-slice ones), so
    # within 2 floors of the reference (triangle inequality); the floor is never below one fp32 ulp (2^-23
    # relative). Measured over 25 seeds x both models x 2 and 4 towers, with torch's default and AVX2
    # kernels: at most 0.5 of the tolerance. One tower's gradient instead of the mean is off by ~1e-2.
    ref = sgd_reference(model, batches)
    runs = [sgd_reference(model, batches, chunks) for chunks in (2, 4)]
    runs.append(sgd_reference(model, batches, dtype=torch.float64))
    floor = max(2.0 ** -23, max(max_rel(a, b) for run in runs for a, b in zip(run, ref)))
    for p_ref, *ps in zip(ref, *[t.parameters() for t in towers]):
        for p in ps:
            assert torch.equal(p, ps[0])          # replicas stay identical
        assert max_rel(ps[0], p_ref) <= 2 * floor, (max_rel(ps[0], p_ref), floor)
    assert avg.stats["fallback_packs"] == 0       # zero_grad(set_to_none) + forward pre-hook: zero-copy


def test_no_sync_accumulates_then_averages():
    torch.manual_seed(0)
    shapes = [(4, 3), (5,), (1,)]
    towers = [make_tower(shapes, torch.float32) for _ in range(2)]
    avg = GradientAverager(Communicator.local(2), towers)
    g = [[[torch.randn(s) for s in shapes] for _ in range(2)] for _ in range(3)]  # [micro][tower][param]
    with avg.no_sync():
        for m in range(2):
            for t in range(2):
                backward_with_grads(towers[t], g[m][t])
        with pytest.raises(RuntimeError, match="no_sync"):
            avg.average()
    for t in range(2):
        backward_with_grads(towers[t], g[2][t])
    avg.average()
    for i in range(len(shapes)):
        # Bit for bit: the same float32 additions in the same order. Each tower's .grad accumulates in place,
        # ((g0 + g1) + g2); the core adds the towers in order and halves (exact): so does `expect`.
        expect = (sum(g[m][0][i] for m in range(3)) + sum(g[m][1][i] for m in range(3))) / 2
        for t in range(2):
            assert torch.equal(towers[t][i].grad, expect)


@pytest.mark.parametrize("grad_dtype", ["bfloat16", torch.float16])
@pytest.mark.parametrize("overlap", [True, False])
def test_grad_dtype_compression(grad_dtype, overlap):
    gdt = torch.bfloat16 if grad_dtype == "bfloat16" else torch.float16
    gen = torch.Generator().manual_seed(2)
    shapes = random_shapes(40, gen)
    towers = [make_tower(shapes, torch.float32) for _ in range(3)]
    avg = GradientAverager(Communicator.local(3), towers, grad_dtype=grad_dtype, overlap=overlap,
                           bucket_cap_mb=0.001, first_bucket_mb=0.001)
    assert all(b.dtype == gdt for b in avg.plan.buckets)
    for step in range(2):
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
        for t in range(3):
            backward_with_grads(towers[t], grads[t])
        avg.average()
        for i in range(len(shapes)):
            # pack rounds each tower's grad to gdt; the mean is taken in fp32 and rounded to gdt once
            expect = (sum(grads[t][i].to(gdt).float() for t in range(3)) / 3).to(gdt).float()
            for t in range(3):
                assert towers[t][i].grad.dtype == torch.float32
                assert torch.equal(towers[t][i].grad, expect)
        for t in range(3):
            for p in towers[t]:
                p.grad = None
    assert avg.stats["fallback_packs"] >= 3 * len(avg.plan.buckets)


def test_mixed_dtypes_and_user_replaced_grads():
    gen = torch.Generator().manual_seed(4)
    shapes = [(3, 4), (7,), (2, 2)]
    dts = [torch.float32, torch.bfloat16, torch.float16]
    towers = [[torch.zeros(s, dtype=d, requires_grad=True) for s, d in zip(shapes, dts)] for _ in range(2)]
    avg = GradientAverager(Communicator.local(2), towers)
    assert len(avg.plan.buckets) == 3
    grads = [[torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dts)] for _ in range(2)]
    towers[1][0].grad = torch.zeros(3, 4)          # the user replaced .grad: backward accumulates there
    for t in range(2):
        backward_with_grads(towers[t], grads[t])
    assert not is_view_of(towers[1][0].grad, avg.bucket_storage(1, avg.plan.slots[0].bucket))
    avg.average()
    for i, d in enumerate(dts):
        expect = ((grads[0][i].float() + grads[1][i].float()) / 2).to(d)
        for t in range(2):
            assert torch.equal(towers[t][i].grad, expect)
            assert is_view_of(towers[t][i].grad, avg.bucket_storage(t, avg.plan.slots[i].bucket))


def test_params_without_grad_contribute_zeros(caplog):
    torch.manual_seed(0)
    towers = [[torch.ones(4, requires_grad=True), torch.ones(3, requires_grad=True)] for _ in range(2)]
    avg = GradientAverager(Communicator.local(2), towers)
    g0, g1 = torch.randn(4), torch.randn(3)
    backward_with_grads(towers[0], [g0, g1])       # tower 0 uses both
    (towers[1][0] * g0 * 3).sum().backward()       # tower 1 never touches parameter 1
    for t in range(2):
        towers[t][1].grad = None if t == 1 else towers[t][1].grad
    with caplog.at_level(logging.DEBUG, logger="ncclavg.averager"):
        avg.average()
        assert "parameter 1" in caplog.text and "contributes zeros" in caplog.text
    # (g0 + fl(3 * g0)) / 2 in float32: the product's and the sum's roundings (the halving is exact)
    assert bool(((towers[1][0].grad - g0 * 2).double().abs() <= gamma(2) * (g0 * 2).double().abs()).all())
    for t in range(2):
        assert torch.equal(towers[t][1].grad, g1 / 2)
    assert avg.stats["params_without_grad"] == 1


def test_backward_twice_without_average():
    towers = [[torch.ones(4, requires_grad=True)] for _ in range(2)]
    avg = GradientAverager(Communicator.local(2), towers, overlap=True)
    for t in range(2):
        (towers[t][0] * 2).sum().backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        (towers[1][0] * 2).sum().backward()
    avg2_towers = [[torch.ones(4, requires_grad=True)] for _ in range(2)]
    avg2 = GradientAverager(Communicator.local(2), avg2_towers, overlap=False)
    for _ in range(2):   # without overlap nothing is sent before average(): the grads just accumulate
        for t in range(2):
            (avg2_towers[t][0] * (t + 1)).sum().backward()
    avg2.average()
    assert torch.equal(avg2_towers[0][0].grad, torch.full((4,), 3.0))


def test_zero_grad_and_bucket_storage():
    towers = [[torch.ones(4, requires_grad=True), torch.ones(2, 2, requires_grad=True)] for _ in range(2)]
    avg = GradientAverager(Communicator.local(2), towers)
    for t in range(2):
        backward_with_grads(towers[t], [torch.ones(4), torch.ones(2, 2)])
    avg.average()
    st = avg.bucket_storage(1, 0)
    assert st.numel() == avg.plan.buckets[0].numel and float(st.sum()) == 8
    avg.zero_grad()
    assert float(st.sum()) == 0 and towers[1][0].grad is not None and float(towers[1][0].grad.sum()) == 0
    with pytest.raises(IndexError, match="tower"):
        avg.bucket_storage(2, 0)
    avg.close()


def hooks_of(p):
    return len(getattr(p, "_post_accumulate_grad_hooks", None) or {})


def state_of(towers):
    return [[(p.grad, hooks_of(p)) for p in tw if isinstance(p, torch.Tensor) and p.is_leaf]
            for tw in towers if isinstance(tw, list)]


def test_bad_input_raises_and_changes_nothing():
    def tower(shapes=((4, 3), (5,)), dtype=torch.float32):
        return [torch.ones(s, dtype=dtype, requires_grad=True) for s in shapes]

    comm = Communicator.local(2)
    shared = tower()
    cases = [
        (lambda: [tower(), tower(((4, 3), (6,)))], LayoutMismatchError, r"tower 1: parameter 1 .*\(6,\).*\(5,\)"),
        (lambda: [tower(), tower(dtype=torch.bfloat16)], LayoutMismatchError, r"parameter 0 .*bfloat16"),
        (lambda: [tower(), tower(((4, 3),))], LayoutMismatchError, "has 1 parameters"),
        (lambda: [tower(), [shared[0].detach().to("meta").requires_grad_(), shared[1]]], ValueError,
         r"towers\[1\]\[0\]: is on meta"),
        (lambda: [tower()], ValueError, "comm.local_size is 2"),
        (lambda: [tower(), tower(), tower()], ValueError, "comm.local_size is 2"),
        (lambda: [shared, shared], ValueError, r"towers\[1\]\[0\]: is the same tensor as towers\[0\]\[0\]"),
        (lambda: [shared, [shared[1], shared[0]]], ValueError, "same tensor"),
        (lambda: [tower(), [shared[0] * 2, shared[1]]], ValueError, r"towers\[1\]\[0\]: must be a leaf"),
        (lambda: [tower(), [torch.ones(4, 3), shared[1]]], ValueError, r"towers\[1\]\[0\]: must be a leaf"),
        (lambda: [tower(), "abc"], TypeError, r"towers\[1\]"),
        (lambda: [tower(), [1, 2]], TypeError, r"towers\[1\]\[0\]"),
        (lambda: [tower(dtype=torch.float64), tower(dtype=torch.float64)], TypeError, r"towers\[0\]\[0\]: dtype .*float64"),
    ]
    for make, exc, match in cases:
        towers = make()
        before = state_of(towers)
        with pytest.raises(exc, match=match):
            GradientAverager(comm, towers)
        assert state_of(towers) == before
    with pytest.raises(TypeError, match="towers"):
        GradientAverager(comm, nn.Linear(2, 2))
    with pytest.raises(TypeError, match="comm"):
        GradientAverager("gloo", [tower(), tower()])
    with pytest.raises(TypeError, match="grad_dtype"):
        GradientAverager(comm, [tower(), tower()], grad_dtype="int8")
    with pytest.raises(TypeError, match="overlap"):
        GradientAverager(comm, [tower(), tower()], overlap="yes")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        GradientAverager(comm, [tower(), tower()], bucket_cap_mb=0)

    towers = [tower(), tower()]
    avg = GradientAverager(comm, towers)
    for t in range(2):
        backward_with_grads(towers[t], [torch.full((4, 3), float(t)), torch.full((5,), float(t))])
    avg.average()
    saved = [p.grad.clone() for p in towers[0]]
    with pytest.raises(RuntimeError, match="twice without a backward"):
        avg.average()
    assert all(torch.equal(p.grad, s) for p, s in zip(towers[0], saved))


def test_modules_skip_frozen_and_keep_existing_grads():
    torch.manual_seed(0)
    m = MLP()
    m.net[0].bias.requires_grad_(False)
    towers = [copy.deepcopy(m) for _ in range(2)]
    towers[0].net[2].weight.grad = torch.ones_like(towers[0].net[2].weight)
    towers[1].net[2].weight.grad = torch.full_like(towers[1].net[2].weight, 3.0)
    avg = GradientAverager(Communicator.local(2), towers)
    assert len(avg.plan.slots) == 5 and avg.plan.slots[0].name == "net.0.weight"
    assert towers[0].net[0].bias.grad is None and float(towers[1].net[2].weight.grad[0, 0]) == 3.0
    x = torch.randn(4, 12)
    for tw in towers:
        tw(x).sum().backward()
    avg.average()
    w0, w1 = towers[0].net[2].weight.grad, towers[1].net[2].weight.grad
    assert torch.equal(w0, w1)
    fresh = copy.deepcopy(m)
    fresh(x).sum().backward()
    # The same model and input on one thread: the towers' backward gives fresh's G bit for bit. The towers
    # hold fl(1 + G) and fl(3 + G), the core averages them to fl(fl(1 + G) + fl(3 + G)) / 2 (halving is
    # exact): within 2u(|G| + 2) of G + 2, and fl(G + 2) within u|G + 2|, u = 2^-24; gamma(3) covers the
    # second-order terms. Dropping or double-counting a tower's old grad is off by >= 0.5.
    G = fresh.net[2].weight.grad
    assert bool(((w0 - (G + 2.0)).double().abs() <= gamma(3) * (G.double().abs() + 2)).all())


class _RecordingComm:
    """A local communicator whose Works log wait() / wait_stream() per bucket (the collective itself runs
    on the host, so a Work's wait_stream completes it: what matters here is who is called when)."""

    def __init__(self, n, stream_ordered=True):
        self._comm = Communicator.local(n)
        self.log, self._stream_ordered = [], stream_ordered

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_reduce_avg_async(self, tensors, defer_scale=False, **kw):
        work, log = self._comm.all_reduce_avg_async(tensors, defer_scale, **kw), self.log
        b = int(kw["tag"].split()[-1])   # the averager tags each collective "bucket <b>"

        class Logged:
            divisor, elapsed = work.divisor, None

            def wait(self, timeout=None):
                log.append(("wait", b))
                work.wait(timeout)

            def done(self):
                return work.done()

        if self._stream_ordered:
            def wait_stream(self):
                log.append(("order", b))
                work.wait()
            Logged.wait_stream = wait_stream
        return Logged()


@pytest.mark.parametrize("block", [None, False, True])
@pytest.mark.parametrize("stream_ordered", [True, False])
def test_cuda_finish_orders_each_bucket_and_blocks_once_at_the_end(block, stream_ordered):
    """The control flow of Note [Stream-ordered average], run on CPU tensors by marking the averager's
    towers as CUDA ones: each bucket is finished after wait_stream() of ITS OWN Work (no host wait), the
    host waits only at the end and only with block=True (None: a single-process communicator, no
    block); a Work without wait_stream() is waited for on the host bucket by bucket."""
    shapes = [(40,), (3, 7), (50,), (9,)]
    towers = [make_tower(shapes, torch.float32) for _ in range(3)]
    comm = _RecordingComm(3, stream_ordered)
    avg = GradientAverager(comm, towers, bucket_cap_mb=150 * 4 / 2 ** 20, first_bucket_mb=50 * 4 / 2 ** 20)
    nb = len(avg.plan.buckets)
    assert nb >= 2
    avg._cuda = True
    gen = torch.Generator().manual_seed(4)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in towers]
    for t in range(3):
        backward_with_grads(towers[t], grads[t])
    comm.log.clear()
    avg.average() if block is None else avg.average(block=block)
    if stream_ordered:
        want = [("order", b) for b in range(nb)] + ([("wait", b) for b in range(nb)] if block else [])
    else:
        want = [("wait", b) for b in range(nb)] * (2 if block else 1)
    assert comm.log == want
    for i in range(len(shapes)):   # and the mean is in place (the host arithmetic of test_local_average_...)
        mean = (grads[0][i] + grads[1][i] + grads[2][i]) / 3
        assert all(torch.equal(tw[i].grad, mean) for tw in towers)


def test_cpu_average_waits_for_each_bucket_whatever_block_says():
    """CPU towers: the collective IS host work, each Work is waited for in order; block changes nothing."""
    shapes = [(40,), (50,)]
    towers = [make_tower(shapes, torch.float32) for _ in range(2)]
    comm = _RecordingComm(2)
    avg = GradientAverager(comm, towers, bucket_cap_mb=50 * 4 / 2 ** 20, first_bucket_mb=40 * 4 / 2 ** 20)
    for block in (None, True, False):
        for t in range(2):
            backward_with_grads(towers[t], [torch.full(s, float(t)) for s in shapes])
        comm.log.clear()
        avg.average(block=block)
        assert comm.log == [("wait", 0), ("wait", 1)]
        assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for tw in towers for p in tw)
        avg.zero_grad()
    with pytest.raises(TypeError, match="block: expected a bool or None, got str"):
        avg.average(block="yes")
