// Run-time ISA dispatch for the CPU kernels.
//
// Note [Run-time ISA dispatch]
// The package is built once and runs on any x86-64 (or any ARMv8-A machine), so it is never compiled
// with -march=native. Each kernel family is compiled once per level of the target architecture, each
// translation unit with its own `#pragma GCC target`, and the tables of function pointers are chosen at
// first use from what the CPU reports:
// - x86-64: kernels_scalar.cpp, kernels_avx2.cpp and kernels_avx512.cpp, chosen from CPUID.
// - aarch64: kernels_scalar.cpp, kernels_neon.cpp (Advanced SIMD is part of ARMv8-A, so always there)
//   and kernels_sve.cpp, chosen from the kernel's hardware capabilities (getauxval(AT_HWCAP) &
//   HWCAP_SVE). The SVE kernels are vector-length agnostic (predicated loops, Note [SVE kernels without
//   a compile-time width] in sve_impl.h): one binary serves 128- to 2048-bit SVE.
// setup.py compiles only the current architecture's level files. NCCLAVG_SIMD=scalar|avx2|avx512 (x86)
// or scalar|neon|sve (aarch64) forces a level (tests compare every level the machine supports against
// the scalar one); forcing a level the CPU lacks, or one of the other architecture, raises an error
// instead of crashing with an illegal instruction. Every level gives the scalar level's bits.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../common/dtype.h"

namespace ncclavg {
namespace cpu {

enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kNeon = 3, kSve = 4 };

// The levels of the architecture this was built for, scalar first (what simd_levels_supported filters).
const std::vector<SimdLevel>& simd_levels_of_arch();

const char* simd_level_name(SimdLevel l);
SimdLevel simd_level_best_supported();
bool simd_level_supported(SimdLevel l);

// Kernel table: one entry per kernel family; all entries work on the element range [begin, end) so that
// OpenMP threads (which live in the default-ISA dispatcher) each call the ISA kernel on their own slice.
// See Note [OpenMP outside the ISA kernels].
struct KernelTable {
  SimdLevel level;
  // Both: nonfinite != nullptr sets *nonfinite to whether any value written over [begin, end) is an inf
  // or a NaN, noted in registers in the same loop (Note [Finiteness from the pass that writes] in
  // common/finite_math.h); nullptr runs the loop without the check.
  // Average n buffers of `dtype` in place over [begin, end): reads each once, writes the mean to each.
  void (*average)(void* const* bufs, int n, DType dtype, int64_t begin, int64_t end, bool* nonfinite);
  // out[i] (and out2[i] unless null) = (srcs[0][i] + ... + srcs[n-1][i]) * mul / div over [begin, end):
  // sources in order, fp32 accumulation, rounded to `dtype` before the scale (the shared-memory channel).
  void (*sum)(void* out, void* out2, const void* const* srcs, int n, DType dtype, float mul, float div,
              int64_t begin, int64_t end, bool* nonfinite);
};

extern const KernelTable kScalarKernels;
#if defined(__x86_64__)
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
#elif defined(__aarch64__)
extern const KernelTable kNeonKernels;
extern const KernelTable kSveKernels;
#endif

// The table in use: NCCLAVG_SIMD if set (validated), else the best the CPU supports. Cached after the
// first call; `reset_kernel_table_for_testing` rereads the environment.
const KernelTable& kernels();
void set_simd_level(const std::string& name);  // "auto" | "scalar" | "avx2" | "avx512" | "neon" | "sve"
SimdLevel current_simd_level();

}  // namespace cpu
}  // namespace ncclavg
