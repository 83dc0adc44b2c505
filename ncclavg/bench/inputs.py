"""Exact inputs for `ncclavg bench` and the bit-for-bit checker behind its #wrong column.

Note [Exact bench inputs]
~~~~~~~~~~~~~~~~~~~~~~~~~
nccl-tests fills buffers so the expected result is known and counts the elements that differ (#wrong).
For an AVERAGE the expected value must be exact in float32, float16 and bfloat16 whatever order the
contender adds in (ring, tree, pairwise, fp32 or storage-type accumulation). Element i of participant r
holds

    x[r, i] = (a[i] + d[r, i]) * 2**e[i]      with   sum over r of d[r, i] == 0

so the mean is a[i] * 2**e[i] exactly. a, d are small integers and every partial sum of any subset of
participants stays an integer no larger than the dtype's exact-integer range (bfloat16: 256, float16:
2048, float32: 2**24); the amplitudes shrink as the number of participants n grows to keep that true.
The d's pair participants as +s / -s (one 0 when n is odd), rotated with i so every participant holds
different data. The exponent e in [-3, 3] keeps everything a normal number in every dtype.

Consequences: any correct sum-then-divide (or fp32-accumulate-then-round) average is bit-exact; a
contender that forgets to divide, drops a participant, reads the wrong offset or mixes buckets differs
on almost every element. An implementation that pre-multiplies by 1/n is exact when n is a power of
two; for other n its rounding may legitimately show up as #wrong (ncclavg divides, see mean_of_sum).

The pattern depends on i only through i mod PERIOD (a prime, so it does not line up with vector
widths, cache lines or chunk sizes): the sweep fills and checks 1 GiB buffers with broadcast copies of
one period instead of recomputing a hash per element.
"""
from __future__ import annotations

import torch

PERIOD = 65521  # the largest prime below 2**16

# Largest integer m such that every integer in [-m, m] is exactly representable.
_EXACT_INT_RANGE = {torch.float32: 2 ** 24, torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}
# The same bits viewed as integers: the checker compares representations, not values.
_BITS_DTYPE = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _amplitudes(n: int, dtype: torch.dtype) -> tuple[int, int]:
    """(A, S): |a| <= A and 1 <= s <= S, with n*A + ceil(n/2)*S within the exact-integer range."""
    cap = _EXACT_INT_RANGE[dtype]
    b = min(16, int(cap // (1.5 * n + 1)))
    if b >= 1:
        return b, b
    if (n + 1) // 2 <= cap:  # very many participants: a == 0, only the +-1 pairs remain
        return 0, 1
    return 0, 0


class ExactPattern:
    """The inputs of all n participants and the expected mean, one PERIOD long each (see Note
    [Exact bench inputs]). `inputs(r)` / `expected` are cached per device."""

    def __init__(self, n: int, dtype: torch.dtype, period: int = PERIOD):
        if n < 1:
            raise ValueError(f"n: need at least one participant, got {n}")
        if dtype not in _EXACT_INT_RANGE:
            raise TypeError(f"dtype: {dtype} is not supported; use float32, float16 or bfloat16")
        self.n, self.dtype, self.period = n, dtype, period
        i = torch.arange(period, dtype=torch.int64)
        h = (i * 2654435761 + 97) % (2 ** 32)  # multiplicative hash: neighbours get unrelated values
        amp_a, amp_s = _amplitudes(n, dtype)
        self._a = (h % (2 * amp_a + 1)) - amp_a
        self._s = 1 + (h >> 11) % amp_s if amp_s else torch.zeros_like(h)
        self._scale = torch.pow(2.0, ((h >> 19) % 7 - 3).to(torch.float64))
        self._i = i
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def _exact_cast(self, values: torch.Tensor) -> torch.Tensor:
        out = values.to(self.dtype)
        if not torch.equal(out.to(torch.float64), values):  # a bug here would make every check lie
            raise AssertionError("ExactPattern: value not representable exactly; amplitudes are wrong")
        return out

    def inputs(self, r: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Participant r's period of inputs (r in [0, n))."""
        if not 0 <= r < self.n:
            raise ValueError(f"r: participant {r} out of range [0, {self.n})")
        key = (r, str(device))
        if key not in self._cache:
            pos = (self._i + r) % self.n
            d = torch.where(pos % 2 == 0, self._s, -self._s)
            if self.n % 2:
                d = torch.where(pos == self.n - 1, torch.zeros_like(d), d)
            self._cache[key] = self._exact_cast((self._a + d).to(torch.float64) * self._scale).to(device)
        return self._cache[key]

    def expected(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """One period of the exact mean over all n participants."""
        key = (-1, str(device))
        if key not in self._cache:
            self._cache[key] = self._exact_cast(self._a.to(torch.float64) * self._scale).to(device)
        return self._cache[key]


def fill_periodic(dst: torch.Tensor, base: torch.Tensor) -> None:
    """dst[i] = base[i % len(base)] for a flat contiguous dst, with broadcast copies (no per-element
    index math)."""
    count, period = dst.numel(), base.numel()
    full, tail = divmod(count, period)
    if full:
        dst[: full * period].view(full, period).copy_(base.expand(full, period))
    if tail:
        dst[full * period:].copy_(base[:tail])


def count_wrong(out: torch.Tensor, base: torch.Tensor) -> int:
    """Number of elements of flat `out` whose bits differ from base[i % len(base)]. Bit for bit: a
    NaN, a -0.0 for +0.0 or a one-ulp rounding difference all count as wrong."""
    if out.dtype != base.dtype:
        raise TypeError(f"out: dtype {out.dtype} differs from the expected {base.dtype}")
    bits = _BITS_DTYPE[out.dtype]
    got, want = out.reshape(-1).view(bits), base.reshape(-1).view(bits)
    count, period = got.numel(), want.numel()
    full, tail = divmod(count, period)
    wrong = 0
    if full:
        wrong += int((got[: full * period].view(full, period) != want).sum())
    if tail:
        wrong += int((got[full * period:] != want[:tail]).sum())
    return wrong
