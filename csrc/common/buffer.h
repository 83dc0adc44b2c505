// Buffer: the one descriptor that crosses the Python/C++ boundary. Python builds it from a torch tensor,
// a cupy array or a numpy array (ncclavg/buffers.py); C++ never sees a framework type, so the core has
// no ABI coupling to any torch version.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dtype.h"

namespace ncclavg {

constexpr int kCpuDevice = -1;

struct Buffer {
  uintptr_t ptr = 0;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
  int device = kCpuDevice;  // -1: host memory; >= 0: CUDA device ordinal
  bool readonly = false;

  size_t nbytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
  bool on_cpu() const { return device == kCpuDevice; }
  std::string describe() const;
};

// Checks one buffer on its own: non-negative size, non-null pointer when non-empty, aligned to its
// element size. `what` names the argument in the error, e.g. "buffers[3]".
void validate_buffer(const Buffer& b, const std::string& what);

// Checks a group that one op reads and writes together: non-empty, same numel, dtype and device, each
// writable, and no two buffers overlapping in memory (an alias would make an in-place average wrong).
void validate_group(const std::vector<Buffer>& bufs, const char* argname);

}  // namespace ncclavg
