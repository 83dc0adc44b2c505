// AVX-512 (F, BW, VL, DQ) instance of the pack kernel. See Note [Run-time ISA dispatch] and
// Note [Internal linkage in ISA translation units]: standard headers come before the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "pack.h"

#pragma GCC push_options
// GCC 12 flags the deliberately undefined pass-through operand inside its own AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "vec_avx512.h"
#include "pack_impl.h"
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr PackKernelTable kAvx512PackKernels = NCCLAVG_PACK_TABLE(Avx512Lane, SimdLevel::kAvx512);
}  // namespace cpu
}  // namespace ncclavg
