// Which device, if any, the calling thread has chosen: the half of DeviceGuard that needs the driver.
#include <cuda_runtime_api.h>

#include "cuda_check.h"

namespace ncclavg {
namespace cuda {

// Note [Device guard without a current context]
// cudaGetDevice answers 0 for a thread that never chose a device, and cudaSetDevice(0) then creates
// the primary context of GPU 0 (CUDA >= 12 initialises the context in cudaSetDevice). A guard that
// "restores" that 0 costs every rank >= 1 of a one-GPU-per-process job a context on GPU 0 (~0.5 GB
// each) and makes its later kernels run there. The runtime cannot tell "chose 0" from "chose nothing";
// the driver can: cuCtxGetCurrent gives no context for a thread that never chose one. ncclavg links
// cudart statically and does not link libcuda (the module must import on machines without a driver),
// so the entry point is fetched through the runtime (cudaGetDriverEntryPoint[ByVersion]). When the
// driver cannot give it, the guard falls back to cudaGetDevice, i.e. to the old behaviour.

namespace {

using CtxGetCurrentFn = int (*)(void**);  // CUresult cuCtxGetCurrent(CUcontext*); CUDA_SUCCESS == 0

CtxGetCurrentFn resolve_ctx_get_current() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  // 12000: the ABI of cuCtxGetCurrent as of CUDA 12.0 (unchanged since 4.0), hard-coded as the docs ask.
  cudaError_t e = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found);
#else
  cudaError_t e = cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // a missing driver is reported by whoever needs the device, not here
    return nullptr;
  }
  return reinterpret_cast<CtxGetCurrentFn>(fn);
}

}  // namespace

int current_device_or_none() {
  static const CtxGetCurrentFn ctx_get_current = resolve_ctx_get_current();  // thread-safe, once
  if (ctx_get_current) {
    void* ctx = nullptr;
    if (ctx_get_current(&ctx) == 0 && ctx == nullptr) return -1;
  }
  int device = 0;
  NCCLAVG_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace cuda
}  // namespace ncclavg
