// AVX2 + FMA + F16C instance of the pack kernel. See Note [Run-time ISA dispatch] and
// Note [Internal linkage in ISA translation units]: standard headers come before the target pragma.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "pack.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "vec_avx2.h"
#include "pack_impl.h"
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr PackKernelTable kAvx2PackKernels = NCCLAVG_PACK_TABLE(Avx2Lane, SimdLevel::kAvx2);
}  // namespace cpu
}  // namespace ncclavg
