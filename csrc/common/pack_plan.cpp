#include "pack_plan.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "check.h"

namespace ncclavg {
namespace {

struct Interval {
  uintptr_t begin;
  uintptr_t end;
  size_t seg;  // index of the tensor argument
};

// Note [Pack aliasing rule]
// Writes of different segments must be disjoint (else the result depends on thread timing), and no
// segment may read bytes another segment writes. A segment whose read and write ranges are the same
// bytes with the same dtype is legal: every element is read before it is written, by the same thread
// and lane, so it is an in-place scale (how the gloo backend applies its 1/N to a bucket).
void check_aliasing(const std::vector<Interval>& reads, std::vector<Interval> writes,
                    const std::vector<bool>& same_dtype, bool to_bucket) {
  std::sort(writes.begin(), writes.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < writes.size(); ++k) {
    if (writes[k - 1].end <= writes[k].begin) continue;
    if (to_bucket)
      NCCLAVG_CHECK_ARG(false, "offsets", "entries ", writes[k - 1].seg, " and ", writes[k].seg,
                        " overlap inside dst");
    NCCLAVG_CHECK_ARG(false, "dsts", "entries ", writes[k - 1].seg, " and ", writes[k].seg,
                      " share memory (a tensor passed twice, or overlapping views)");
  }
  for (const Interval& r : reads) {
    // First write whose end is past r.begin (writes are disjoint and sorted, so ends are sorted too).
    auto it = std::lower_bound(writes.begin(), writes.end(), r.begin,
                               [](const Interval& w, uintptr_t v) { return w.end <= v; });
    for (; it != writes.end() && it->begin < r.end; ++it) {
      if (it->seg == r.seg && it->begin == r.begin && it->end == r.end && same_dtype[r.seg]) continue;
      if (to_bucket)
        NCCLAVG_CHECK_ARG(false, "srcs", "entry ", r.seg, " overlaps the part of dst written for srcs[",
                          it->seg, "] (only an exact in-place alias of the same dtype is allowed)");
      NCCLAVG_CHECK_ARG(false, "dsts", "entry ", it->seg, " overlaps the part of src read for dsts[", r.seg,
                        "] (only an exact in-place alias of the same dtype is allowed)");
    }
  }
}

std::vector<CopySegment> plan(const Buffer& bucket, const std::vector<Buffer>& tensors,
                              const std::vector<int64_t>& offsets, bool to_bucket, float mul, float div) {
  const char* targ = to_bucket ? "srcs" : "dsts";
  const char* barg = to_bucket ? "dst" : "src";
  check_pack_factors(mul, div);
  validate_buffer(bucket, barg);
  NCCLAVG_CHECK_ARG(!to_bucket || !bucket.readonly, barg, "is read-only; pack writes into it");
  NCCLAVG_CHECK_ARG(offsets.size() == tensors.size(), "offsets", "has ", offsets.size(), " entries but ", targ,
                    " has ", tensors.size());
  const size_t bsize = dtype_size(bucket.dtype);
  std::vector<Interval> reads, writes;
  std::vector<bool> same_dtype(tensors.size());
  std::vector<CopySegment> segs;
  segs.reserve(tensors.size());
  reads.reserve(tensors.size());
  writes.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Buffer& t = tensors[i];
    const std::string what = std::string(targ) + "[" + std::to_string(i) + "]";
    validate_buffer(t, what);
    NCCLAVG_CHECK_ARG(t.device == bucket.device, what, "is on ", t.describe(), " but ", barg, " is on ",
                      bucket.describe());
    NCCLAVG_CHECK_ARG(to_bucket || !t.readonly, what, "is read-only; unpack writes into it");
    const int64_t off = offsets[i];
    NCCLAVG_CHECK_ARG(off >= 0 && off <= bucket.numel && t.numel <= bucket.numel - off,
                      "offsets", "entry ", i, " places ", t.numel, " elements at offset ", off, " of a ", barg,
                      " with ", bucket.numel, " elements");
    if (t.numel == 0) continue;
    const uintptr_t bbeg = bucket.ptr + static_cast<uintptr_t>(off) * bsize;
    const Interval in_bucket{bbeg, bbeg + static_cast<uintptr_t>(t.numel) * bsize, i};
    const Interval in_tensor{t.ptr, t.ptr + t.nbytes(), i};
    same_dtype[i] = t.dtype == bucket.dtype;
    reads.push_back(to_bucket ? in_tensor : in_bucket);
    writes.push_back(to_bucket ? in_bucket : in_tensor);
    const bool noop = same_dtype[i] && in_bucket.begin == in_tensor.begin && mul == 1.0f && div == 1.0f;
    if (noop) continue;
    if (to_bucket) segs.push_back({t.ptr, bbeg, t.numel, t.dtype, bucket.dtype});
    else segs.push_back({bbeg, t.ptr, t.numel, bucket.dtype, t.dtype});
  }
  check_aliasing(reads, std::move(writes), same_dtype, to_bucket);
  return segs;
}

}  // namespace

void check_pack_factors(float mul, float div) {
  NCCLAVG_CHECK_ARG(std::isfinite(mul), "scale", "must be finite, got ", mul);
  NCCLAVG_CHECK_ARG(std::isfinite(div) && div != 0.0f, "divisor", "must be finite and non-zero, got ", div);
}

std::vector<CopySegment> plan_pack(const std::vector<Buffer>& tensors, const Buffer& bucket,
                                   const std::vector<int64_t>& offsets, float mul, float div) {
  return plan(bucket, tensors, offsets, /*to_bucket=*/true, mul, div);
}

std::vector<CopySegment> plan_unpack(const Buffer& bucket, const std::vector<Buffer>& tensors,
                                     const std::vector<int64_t>& offsets, float mul, float div) {
  return plan(bucket, tensors, offsets, /*to_bucket=*/false, mul, div);
}

}  // namespace ncclavg
