// Host-side in-place average of N buffers: the `local` backend's reduction and ops.average_ on CPU.
#include "reduce.h"

#include <vector>

#include "../common/check.h"
#include "parallel.h"
#include "simd.h"

namespace ncclavg {
namespace cpu {

void average_inplace(const std::vector<Buffer>& bufs) {
  validate_group(bufs, "buffers");
  NCCLAVG_CHECK_ARG(bufs[0].on_cpu(), "buffers", "average_inplace on the host got ", bufs[0].describe());
  const int n = static_cast<int>(bufs.size());
  const int64_t numel = bufs[0].numel;
  if (n == 1 || numel == 0) return;  // the mean of one buffer is itself
  std::vector<void*> ptrs(n);
  for (int i = 0; i < n; ++i) ptrs[i] = reinterpret_cast<void*>(bufs[i].ptr);
  const KernelTable& k = kernels();
  const DType dtype = bufs[0].dtype;
  parallel_for_range(numel, [&](int64_t b, int64_t e) { k.average(ptrs.data(), n, dtype, b, e); });
}

}  // namespace cpu
}  // namespace ncclavg
