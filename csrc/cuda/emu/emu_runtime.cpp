// The part of the CUDA runtime that the kernel files and device_guard.cpp call, emulated on the host,
// and the launch loop of the grid emulator. Linked instead of cudart: every symbol here has the
// signature cuda_runtime_api.h declares.
#include "emu_runtime.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_emu.h"
#include "emu_host.h"

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace ncclavg_emu {
namespace {

// The runtime keeps these per host thread, and so does the emulator.
thread_local cudaError_t sticky_error = cudaSuccess;
thread_local int current_device = 0;
thread_local bool device_chosen = false;  // see Note [Device guard without a current context]
thread_local Order order = Order::kForward;
thread_local uint64_t order_seed = 0;
thread_local LaunchLog log;
thread_local EmulatedSystem sys;

// Primary contexts, process-wide (See emu_host.h). Fixed-size: the emulated machine has at most 64 GPUs.
constexpr int kMaxDevices = 64;
std::atomic<int> g_contexts[kMaxDevices];
std::atomic<int> g_binds[kMaxDevices];
int initial_device_count() {
  const char* env = std::getenv("NCCLAVG_EMU_DEVICES");
  const int n = env && env[0] ? std::atoi(env) : kDeviceCount;
  return n < 0 ? 0 : n > kMaxDevices ? kMaxDevices : n;
}
std::atomic<int> g_device_count{initial_device_count()};

void bind_context(int device) {
  if (device_chosen && current_device == device) return;
  int expected = 0;
  g_contexts[device].compare_exchange_strong(expected, 1);
  g_binds[device].fetch_add(1);
}

void record_error(cudaError_t e) {
  if (sticky_error == cudaSuccess) sticky_error = e;  // the first error stays until it is read
}

// Limits of every architecture the project builds for (sm_80, sm_90): cudaDeviceProp's
// maxThreadsDim {1024, 1024, 64}, maxThreadsPerBlock 1024, maxGridSize {2^31 - 1, 65535, 65535},
// 48 KiB of dynamic shared memory without an opt-in attribute.
bool config_ok(const LaunchConfig& c) {
  const dim3 g = c.grid, b = c.block;
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) return false;
  if (b.x > 1024 || b.y > 1024 || b.z > 64) return false;
  if (static_cast<uint64_t>(b.x) * b.y * b.z > 1024) return false;
  if (g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) return false;
  return true;
}

// cuCtxGetCurrent as device_guard.cpp fetches it: a context exists once the thread chose a device.
int emu_ctx_get_current(void** ctx) {
  *ctx = device_chosen ? reinterpret_cast<void*>(static_cast<uintptr_t>(current_device) + 1) : nullptr;
  return 0;
}

}  // namespace

void set_device_count(int n) { g_device_count.store(n < 0 ? 0 : n > kMaxDevices ? kMaxDevices : n); }
int device_count() { return g_device_count.load(); }
int contexts_created(int device) { return device >= 0 && device < kMaxDevices ? g_contexts[device].load() : 0; }
int context_binds(int device) { return device >= 0 && device < kMaxDevices ? g_binds[device].load() : 0; }

int ensure_context() {
  if (!device_chosen) {  // the runtime's implicit initialisation: the primary context of device 0
    bind_context(0);
    current_device = 0;
    device_chosen = true;
  }
  return current_device;
}
bool has_context() { return device_chosen; }

const char* order_name(Order o) {
  switch (o) {
    case Order::kForward: return "forward";
    case Order::kReverse: return "reverse";
    case Order::kShuffled: return "shuffled";
  }
  return "?";
}

void set_order(Order o, uint64_t seed) {
  order = o;
  order_seed = seed;
}

void set_system(const EmulatedSystem& s) { sys = s; }
const EmulatedSystem& emulated_system() { return sys; }

const LaunchLog& launch_log() { return log; }
void reset_launch_log() { log = LaunchLog{}; }

bool begin_launch(const LaunchConfig& cfg) {
  if (!config_ok(cfg)) {
    record_error(cudaErrorInvalidConfiguration);
    ++log.refused;
    return false;
  }
  if (cfg.smem > 48 * 1024) {
    record_error(cudaErrorInvalidValue);
    ++log.refused;
    return false;
  }
  // See Note [Kernel parameter limit].
  if (cfg.param_bytes > kPortableParamBytes && (sys.driver_version < 12010 || sys.cc_major < 7)) {
    record_error(cudaErrorNotSupported);
    ++log.refused;
    return false;
  }
  const uintptr_t stream = reinterpret_cast<uintptr_t>(cfg.stream);
  if (log.launches > 0) {
    log.mixed_streams = log.mixed_streams || stream != log.last_stream;
    log.mixed_devices = log.mixed_devices || current_device != log.last_device;
  }
  log.last_stream = stream;
  log.last_device = current_device;
  ++log.launches;
  return true;
}

bool launch_enqueues() { return launches_async(); }

void enqueue_launch(cudaStream_t stream, void (*body)(void*), void* ctx, void (*release)(void*)) {
  const cudaError_t e = enqueue(stream, body, ctx, release);
  if (e != cudaSuccess) record_error(e);
}

void for_each_thread(const LaunchConfig& cfg, void (*body)(void*), void* ctx) {
  const uint64_t nb = static_cast<uint64_t>(cfg.grid.x) * cfg.grid.y * cfg.grid.z;
  const uint64_t nt = static_cast<uint64_t>(cfg.block.x) * cfg.block.y * cfg.block.z;
  gridDim = cfg.grid;
  blockDim = cfg.block;
  auto run = [&](uint64_t b, uint64_t t) {
    blockIdx = uint3{static_cast<unsigned>(b % cfg.grid.x), static_cast<unsigned>(b / cfg.grid.x % cfg.grid.y),
                     static_cast<unsigned>(b / cfg.grid.x / cfg.grid.y)};
    threadIdx = uint3{static_cast<unsigned>(t % cfg.block.x), static_cast<unsigned>(t / cfg.block.x % cfg.block.y),
                      static_cast<unsigned>(t / cfg.block.x / cfg.block.y)};
    body(ctx);
  };
  log.threads += static_cast<int64_t>(nb * nt);
  switch (order) {
    case Order::kForward:
      for (uint64_t b = 0; b < nb; ++b)
        for (uint64_t t = 0; t < nt; ++t) run(b, t);
      break;
    case Order::kReverse:
      for (uint64_t b = nb; b-- > 0;)
        for (uint64_t t = nt; t-- > 0;) run(b, t);
      break;
    case Order::kShuffled: {
      std::vector<uint64_t> all(nb * nt);
      std::iota(all.begin(), all.end(), uint64_t{0});
      std::mt19937_64 rng(order_seed ^ (nb * 0x9e3779b97f4a7c15ull) ^ nt);
      std::shuffle(all.begin(), all.end(), rng);
      for (uint64_t i : all) run(i / nt, i % nt);
      break;
    }
  }
}

}  // namespace ncclavg_emu

using ncclavg_emu::current_device;
using ncclavg_emu::device_chosen;
using ncclavg_emu::sticky_error;

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = sticky_error;
  sticky_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return sticky_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    default: return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "unknown error";
  }
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= ncclavg_emu::device_count()) {
    ncclavg_emu::record_error(cudaErrorInvalidDevice);
    return cudaErrorInvalidDevice;
  }
  if (const cudaError_t e = ncclavg_emu::sticky_error_of(device)) return e;  // CUDA >= 12 initialises here
  ncclavg_emu::bind_context(device);
  current_device = device;
  device_chosen = true;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = ncclavg_emu::sys.driver_version;
  return cudaSuccess;
}

// What `ncclavg info` reads (runtime_info.cpp): the runtime the headers are from, each device's name
// and compute capability.
cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return cudaErrorInvalidValue;
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return cudaErrorInvalidValue;
  if (device < 0 || device >= ncclavg_emu::device_count()) return cudaErrorInvalidDevice;
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "emulated device %d (ncclavg_emu)", device);
  prop->major = ncclavg_emu::sys.cc_major;
  prop->minor = ncclavg_emu::sys.cc_minor;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = ncclavg_emu::device_count();
  return *count > 0 ? cudaSuccess : cudaErrorNoDevice;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= ncclavg_emu::device_count()) {
    ncclavg_emu::record_error(cudaErrorInvalidDevice);
    return cudaErrorInvalidDevice;
  }
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = ncclavg_emu::sys.cc_major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = ncclavg_emu::sys.cc_minor; return cudaSuccess;
    default:  // not emulated: a kernel file that asks for more must extend this first
      ncclavg_emu::record_error(cudaErrorInvalidValue);
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  const bool known = std::strcmp(symbol, "cuCtxGetCurrent") == 0;
  *fn = known ? reinterpret_cast<void*>(&ncclavg_emu::emu_ctx_get_current) : nullptr;
  if (status) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

}  // extern "C"
