// CUDA entry points, declared without CUDA types so that bindings.cpp needs no CUDA headers. Streams
// cross the boundary as integer handles (cudaStream_t cast to uintptr_t; 0 = the legacy default stream).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../common/buffer.h"

namespace ncclavg {
namespace cuda {

// In-place mean of N buffers on one device, enqueued on `stream` (asynchronous).
void average_inplace(const std::vector<Buffer>& bufs, uintptr_t stream);

// In place: every element of `b` becomes b[i] / divisor, computed in fp32 and rounded once to the
// storage type (the same ew::mean_of_sum the averages use), enqueued on `stream`. The scale half of
// SUM-then-scale when NCCL cannot average by itself. See Note [Choosing the reduction] in
// comm_collectives.cpp.
void divide_inplace(const Buffer& b, float divisor, uintptr_t stream);

struct RuntimeInfo {
  int runtime_version = 0;      // CUDA runtime linked in (cudart static)
  int driver_version = 0;       // 0 when no driver
  std::string driver_error;     // the runtime's words when the driver or devices are unusable
  int device_count = 0;
  std::vector<std::string> device_names;
  std::vector<std::string> device_capabilities;  // "9.0"
};
RuntimeInfo runtime_info();

}  // namespace cuda
}  // namespace ncclavg
