#pragma once
#include <vector>

#include "../common/buffer.h"

namespace ncclavg {
namespace cpu {

// In-place mean of N host buffers in one pass: fp32 accumulation, one rounding to the storage type,
// the mean written back to every buffer. Validates the group first (see validate_group).
void average_inplace(const std::vector<Buffer>& bufs);

}  // namespace cpu
}  // namespace ncclavg
