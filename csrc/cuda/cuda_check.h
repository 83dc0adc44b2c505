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

// The device whose context is current on the calling thread, or -1 when the thread has none (it never
// chose a device). See Note [Device guard without a current context] in device_guard.cpp.
int current_device_or_none();

// Makes `device` current for the scope (code inside may switch further). Afterwards the thread's
// previous device is made current again, but only when the thread had one: a thread that never chose a
// device is left on `device` rather than "restored" to device 0, which would create a context
// (~0.5 GB) on GPU 0 in every rank's process.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : prev_(current_device_or_none()), device_(device) {
    if (prev_ != device) NCCLAVG_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_ >= 0 ? prev_ : device_); }  // a no-op when already current
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_;
  int device_;
};

// DeviceGuard for teardown (abort, destroy, destructors), which must not throw: a device that cannot
// be made current (a broken context) is ignored and the teardown goes on from where the thread is.
// Without it, a thread that never chose a device (a finalizer, a helper thread dropping the last
// reference) would have ncclCommDestroy/Abort, which save and restore the current device, and the
// event and stream releases create the primary context of GPU 0 in every rank's process.
class TeardownDeviceGuard {
 public:
  explicit TeardownDeviceGuard(int device) noexcept : device_(device) {
    try {
      prev_ = current_device_or_none();
    } catch (...) {
      prev_ = -1;
    }
    if (prev_ != device && cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
  }
  ~TeardownDeviceGuard() {
    if (prev_ >= 0 && prev_ != device_ && cudaSetDevice(prev_) != cudaSuccess) cudaGetLastError();
  }
  TeardownDeviceGuard(const TeardownDeviceGuard&) = delete;
  TeardownDeviceGuard& operator=(const TeardownDeviceGuard&) = delete;

 private:
  int prev_ = -1;
  int device_;
};

}  // namespace cuda
}  // namespace ncclavg
