// CUDA twin of cpu::run_segments: one launch packs (or unpacks) many tensors through a chunk table, the
// way apex's multi_tensor_apply does, with the dtype cast and scale of common/pack_math.h fused in.
//
// Note [Pack chunk table]
// Every segment is cut into chunks of kChunk elements; block b handles chunk b. A chunk entry names its
// segment and its start, the segment entry holds pointers, dtypes and size. Unlike apex, whose table
// travels in the kernel parameters (so a long tensor list needs several launches), the table lives in
// device memory: it is staged in a host vector, copied with cudaMemcpyAsync (pageable source: the copy
// is staged by the driver before the call returns, so the host vector may die right after) into memory
// from the stream-ordered allocator, which is freed on the same stream after the kernel. So a bucket is
// always ONE launch, however many tensors it holds, and nothing synchronises the host.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

#include "../common/check.h"
#include "../common/pack_math.h"
#include "cuda_check.h"
#include "pack_cuda.h"

namespace ncclavg {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 16384;  // elements per block: 64 KiB of fp32, big enough to amortise the lookup

struct SegmentEntry {
  const void* src;
  void* dst;
  int64_t numel;
  int src_dtype;
  int dst_dtype;
};

struct ChunkEntry {
  int segment;
  int64_t start;
};

__device__ __forceinline__ float load_as_float(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat16): return __half2float(static_cast<const __half*>(p)[i]);
    case static_cast<int>(DType::kBFloat16): return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_from_float(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case static_cast<int>(DType::kFloat16): static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    case static_cast<int>(DType::kBFloat16): static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

template <int kMode>
__global__ void pack_kernel(const SegmentEntry* __restrict__ segs, const ChunkEntry* __restrict__ chunks,
                            float mul, float div) {
  const ChunkEntry c = chunks[blockIdx.x];
  const SegmentEntry s = segs[c.segment];
  const int64_t end = min(s.numel, c.start + kChunk);
  // The dtype switch is uniform over the block (one segment per block): no divergence.
  for (int64_t i = c.start + threadIdx.x; i < end; i += blockDim.x) {
    const float x = load_as_float(s.src, s.src_dtype, i);
    store_from_float(s.dst, s.dst_dtype, i, ew::pack_scale<kMode>(x, mul, div));
  }
}

}  // namespace

void run_segments(const std::vector<CopySegment>& segs, float mul, float div, int device, uintptr_t stream) {
  if (segs.empty()) return;
  std::vector<SegmentEntry> seg_table;
  std::vector<ChunkEntry> chunk_table;
  seg_table.reserve(segs.size());
  for (size_t k = 0; k < segs.size(); ++k) {
    const CopySegment& s = segs[k];
    seg_table.push_back({reinterpret_cast<const void*>(s.src), reinterpret_cast<void*>(s.dst), s.numel,
                         static_cast<int>(s.src_dtype), static_cast<int>(s.dst_dtype)});
    for (int64_t start = 0; start < s.numel; start += kChunk) chunk_table.push_back({static_cast<int>(k), start});
  }
  NCCLAVG_CHECK_ARG(chunk_table.size() <= 0x7fffffffULL, "srcs", "too many elements for one launch");
  DeviceGuard guard(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const size_t seg_bytes = seg_table.size() * sizeof(SegmentEntry);
  const size_t seg_bytes_aligned = (seg_bytes + 255) / 256 * 256;
  const size_t table_bytes = seg_bytes_aligned + chunk_table.size() * sizeof(ChunkEntry);
  // See Note [Pack chunk table].
  std::vector<char> host(table_bytes);
  std::memcpy(host.data(), seg_table.data(), seg_bytes);
  std::memcpy(host.data() + seg_bytes_aligned, chunk_table.data(), chunk_table.size() * sizeof(ChunkEntry));
  void* dev = nullptr;
  NCCLAVG_CUDA_CHECK(cudaMallocAsync(&dev, table_bytes, st));
  NCCLAVG_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), table_bytes, cudaMemcpyHostToDevice, st));
  const auto* d_segs = static_cast<const SegmentEntry*>(dev);
  const auto* d_chunks = reinterpret_cast<const ChunkEntry*>(static_cast<char*>(dev) + seg_bytes_aligned);
  const unsigned blocks = static_cast<unsigned>(chunk_table.size());
  switch (ew::pack_mode(mul, div)) {
    case ew::kPackCopy: pack_kernel<ew::kPackCopy><<<blocks, kThreads, 0, st>>>(d_segs, d_chunks, mul, div); break;
    case ew::kPackMul: pack_kernel<ew::kPackMul><<<blocks, kThreads, 0, st>>>(d_segs, d_chunks, mul, div); break;
    case ew::kPackDiv: pack_kernel<ew::kPackDiv><<<blocks, kThreads, 0, st>>>(d_segs, d_chunks, mul, div); break;
    default: pack_kernel<ew::kPackMulDiv><<<blocks, kThreads, 0, st>>>(d_segs, d_chunks, mul, div); break;
  }
  NCCLAVG_CUDA_CHECK_LAUNCH();
  NCCLAVG_CUDA_CHECK(cudaFreeAsync(dev, st));
}

void pack(const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float mul,
          float div, uintptr_t stream) {
  NCCLAVG_CHECK_ARG(!dst.on_cpu(), "dst", "the CUDA pack needs device memory, got ", dst.describe());
  run_segments(plan_pack(srcs, dst, offsets, mul, div), mul, div, dst.device, stream);
}

void unpack(const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float mul,
            float div, uintptr_t stream) {
  NCCLAVG_CHECK_ARG(!src.on_cpu(), "src", "the CUDA unpack needs device memory, got ", src.describe());
  run_segments(plan_unpack(src, dsts, offsets, mul, div), mul, div, src.device, stream);
}

}  // namespace cuda
}  // namespace ncclavg
