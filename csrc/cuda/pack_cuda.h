// CUDA entry point of the fused multi-tensor pack/unpack, declared without CUDA types so bindings.cpp
// needs no CUDA headers. Streams cross as integer handles (cudaStream_t cast to uintptr_t).
#pragma once
#include <cstdint>
#include <vector>

#include "../common/buffer.h"
#include "../common/pack_plan.h"

namespace ncclavg {
namespace cuda {

// Enqueues the kernel launches that run every segment on `stream` (device `device`), asynchronously:
// one for up to 1020 segments where the driver and device allow 32 KiB of kernel parameters, else one
// per 120 (See Note [Pack chunk table] in pack_kernel.cu).
void run_segments(const std::vector<CopySegment>& segs, float mul, float div, int device, uintptr_t stream);

void pack(const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float mul,
          float div, uintptr_t stream);
void unpack(const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float mul,
            float div, uintptr_t stream);

}  // namespace cuda
}  // namespace ncclavg
