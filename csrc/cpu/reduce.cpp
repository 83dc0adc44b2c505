// Host-side in-place average of N buffers: the `local` backend's reduction and ops.average_ on CPU.
#include "reduce.h"

#include <atomic>
#include <vector>

#include "../common/check.h"
#include "parallel.h"
#include "simd.h"

namespace ncclavg {
namespace cpu {

bool average_inplace(const std::vector<Buffer>& bufs, bool check_finite) {
  validate_group(bufs, "buffers");
  NCCLAVG_CHECK_ARG(bufs[0].on_cpu(), "buffers", "average_inplace on the host got ", bufs[0].describe());
  const int n = static_cast<int>(bufs.size());
  const int64_t numel = bufs[0].numel;
  if (n == 1 || numel == 0) return false;  // the mean of one buffer is itself: nothing is written
  std::vector<void*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = reinterpret_cast<void*>(bufs[i].ptr);
  const KernelTable& k = kernels();
  const DType dtype = bufs[0].dtype;
  if (!check_finite) {
    parallel_for_range(numel, [&](int64_t b, int64_t e) { k.average(ptrs.data(), n, dtype, b, e, nullptr); });
    return false;
  }
  std::atomic<bool> any{false};   // one store per thread that saw an inf/NaN
  parallel_for_range(numel, [&](int64_t b, int64_t e) {
    bool bad = false;
    k.average(ptrs.data(), n, dtype, b, e, &bad);
    if (bad) any.store(true, std::memory_order_relaxed);
  });
  return any.load(std::memory_order_relaxed);
}

}  // namespace cpu
}  // namespace ncclavg
