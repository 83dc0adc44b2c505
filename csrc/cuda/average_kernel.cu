// CUDA twin of cpu::average_inplace: one launch averages N buffers of one device in place. The element
// math (ew::mean_of_sum, fp32 accumulation in buffer order) and the bf16 rounding rule are the ones the
// CPU path uses; only the access width differs (See Note [16-byte accesses] in vector_io.h).
#include <cuda_runtime.h>

#include "../common/check.h"
#include "../common/elementwise.h"
#include "cuda_check.h"
#include "cuda_ops.h"
#include "vector_io.h"

namespace ncclavg {
namespace cuda {
namespace {

// Buffer pointers travel by value in the kernel parameters (<= 4 KiB on every supported arch).
constexpr int kMaxBuffers = 256;
struct PtrTable {
  void* p[kMaxBuffers];
};

constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // vectors per thread and step
constexpr int kGroup = 4;   // buffers loaded together: kUnroll * kGroup vector loads in flight

// Where the vector part starts: buffers whose addresses differ modulo 16 cannot share one, and then
// everything goes element by element (head == numel).
struct Layout {
  int64_t head;  // elements before the vector part
  int64_t nvec;  // vectors in the vector part
  int64_t tail;  // first element after it
};

template <typename E>
Layout layout_of(const PtrTable& t, int n, int64_t numel) {
  constexpr int V = VecElems<E, E>::value;
  const uintptr_t p0 = reinterpret_cast<uintptr_t>(t.p[0]);
  int64_t head = head_to_16(p0, sizeof(typename E::T));
  if (head < 0 || head > numel) head = numel;
  for (int k = 1; k < n && head < numel; ++k) {
    if (reinterpret_cast<uintptr_t>(t.p[k]) % 16 != p0 % 16) head = numel;
  }
  const int64_t nvec = (numel - head) / V;
  return Layout{head, nvec, head + nvec * V};
}

// The element path: the CPU kernel's loop for one index.
template <typename E>
__device__ __forceinline__ void average_elem(const PtrTable& t, int n, float fn, int64_t i) {
  using T = typename E::T;
  float acc = E::to_float(static_cast<const T*>(t.p[0])[i]);
  for (int k = 1; k < n; ++k) acc += E::to_float(static_cast<const T*>(t.p[k])[i]);
  const T mean = E::from_float(ew::mean_of_sum(acc, fn));
  for (int k = 0; k < n; ++k) static_cast<T*>(t.p[k])[i] = mean;
}

// kUnroll vectors (j, j + stride, ...) of every buffer: the same additions, in the same order, per lane.
template <typename E>
__device__ __forceinline__ void average_vectors(const PtrTable& t, int n, float fn, int64_t head, int64_t j,
                                                int64_t stride, int64_t nvec) {
  constexpr int V = VecElems<E, E>::value;
  using T = typename E::T;
  using VT = Vec<T, V>;
  bool live[kUnroll];
  float acc[kUnroll][V];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) live[u] = j + u * stride < nvec;
  {
    VT first[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (live[u]) first[u] = reinterpret_cast<const VT*>(static_cast<const T*>(t.p[0]) + head)[j + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = live[u] ? E::to_float(first[u].e[e]) : 0.0f;
    }
  }
  for (int k0 = 1; k0 < n; k0 += kGroup) {
    VT in[kGroup][kUnroll];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {  // every load of the group first, then the additions
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (k0 + g < n && live[u]) {
          in[g][u] = reinterpret_cast<const VT*>(static_cast<const T*>(t.p[k0 + g]) + head)[j + u * stride];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (k0 + g >= n) break;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!live[u]) continue;  // a lane past nvec loaded nothing: its in[g][u] is uninitialised
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] += E::to_float(in[g][u].e[e]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (!live[u]) continue;
    VT mean;
#pragma unroll
    for (int e = 0; e < V; ++e) mean.e[e] = E::from_float(ew::mean_of_sum(acc[u][e], fn));
    for (int k = 0; k < n; ++k) reinterpret_cast<VT*>(static_cast<T*>(t.p[k]) + head)[j + u * stride] = mean;
  }
}

template <typename E>
__global__ void __launch_bounds__(kThreads) average_kernel(PtrTable t, int n, int64_t numel, Layout l) {
  const float fn = static_cast<float>(n);
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // The head and the tail (fewer than a vector each, unless nothing could be vectorised).
  for (int64_t i = gid; i < l.head; i += stride) average_elem<E>(t, n, fn, i);
  for (int64_t i = l.tail + gid; i < numel; i += stride) average_elem<E>(t, n, fn, i);
  for (int64_t j = gid; j < l.nvec; j += stride * kUnroll) average_vectors<E>(t, n, fn, l.head, j, stride, l.nvec);
}

template <typename E>
void launch(const PtrTable& t, int n, int64_t numel, cudaStream_t s) {
  const Layout l = layout_of<E>(t, n, numel);
  const int64_t work = l.nvec > 0 ? (l.nvec + kUnroll - 1) / kUnroll : numel;  // threads with something to do
  int64_t blocks = (work + kThreads - 1) / kThreads;
  if (blocks > 65535LL * 8) blocks = 65535LL * 8;  // grid-stride loops cover the rest
  if (blocks < 1) blocks = 1;
  average_kernel<E><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(t, n, numel, l);
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
    case DType::kFloat32: launch<F32>(t, n, numel, s); break;
    case DType::kFloat16: launch<F16>(t, n, numel, s); break;
    case DType::kBFloat16: launch<BF16>(t, n, numel, s); break;
  }
}

}  // namespace cuda
}  // namespace ncclavg
