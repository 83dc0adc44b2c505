// CUDA twin of cpu::average_inplace: one launch averages N buffers of one device in place. The element
// math (ew::mean_of_sum) and the bf16 rounding rule are the ones the CPU path uses.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/check.h"
#include "../common/elementwise.h"
#include "cuda_check.h"
#include "cuda_ops.h"

namespace ncclavg {
namespace cuda {
namespace {

// Buffer pointers travel by value in the kernel parameters (<= 4 KiB on every supported arch).
constexpr int kMaxBuffers = 256;
struct PtrTable {
  void* p[kMaxBuffers];
};

__device__ __forceinline__ float load_elem(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_elem(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load_elem(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_elem(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_elem(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void store_elem(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

template <typename T>
__global__ void average_kernel(PtrTable t, int n, int64_t numel) {
  const float fn = static_cast<float>(n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    float acc = load_elem(static_cast<const T*>(t.p[0]), i);
    for (int k = 1; k < n; ++k) acc += load_elem(static_cast<const T*>(t.p[k]), i);
    const float mean = ew::mean_of_sum(acc, fn);
    for (int k = 0; k < n; ++k) store_elem(static_cast<T*>(t.p[k]), i, mean);
  }
}

template <typename T>
void launch(const PtrTable& t, int n, int64_t numel, cudaStream_t s) {
  const int threads = 256;
  int64_t blocks = (numel + threads - 1) / threads;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;  // grid-stride loop covers the rest
  average_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, s>>>(t, n, numel);
  NCCLAVG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void average_inplace(const std::vector<Buffer>& bufs, uintptr_t stream) {
  validate_group(bufs, "buffers");
  NCCLAVG_CHECK_ARG(!bufs[0].on_cpu(), "buffers", "the CUDA average needs device buffers, got ",
                    bufs[0].describe());
  const int n = static_cast<int>(bufs.size());
  NCCLAVG_CHECK_ARG(n <= kMaxBuffers, "buffers", "at most ", kMaxBuffers, " buffers per call, got ", n);
  const int64_t numel = bufs[0].numel;
  if (n == 1 || numel == 0) return;
  PtrTable t{};
  for (int i = 0; i < n; ++i) t.p[i] = reinterpret_cast<void*>(bufs[i].ptr);
  DeviceGuard guard(bufs[0].device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (bufs[0].dtype) {
    case DType::kFloat32: launch<float>(t, n, numel, s); break;
    case DType::kFloat16: launch<__half>(t, n, numel, s); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(t, n, numel, s); break;
  }
}

}  // namespace cuda
}  // namespace ncclavg
