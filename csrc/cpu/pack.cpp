// Default-ISA dispatcher of the pack family: validation, the OpenMP split, the per-ISA kernel call.
#include "pack.h"

#include <algorithm>
#include <atomic>

#include "../common/check.h"
#include "parallel.h"

namespace ncclavg {
namespace cpu {

const PackKernelTable& pack_kernels() {
  switch (current_simd_level()) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return kAvx512PackKernels;
    case SimdLevel::kAvx2: return kAvx2PackKernels;
#elif defined(__aarch64__)
    case SimdLevel::kSve: return kSvePackKernels;
    case SimdLevel::kNeon: return kNeonPackKernels;
#endif
    default: return kScalarPackKernels;
  }
}

bool run_segments(const std::vector<CopySegment>& segs, float mul, float div, bool check_finite) {
  if (segs.empty()) return false;
  // Prefix sums over the segments: thread slices of the concatenated range map back to (segment, pos).
  std::vector<int64_t> start(segs.size() + 1, 0);
  for (size_t k = 0; k < segs.size(); ++k) start[k + 1] = start[k] + segs[k].numel;
  const PackKernelTable& kt = pack_kernels();
  std::atomic<bool> any{false};   // one store per thread that wrote an inf/NaN
  parallel_for_range(start.back(), [&](int64_t b, int64_t e) {
    size_t k = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), b) - start.begin()) - 1;
    bool mine = false;
    for (int64_t pos = b; pos < e; ++k) {
      const CopySegment& s = segs[k];
      const int64_t local = pos - start[k];
      const int64_t n = std::min(e, start[k + 1]) - pos;
      const auto* src = reinterpret_cast<const char*>(s.src) + local * dtype_size(s.src_dtype);
      auto* dst = reinterpret_cast<char*>(s.dst) + local * dtype_size(s.dst_dtype);
      bool bad = false;
      kt.convert(src, s.src_dtype, dst, s.dst_dtype, n, mul, div, check_finite ? &bad : nullptr);
      mine = mine || bad;
      pos += n;
    }
    if (mine) any.store(true, std::memory_order_relaxed);
  });
  return any.load(std::memory_order_relaxed);
}

bool pack(const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float mul,
          float div, bool check_finite) {
  NCCLAVG_CHECK_ARG(dst.on_cpu(), "dst", "the host pack needs host memory, got ", dst.describe());
  return run_segments(plan_pack(srcs, dst, offsets, mul, div), mul, div, check_finite);
}

bool unpack(const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float mul,
            float div, bool check_finite) {
  NCCLAVG_CHECK_ARG(src.on_cpu(), "src", "the host unpack needs host memory, got ", src.describe());
  return run_segments(plan_unpack(src, dsts, offsets, mul, div), mul, div, check_finite);
}

}  // namespace cpu
}  // namespace ncclavg
