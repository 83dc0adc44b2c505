#include "buffer.h"

#include <algorithm>
#include <sstream>

#include "check.h"

namespace ncclavg {

std::string Buffer::describe() const {
  std::ostringstream os;
  os << "Buffer(numel=" << numel << ", dtype=" << dtype_name(dtype) << ", device="
     << (on_cpu() ? std::string("cpu") : "cuda:" + std::to_string(device)) << ")";
  return os.str();
}

void validate_buffer(const Buffer& b, const std::string& what) {
  NCCLAVG_CHECK_ARG(b.numel >= 0, what, "numel must be >= 0, got ", b.numel);
  NCCLAVG_CHECK_ARG(b.numel == 0 || b.ptr != 0, what, "null data pointer with numel=", b.numel);
  NCCLAVG_CHECK_ARG(b.ptr % dtype_size(b.dtype) == 0, what, "data pointer is not aligned to ",
                    dtype_size(b.dtype), " bytes");
  NCCLAVG_CHECK_ARG(b.device >= kCpuDevice, what, "device must be -1 (cpu) or a CUDA ordinal, got ",
                    b.device);
}

void validate_group(const std::vector<Buffer>& bufs, const char* argname) {
  NCCLAVG_CHECK_ARG(!bufs.empty(), argname, "needs at least one buffer, got an empty list");
  const Buffer& first = bufs[0];
  for (size_t i = 0; i < bufs.size(); ++i) {
    const Buffer& b = bufs[i];
    const std::string what = std::string(argname) + "[" + std::to_string(i) + "]";
    validate_buffer(b, what);
    NCCLAVG_CHECK_ARG(!b.readonly, what, "is read-only; the op writes its result in place");
    NCCLAVG_CHECK_TYPE(b.dtype == first.dtype, what, "dtype ", dtype_name(b.dtype), " differs from ",
                       argname, "[0] dtype ", dtype_name(first.dtype));
    NCCLAVG_CHECK_ARG(b.numel == first.numel, what, "has ", b.numel, " elements but ", argname,
                      "[0] has ", first.numel);
    NCCLAVG_CHECK_ARG(b.device == first.device, what, "is on ", b.describe(), " but ", argname,
                      "[0] is on ", first.describe());
  }
  if (first.numel == 0) return;
  // Overlap check in O(N log N): sort by start address, compare neighbours.
  std::vector<size_t> order(bufs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bufs[a].ptr < bufs[b].ptr; });
  for (size_t k = 1; k < order.size(); ++k) {
    const Buffer& lo = bufs[order[k - 1]];
    const Buffer& hi = bufs[order[k]];
    NCCLAVG_CHECK_ARG(lo.ptr + lo.nbytes() <= hi.ptr, argname, "entries ", order[k - 1], " and ",
                      order[k], " share memory (the same buffer passed twice, or overlapping views)");
  }
}

}  // namespace ncclavg
