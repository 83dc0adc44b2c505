"""The CUDA average_ kernel: float64 reference, crafted exact inputs bit for bit, bit-for-bit agreement
with the CPU kernel (they share the element math), buffers at every alignment (the 16-byte path, its
head and tail, and the element path), and bad input."""
from __future__ import annotations

import numpy as np
import pytest

from _bits import assert_same_bits
from _gpu import TORCH_DTYPES, assert_close_to_mean, bits, exact_rank_inputs, require_cuda, tdtype, to_f64
from ncclavg import ops

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 7, 4097, 1_000_003]


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("n", range(1, 9))
def test_average_matches_float64_and_cpu(dtype, n):
    torch = require_cuda()
    dt = tdtype(torch, dtype)
    for size in SIZES:
        gen = torch.Generator().manual_seed(1000 * n + size % 997)
        host = [(torch.randn(size, generator=gen) * 4).to(dt) for _ in range(n)]
        dev = [h.cuda() for h in host]
        ops.average_(dev)
        cpu = [h.clone() for h in host]
        ops.average_(cpu)
        torch.cuda.synchronize()
        ref = np.mean(np.stack([to_f64(h) for h in host]), axis=0) if size else np.zeros(0)
        absmax = np.max(np.abs(np.stack([to_f64(h) for h in host])), axis=0) if size else np.zeros(0)
        for k, d in enumerate(dev):
            assert np.array_equal(bits(d), bits(cpu[0])), f"n={n} size={size} {dtype}: GPU buffer {k} != CPU"
            assert_close_to_mean(to_f64(d), ref, absmax, n, dtype, f"n={n} size={size} {dtype} buffer {k}")


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_average_exact_inputs_bit_for_bit(dtype):
    torch = require_cuda()
    dt = tdtype(torch, dtype)
    for n in range(1, 9):
        for size in SIZES:
            x = exact_rank_inputs(n, size, seed=n * 7 + size % 13)
            dev = [torch.from_numpy(x[r]).to(dt).cuda() for r in range(n)]
            ops.average_(dev)
            want = torch.from_numpy(x.mean(axis=0)).to(dt)  # exact by construction
            torch.cuda.synchronize()
            for k, d in enumerate(dev):
                assert np.array_equal(bits(d), bits(want)), f"n={n} size={size} {dtype} buffer {k}"


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shifts", [(0, 0), (3, 3), (0, 1), (1, 2, 3), (5, 5, 5, 5, 5, 5)])
def test_average_unaligned_buffers_match_cpu(dtype, shifts):
    # Buffers starting `shift` elements into their storage: equal shifts share a 16-byte head, unequal
    # ones go element by element. 5 and 6 buffers leave partial groups of the kernel's 4-buffer loads.
    torch = require_cuda()
    dt = tdtype(torch, dtype)
    for size in (1, 7, 9, 17, 4097, 100_003):
        gen = torch.Generator().manual_seed(size + 31 * len(shifts))
        host = [(torch.randn(size + 8, generator=gen) * 4).to(dt)[k:k + size] for k in shifts]
        dev = [torch.empty(size + 8, dtype=dt, device="cuda")[k:k + size].copy_(h) for k, h in zip(shifts, host)]
        ops.average_(dev)
        cpu = [h.clone() for h in host]
        ops.average_(cpu)
        torch.cuda.synchronize()
        for k, d in enumerate(dev):
            assert_same_bits(d, cpu[0], f"{dtype} shifts={shifts} size={size} buffer {k}")


def test_average_runs_on_the_current_stream():
    torch = require_cuda()
    side = torch.cuda.Stream()
    a = torch.zeros(1 << 20, device="cuda")
    b = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # keeps the side stream busy, so a missing ordering shows
        a.fill_(2.0)
        b.fill_(4.0)
        ops.average_([a, b])
    side.synchronize()
    assert torch.all(a == 3.0) and torch.all(b == 3.0)


def test_average_bad_input_names_the_argument_and_changes_nothing():
    torch = require_cuda()
    a = torch.full((100,), 1.0, device="cuda")
    b = torch.full((100,), 2.0, device="cuda")
    cases = [
        ([a, b.cpu()], ValueError, "buffers[1]"),
        ([a, b.half()], TypeError, "buffers[1]"),
        ([a, b[:50]], ValueError, "buffers[1]"),
        ([a, a], ValueError, "buffers"),
        ([a, b.view(10, 10).t()], ValueError, "buffers[1]"),
        ([], ValueError, "buffers"),
        ([a, b.int()], TypeError, "buffers[1]"),
    ]
    for bufs, exc, name in cases:
        with pytest.raises(exc, match=name.replace("[", r"\[").replace("]", r"\]")):
            ops.average_(bufs)
    torch.cuda.synchronize()
    assert torch.all(a == 1.0) and torch.all(b == 2.0)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match=r"buffers\[1\]"):
            ops.average_([a, b.to("cuda:1")])
