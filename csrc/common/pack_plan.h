// Validation and segment list of the fused multi-tensor pack/unpack, shared by the CPU and CUDA paths.
#pragma once
#include <cstdint>
#include <vector>

#include "buffer.h"

namespace ncclavg {

// One contiguous copy: `numel` elements from src (src_dtype) to dst (dst_dtype).
struct CopySegment {
  uintptr_t src;
  uintptr_t dst;
  int64_t numel;
  DType src_dtype;
  DType dst_dtype;
};

// pack:   tensors[i] -> bucket[offsets[i] : offsets[i] + tensors[i].numel]
// unpack: bucket[offsets[i] : ...] -> tensors[i]
// Checks every argument (names them in errors): sizes, devices, writability, offsets in range, and that
// no written byte is written twice or read by another segment (an exact in-place alias of the same
// dtype is allowed: that is an in-place scale). Returns the non-empty segments, in argument order, minus
// exact aliases when there is nothing to scale.
std::vector<CopySegment> plan_pack(const std::vector<Buffer>& tensors, const Buffer& bucket,
                                   const std::vector<int64_t>& offsets, float mul, float div);
std::vector<CopySegment> plan_unpack(const Buffer& bucket, const std::vector<Buffer>& tensors,
                                     const std::vector<int64_t>& offsets, float mul, float div);

// Validates mul/div (finite, div != 0): named `scale` and `divisor` as in the Python API.
void check_pack_factors(float mul, float div);

}  // namespace ncclavg
