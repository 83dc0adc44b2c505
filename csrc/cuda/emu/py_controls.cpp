// The emulated core's controls for the Python tests: what tests/_nccl_emu_core.py calls through ctypes
// on the emulated `ncclavg._C` (build_pycore.py). Plain C entry points with default visibility; the
// CUDA runtime functions the tests also call (cudaMalloc, cudaSetDevice, cudaStreamSynchronize, ...)
// are the emulated runtime's own, exported the same way. See docs/cuda_emulation.md, "The Python
// layer on the emulated core".
#include <cuda_runtime_api.h>

#include "emu_host.h"

#define NCCLAVG_EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {
// As on a GPU, the divide kernel and the pack kernels run on their stream after what was enqueued
// before them (NCCL's collective), not when they are launched: set once, when the core is loaded.
struct AsyncLaunches {
  AsyncLaunches() { ncclavg_emu::set_launches_async(true); }
} g_async_launches;
}  // namespace

NCCLAVG_EMU_EXPORT int ncclavg_emu_is_emulated() { return 1; }
NCCLAVG_EMU_EXPORT void ncclavg_emu_set_device_count(int n) { ncclavg_emu::set_device_count(n); }
NCCLAVG_EMU_EXPORT int ncclavg_emu_contexts_created(int device) { return ncclavg_emu::contexts_created(device); }
NCCLAVG_EMU_EXPORT void ncclavg_emu_inject_sticky_error(int device, int error) {
  ncclavg_emu::inject_sticky_error(device, static_cast<cudaError_t>(error));
}
NCCLAVG_EMU_EXPORT int ncclavg_emu_drain_all_streams(double timeout_s) {
  return ncclavg_emu::drain_all_streams(timeout_s) ? 1 : 0;
}
