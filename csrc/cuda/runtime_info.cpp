// What the CUDA runtime can see: the lines of `ncclavg info` about the driver and devices. Never throws:
// on a machine with no driver this is where the user reads why.
#include <cuda_runtime_api.h>

#include "cuda_ops.h"

namespace ncclavg {
namespace cuda {

RuntimeInfo runtime_info() {
  RuntimeInfo r;
  cudaRuntimeGetVersion(&r.runtime_version);
  if (cudaDriverGetVersion(&r.driver_version) != cudaSuccess) r.driver_version = 0;
  cudaError_t e = cudaGetDeviceCount(&r.device_count);
  if (e != cudaSuccess) {
    r.device_count = 0;
    r.driver_error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return r;
  }
  for (int d = 0; d < r.device_count; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) == cudaSuccess) {
      r.device_names.emplace_back(p.name);
      r.device_capabilities.push_back(std::to_string(p.major) + "." + std::to_string(p.minor));
    } else {
      r.device_names.emplace_back("<unreadable>");
      r.device_capabilities.emplace_back("?");
    }
  }
  return r;
}

}  // namespace cuda
}  // namespace ncclavg
