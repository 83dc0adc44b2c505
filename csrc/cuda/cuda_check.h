// The CUDA runtime check: throws ncclavg::CudaError with cudaGetErrorString and file:line.
#pragma once
#include <cuda_runtime_api.h>

#include "../common/check.h"

#define NCCLAVG_CUDA_CHECK(expr)                                                                      \
  do {                                                                                                \
    cudaError_t err_ = (expr);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      ::ncclavg::detail::fail<::ncclavg::CudaError>(__FILE__, __LINE__, #expr, " failed: ",          \
                                                     cudaGetErrorString(err_), " (",                 \
                                                     cudaGetErrorName(err_), ")");                   \
    }                                                                                                 \
  } while (0)

// After every kernel launch: catches bad launch configurations at the launch site.
#define NCCLAVG_CUDA_CHECK_LAUNCH() NCCLAVG_CUDA_CHECK(cudaGetLastError())

namespace ncclavg {
namespace cuda {

// Makes `device` current for the scope and restores the previous device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    NCCLAVG_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) NCCLAVG_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace cuda
}  // namespace ncclavg
