#pragma once
#include <vector>

#include "../common/buffer.h"

namespace ncclavg {
namespace cpu {

// In-place mean of N host buffers in one pass: fp32 accumulation, one rounding to the storage type,
// the mean written back to every buffer. Validates the group first (see validate_group).
// check_finite: returns whether any mean it wrote is an inf or a NaN, noted in the same pass (Note
// [Finiteness from the pass that writes] in common/finite_math.h); false otherwise, and when nothing is
// written (one buffer, or none of its elements).
bool average_inplace(const std::vector<Buffer>& bufs, bool check_finite = false);

}  // namespace cpu
}  // namespace ncclavg
