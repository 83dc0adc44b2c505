// Element-wise division of one device buffer by a scalar: the second half of SUM-then-scale, used by
// the NCCL communicator when ncclAvg is missing (NCCL < 2.10) or would round 1/n to a 16-bit type.
// The division is ew::mean_of_sum, the same correctly rounded fp32 division the average kernels use,
// so a SUM followed by this kernel gives exactly what average_ gives for the same fp32 sum.
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/elementwise.h"
#include "cuda_check.h"
#include "cuda_ops.h"
#include "vector_io.h"

namespace ncclavg {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent vector loads in flight per thread

template <typename E>
__device__ __forceinline__ typename E::T divided(typename E::T v, float divisor) {
  return E::from_float(ew::mean_of_sum(E::to_float(v), divisor));
}

// In place, so no __restrict__ promise: each element is read and then written by the same thread.
// See Note [16-byte accesses] in vector_io.h.
template <typename E>
__global__ void __launch_bounds__(kThreads) divide_kernel(typename E::T* p, int64_t numel, int64_t head,
                                                          float divisor) {
  constexpr int V = VecElems<E, E>::value;
  using VT = Vec<typename E::T, V>;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nvec = (numel - head) / V;
  const int64_t tail = head + nvec * V;
  for (int64_t i = gid; i < head; i += stride) p[i] = divided<E>(p[i], divisor);
  for (int64_t i = tail + gid; i < numel; i += stride) p[i] = divided<E>(p[i], divisor);
  VT* vp = reinterpret_cast<VT*>(p + head);
  for (int64_t base = gid; base < nvec; base += stride * kUnroll) {
    VT v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load first: kUnroll requests in flight
      if (base + u * stride < nvec) v[u] = vp[base + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride >= nvec) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) v[u].e[e] = divided<E>(v[u].e[e], divisor);
      vp[base + u * stride] = v[u];
    }
  }
}

template <typename E>
void launch(void* p, int64_t numel, float divisor, cudaStream_t s) {
  constexpr int V = VecElems<E, E>::value;
  int64_t head = head_to_16(reinterpret_cast<uintptr_t>(p), sizeof(typename E::T));
  if (head < 0 || head > numel) head = numel;  // unaligned element pointer: element by element
  const int64_t nvec = (numel - head) / V;
  const int64_t work = nvec > 0 ? (nvec + kUnroll - 1) / kUnroll : numel;
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;  // the grid-stride loop covers the rest
  if (blocks < 1) blocks = 1;
  divide_kernel<E><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(static_cast<typename E::T*>(p), numel, head,
                                                                      divisor);
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
    case DType::kFloat32: launch<F32>(p, b.numel, divisor, s); break;
    case DType::kFloat16: launch<F16>(p, b.numel, divisor, s); break;
    case DType::kBFloat16: launch<BF16>(p, b.numel, divisor, s); break;
  }
}

}  // namespace cuda
}  // namespace ncclavg
