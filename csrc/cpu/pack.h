// Fused multi-tensor pack/unpack on the host: ONE call moves many tensors into (or out of) a flat bucket,
// casting dtype and scaling in the same pass. See Note [Pack scale modes] in common/pack_math.h.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/buffer.h"
#include "../common/pack_plan.h"
#include "simd.h"

namespace ncclavg {
namespace cpu {

// Kernel family of the pack: one entry converting a contiguous run of n elements (src dtype -> dst
// dtype, y = x * mul / div). Compiled once per ISA in pack_{scalar,avx2,avx512}.cpp; the OpenMP split
// lives in pack.cpp (see Note [OpenMP outside the ISA kernels]). nonfinite != nullptr: *nonfinite = whether
// a written value is an inf/NaN, noted in the same loop (Note [Finiteness from the pass that writes]).
struct PackKernelTable {
  SimdLevel level;
  void (*convert)(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, float mul, float div,
                  bool* nonfinite);
};

extern const PackKernelTable kScalarPackKernels;
#if defined(__x86_64__)
extern const PackKernelTable kAvx2PackKernels;
extern const PackKernelTable kAvx512PackKernels;
#elif defined(__aarch64__)
extern const PackKernelTable kNeonPackKernels;
extern const PackKernelTable kSvePackKernels;
#endif

// The table of the SIMD level in use (follows set_simd_level / NCCLAVG_SIMD like the other kernels).
const PackKernelTable& pack_kernels();

// Runs the segments with the OpenMP + SIMD kernels, splitting the concatenated element range evenly
// over threads (one thread may cover the tail of one segment and the head of the next). check_finite:
// returns whether any value written is an inf or a NaN (false without the check).
bool run_segments(const std::vector<CopySegment>& segs, float mul, float div, bool check_finite = false);

// Both return run_segments' answer: with check_finite, whether a value they wrote is an inf/NaN.
bool pack(const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float mul,
          float div, bool check_finite = false);
bool unpack(const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float mul,
            float div, bool check_finite = false);

}  // namespace cpu
}  // namespace ncclavg
