// Element-wise division of one device buffer by a scalar: the second half of SUM-then-scale, used by
// the NCCL communicator when ncclAvg is missing (NCCL < 2.10) or would round 1/n to a 16-bit type.
// The division is ew::mean_of_sum, the same correctly rounded fp32 division the average kernels use,
// so a SUM followed by this kernel gives exactly what average_ gives for the same fp32 sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/check.h"
#include "../common/elementwise.h"
#include "cuda_check.h"
#include "cuda_ops.h"

namespace ncclavg {
namespace cuda {
namespace {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void divide_kernel(T* p, int64_t numel, float divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    p[i] = from_f32<T>(ew::mean_of_sum(to_f32(p[i]), divisor));
  }
}

template <typename T>
void launch(void* p, int64_t numel, float divisor, cudaStream_t s) {
  const int threads = 256;
  int64_t blocks = (numel + threads - 1) / threads;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;  // the grid-stride loop covers the rest
  divide_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, s>>>(static_cast<T*>(p), numel, divisor);
  NCCLAVG_CUDA_CHECK_LAUNCH();
}

}  // namespace

void divide_inplace(const Buffer& b, float divisor, uintptr_t stream) {
  validate_buffer(b, "buffer");
  NCCLAVG_CHECK_ARG(!b.on_cpu(), "buffer", "divide_inplace needs a device buffer, got ", b.describe());
  NCCLAVG_CHECK_ARG(!b.readonly, "buffer", "is read-only");
  NCCLAVG_CHECK_ARG(divisor > 0.0f, "divisor", "must be > 0, got ", divisor);
  if (b.numel == 0 || divisor == 1.0f) return;
  DeviceGuard guard(b.device);
  void* p = reinterpret_cast<void*>(b.ptr);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  switch (b.dtype) {
    case DType::kFloat32: launch<float>(p, b.numel, divisor, s); break;
    case DType::kFloat16: launch<__half>(p, b.numel, divisor, s); break;
    case DType::kBFloat16: launch<__nv_bfloat16>(p, b.numel, divisor, s); break;
  }
}

}  // namespace cuda
}  // namespace ncclavg
