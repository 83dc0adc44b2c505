// Element types and 16-byte vector accesses shared by the CUDA kernels (pack, average, scale). Device
// code: include from .cu files only.
//
// Note [16-byte accesses]
// A memory-bound kernel reaches HBM bandwidth only with wide accesses and enough bytes in flight: one
// 4-byte load per thread and loop iteration leaves the H200 far below its ~4.8 TB/s. So the kernels
// move 16-byte vectors (LDG.128 / STG.128) where the pointers allow it, issue several independent
// vector loads per thread before using any of them, and fall back to one element at a time for the
// unaligned head (up to 15 bytes) and the tail. A range is vectorised only when the source and the
// destination reach a 16-byte boundary after the SAME number of head elements; otherwise it is copied
// element by element (correct, just slower: bucket slots are 256-byte aligned, so this is rare).
// Only the access width changes: every element goes through the same load -> fp32 -> math -> store
// sequence as in the scalar path (and as in the CPU kernels), so results stay bit for bit identical,
// NaNs aside: a NaN converted from or to fp16, or to bf16, comes out as the canonical NaN on the device
// (the CUDA headers' conversions), where the CPU kernels keep its sign and payload. It stays a NaN.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../common/dtype.h"

namespace ncclavg {
namespace cuda {

// The storage type of each DType, with its exact conversions to and from fp32 (round to nearest even
// on the way back, like the CPU path). 16-bit types travel as raw bits.
struct F32 {
  using T = float;
  static constexpr DType kDType = DType::kFloat32;
  static __device__ __forceinline__ float to_float(T v) { return v; }
  static __device__ __forceinline__ T from_float(float v) { return v; }
};
struct F16 {
  using T = unsigned short;
  static constexpr DType kDType = DType::kFloat16;
  static __device__ __forceinline__ float to_float(T v) { return __half2float(__ushort_as_half(v)); }
  static __device__ __forceinline__ T from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct BF16 {
  using T = unsigned short;
  static constexpr DType kDType = DType::kBFloat16;
  static __device__ __forceinline__ float to_float(T v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  static __device__ __forceinline__ T from_float(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

// N elements of type T moved as N * sizeof(T) / 16 sixteen-byte accesses.
template <typename T, int N>
struct alignas(16) Vec {
  static_assert((N * sizeof(T)) % 16 == 0, "a Vec is a whole number of 16-byte accesses");
  T e[N];
};

// Elements per vector step for a copy from S to D: 16 bytes of the narrower type (so the wider side
// moves 32 bytes as two 16-byte accesses).
template <typename S, typename D>
struct VecElems {
  static constexpr int kNarrow = static_cast<int>(sizeof(typename S::T) < sizeof(typename D::T)
                                                      ? sizeof(typename S::T)
                                                      : sizeof(typename D::T));
  static constexpr int value = 16 / kNarrow;
};

// Elements before `p` (of elements of `size` bytes) reaches a 16-byte boundary; -1 when it never does
// (p not aligned to its own element size).
__host__ __device__ __forceinline__ int64_t head_to_16(uintptr_t p, int size) {
  if (p % static_cast<uintptr_t>(size) != 0) return -1;
  return static_cast<int64_t>((16 - p % 16) % 16) / size;
}

// Elements to copy one by one before both `src` and `dst` are 16-byte aligned, at most `n`; `n` (all of
// it element by element) when no common head exists. See Note [16-byte accesses].
__host__ __device__ __forceinline__ int64_t common_head(uintptr_t src, int src_size, uintptr_t dst, int dst_size,
                                                        int64_t n) {
  const int64_t h = head_to_16(src, src_size);
  if (h < 0 || h >= n) return n;
  const uintptr_t dst_at = dst + static_cast<uintptr_t>(h) * dst_size;
  return dst_at % 16 == 0 ? h : n;
}

}  // namespace cuda
}  // namespace ncclavg
