// SVE instance of the pack kernel, vector-length agnostic. See Note [Run-time ISA dispatch] and Note
// [SVE kernels without a compile-time width] (sve_impl.h): standard headers come before the target pragma.
#include <arm_neon.h>
#include <arm_sve.h>

#include <cstdint>
#include <vector>

#include "pack.h"

#pragma GCC push_options
#pragma GCC target("+sve")
#include "vec_neon.h"
#include "pack_impl.h"
#include "kernels_impl.h"
#include "sve_impl.h"

namespace ncclavg {
namespace cpu {
namespace {

// pack_impl.h's pack_convert with the SVE conversion loop; the plain copies are the same memcpy and
// copy_checked (generic 16-byte vectors: a copy is bound by memory, not by the width).
void sve_pack_convert(const void* src, DType sdt, void* dst, DType ddt, int64_t n, float mul, float div,
                      bool* nonfinite) {
  if (nonfinite != nullptr) *nonfinite = false;
  if (n <= 0) return;
  if (sdt == ddt && ew::pack_mode(mul, div) == ew::kPackCopy) {
    pack_convert<NeonLane>(src, sdt, dst, ddt, n, mul, div, nonfinite);
    return;
  }
  with_storage(sdt, [&](auto s) {
    with_storage(ddt, [&](auto d) {
      using S = decltype(s);
      using D = decltype(d);
      if (nonfinite != nullptr) {
        *nonfinite = sve_convert_typed<S, D, true>(src, dst, n, mul, div);
      } else {
        sve_convert_typed<S, D, false>(src, dst, n, mul, div);
      }
    });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace ncclavg
#pragma GCC pop_options

namespace ncclavg {
namespace cpu {
constexpr PackKernelTable kSvePackKernels = {SimdLevel::kSve, &sve_pack_convert};
}  // namespace cpu
}  // namespace ncclavg
