// Emulated device memory (host memory registered as "device d"), pointer attributes, and the error
// injection of the host-logic tests. See emu_host.h.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "emu_host.h"

namespace ncclavg_emu {
namespace {

struct Allocation {
  size_t bytes = 0;
  int device = 0;
  cudaMemoryType type = cudaMemoryTypeDevice;
};

std::mutex g_mu;
std::map<uintptr_t, Allocation> g_allocs;  // start address -> allocation
std::atomic<int> g_sticky[64];             // cudaError_t per device; 0: healthy
struct CallError {
  int remaining = 0;  // calls to let through before the failing one
  cudaError_t error = cudaSuccess;
};
std::map<std::string, CallError> g_call_errors;
std::atomic<bool> g_any_call_error{false};

}  // namespace

void inject_sticky_error(int device, cudaError_t e) {
  if (device >= 0 && device < 64) g_sticky[device].store(static_cast<int>(e));
}

cudaError_t sticky_error_of(int device) {
  return device >= 0 && device < 64 ? static_cast<cudaError_t>(g_sticky[device].load()) : cudaSuccess;
}

void inject_call_error(const std::string& name, int nth, cudaError_t e) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_call_errors[name] = CallError{nth - 1, e};
  g_any_call_error.store(true);
}

cudaError_t injected_error(const char* name) {
  if (!g_any_call_error.load()) return cudaSuccess;  // the common case takes no lock
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_call_errors.find(name);
  if (it == g_call_errors.end()) return cudaSuccess;
  if (it->second.remaining-- > 0) return cudaSuccess;
  const cudaError_t e = it->second.error;
  g_call_errors.erase(it);
  return e;
}

}  // namespace ncclavg_emu

using namespace ncclavg_emu;

namespace {
cudaError_t allocate(void** p, size_t bytes, cudaMemoryType type) {
  if (!p) return cudaErrorInvalidValue;
  const int d = ensure_context();
  if (unsafe_call_prohibited()) return cudaErrorStreamCaptureUnsupported;
  if (const cudaError_t e = sticky_error_of(d)) return e;
  if (const cudaError_t e = injected_error("cudaMalloc")) return e;
  // 256-byte aligned like cudaMalloc; zero bytes still get a unique address
  const size_t rounded = (bytes + 255) / 256 * 256 + 256;
  void* mem = std::aligned_alloc(256, rounded);
  if (!mem) return cudaErrorMemoryAllocation;
  std::memset(mem, 0xcd, rounded);  // not zero: a read of memory nobody wrote shows
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocs[reinterpret_cast<uintptr_t>(mem)] = Allocation{bytes, d, type};
  *p = mem;
  return cudaSuccess;
}
}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) { return allocate(p, bytes, cudaMemoryTypeDevice); }
cudaError_t cudaMallocHost(void** p, size_t bytes) { return allocate(p, bytes, cudaMemoryTypeHost); }

cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  ensure_context();
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_allocs.end()) return cudaErrorInvalidValue;
  g_allocs.erase(it);
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  if (!attr) return cudaErrorInvalidValue;
  ensure_context();
  std::memset(attr, 0, sizeof(*attr));
  const uintptr_t v = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_allocs.upper_bound(v);
  if (it != g_allocs.begin()) {
    --it;
    const Allocation& a = it->second;
    if (v >= it->first && v < it->first + std::max<size_t>(a.bytes, 1)) {
      attr->type = a.type;
      attr->device = a.device;
      attr->devicePointer = const_cast<void*>(ptr);
      attr->hostPointer = a.type == cudaMemoryTypeHost ? const_cast<void*>(ptr) : nullptr;
      return cudaSuccess;
    }
  }
  attr->type = cudaMemoryTypeUnregistered;  // plain host memory (CUDA >= 11 answers so, no error)
  attr->device = -2;
  attr->hostPointer = const_cast<void*>(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  ensure_context();
  if (bytes) std::memmove(dst, src, bytes);  // a synchronous copy: both sides are host memory here
  return cudaSuccess;
}

}  // extern "C"
