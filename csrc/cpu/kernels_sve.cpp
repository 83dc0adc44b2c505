// SVE instance of the CPU kernels, vector-length agnostic. See Note [Run-time ISA dispatch], Note [SVE
// kernels without a compile-time width] (sve_impl.h) and Note [Internal linkage in ISA translation
// units]: standard headers come before the target pragma.
#include <arm_sve.h>

#include <cstdint>

#include "simd.h"

#pragma GCC push_options
#pragma GCC target("+sve")
#include "kernels_impl.h"
#include "sve_impl.h"
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr KernelTable kSveKernels = {SimdLevel::kSve, &sve_average_range, &sve_sum_range};
}  // namespace cpu
}  // namespace ncclavg
