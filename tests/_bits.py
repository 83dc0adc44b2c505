"""Bit-for-bit comparison of floating-point results that treats every NaN as the same value.

Why: the GPU and the CPU agree on every bit of every number, but not on which NaN they produce. CUDA's
__float2half_rn / __float2bfloat16_rn (and the fp32 arithmetic of the GPU) return the canonical NaN
(0x7FFF, 0x7FFFFFFF), while the CPU path keeps the input's payload (0x7E00 through F16C, 0x7FC0 for
bfloat16, 0x7FC00000 for fp32). A NaN carries no value, so a comparison that matters checks that the
NaNs are in the same places and that every other element has the same bits (signed zeros, infinities
and subnormals included).

Works on torch tensors (float32, float16, bfloat16; any device) and numpy arrays (float32, float16, or
raw uint32 / uint16 bits with `fmt`). Nothing here needs a GPU."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

# format -> (unsigned bits dtype, exponent mask, mantissa mask)
FORMATS = {
    "float32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "float16": (np.uint16, 0x7C00, 0x03FF),
    "bfloat16": (np.uint16, 0x7F80, 0x007F),
}


def raw_bits(x: Any, fmt: Optional[str] = None) -> tuple:
    """(flat unsigned bits, format name) of a tensor or array. `fmt` names the format of raw uint arrays."""
    if type(x).__module__.startswith("torch"):
        import torch

        name = str(x.dtype).replace("torch.", "")
        if name not in FORMATS:
            raise TypeError(f"x: expected a float32/float16/bfloat16 tensor, got {x.dtype}")
        v = x.detach().contiguous().cpu().reshape(-1)
        signed = v.view(torch.int32 if name == "float32" else torch.int16).numpy()
        return signed.view(FORMATS[name][0]), name
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    if a.dtype in (np.float32, np.float16):
        name = str(a.dtype)
        return a.view(FORMATS[name][0]), name
    if fmt in FORMATS and a.dtype == FORMATS[fmt][0]:
        return a, fmt
    raise TypeError(f"x: expected float32/float16 data, or uint bits with fmt in {sorted(FORMATS)}; got "
                    f"{a.dtype} (fmt={fmt!r})")


def nan_mask(bits: np.ndarray, fmt: str) -> np.ndarray:
    """True where the bits encode a NaN (exponent all ones, mantissa not zero), whatever sign and payload."""
    _, exp, man = FORMATS[fmt]
    return ((bits & exp) == exp) & ((bits & man) != 0)


def bits_mismatch(got: Any, want: Any, fmt: Optional[str] = None) -> Optional[str]:
    """None when `got` and `want` have NaNs in the same places and identical bits everywhere else;
    otherwise what differs first (index, both values' bits, how many elements differ)."""
    g, gf = raw_bits(got, fmt)
    w, wf = raw_bits(want, fmt)
    if gf != wf:
        return f"formats differ: got {gf}, want {wf}"
    if g.shape != w.shape:
        return f"sizes differ: got {g.size} elements, want {w.size}"
    gn, wn = nan_mask(g, gf), nan_mask(w, wf)
    bad = (gn != wn) | (~gn & ~wn & (g != w))
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    width = 8 if gf == "float32" else 4
    kind = "NaN on one side only" if gn[i] != wn[i] else "bits differ"
    return (f"{int(bad.sum())} of {g.size} {gf} elements differ; first at {i} ({kind}): got "
            f"0x{int(g[i]):0{width}X}, want 0x{int(w[i]):0{width}X}")


def assert_same_bits(got: Any, want: Any, what: str = "", fmt: Optional[str] = None) -> None:
    """Fails with bits_mismatch's description (prefixed by `what`) unless the two agree bit for bit up to
    NaN payloads."""
    why = bits_mismatch(got, want, fmt)
    assert why is None, f"{what}: {why}" if what else why
