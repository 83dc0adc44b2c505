"""What a record and the sums outside the channel rest on. reductions.sum_in_order, the arithmetic of every
sum done outside the channel (a record's payloads, the pieces of an all_to_all, the rows of two hosts'
lanes): in order, accumulated in float32 (float64 for float64), rounded once; the same bits whether
written into `out` (one of the first two parts, or a tensor of its own) or returned. And the record's
received rows, whose payloads every dtype must be able to view."""
import pytest
import torch

from ncclavg.transport.reductions import sum_in_order


def reference(parts):
    """The sum in order, each step rounded to the accumulator's type (float64 for float64, else float32),
    then rounded once to the parts' type: computed one addition at a time, in float64, with the rounding
    to the accumulator made explicit: float64 (53 bits) has at least 2 x 24 + 2 bits, so rounding a sum
    of two float32 first to float64 and then to float32 gives float32's own addition (double rounding is
    innocuous for +, -, x, / when the wider format has 2p + 2 bits: Figueroa, 1995)."""
    wide = torch.float64 if parts[0].dtype == torch.float64 else torch.float32
    acc = parts[0].to(wide)
    for p in parts[1:]:
        acc = (acc.double() + p.double()).to(wide) if wide == torch.float32 else acc + p.double()
    return acc.to(parts[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("into", [None, "first", "second", "own"])
def test_a_sum_in_order_rounds_as_the_channel_does(dtype, count, into):
    g = torch.Generator().manual_seed(count)
    parts = [(torch.randn(1000, generator=g) * 10 ** torch.randint(-3, 4, (1000,), generator=g)).to(dtype)
             for _ in range(count)]
    want = reference([p.clone() for p in parts])
    if into is None or (into == "second" and count < 2):
        got = sum_in_order(parts)
    else:
        out = {"first": parts[0], "second": parts[-1] if count < 2 else parts[1],
               "own": torch.empty(1000, dtype=dtype)}[into]
        got = sum_in_order(parts, out=out)
        assert got.data_ptr() == out.data_ptr()
    assert got.dtype == dtype
    assert torch.equal(got, want), (got - want).abs().max()


def test_a_records_rows_keep_every_payload_aligned():
    # the received rows are header + fold_limit bytes each: a payload viewed as float64 (or any dtype) must
    # start on its alignment in every row, for every group size (a group of 4 once got 87381-byte rows)
    from ncclavg.transport.calls import _HEADER, FOLD_BYTES, FOLD_WHOLE, fold_limit

    for size in range(1, 130):
        limit = fold_limit(size)
        assert limit % 64 == 0 and (_HEADER * 8) % 16 == 0, size
        assert FOLD_BYTES <= limit <= max(FOLD_BYTES, FOLD_WHOLE), size
