// CUDA twin of cpu::run_segments: one launch packs (or unpacks) many tensors through a segment table,
// the way apex's multi_tensor_apply does, with the dtype cast and scale of common/pack_math.h fused in.
//
// Note [Pack chunk table]
// Every segment (one tensor <-> its bucket slot) is cut into chunks of kChunk elements; block b handles
// one chunk. The table travels in the KERNEL PARAMETERS, like apex's: a segment entry holds the
// pointers, dtypes, size and the first block that works on it, and a block finds its segment by a
// binary search over those first blocks (7 steps for a small table, 10 for a large one, on uniform
// constant-bank loads). Parameters need no copy of their own: no cudaMemcpyAsync from pageable memory,
// which the driver may turn into a wait for the stream (inside a backward hook that would stall the
// host until the backward kernels queued so far have run), no stream-ordered allocation, no host
// synchronisation.
// The price is the parameter limit. Every toolkit and architecture allows 4 KiB: a small table of
// kSmallSegments (120) entries. CUDA 12.1 raised the limit to 32,764 bytes on Volta and newer (sm_70+),
// when the driver is 12.1 or newer as well: a large table of kLargeSegments (1020) entries, so a bucket
// of up to 1020 tensors takes ONE launch. run_segments uses the small table when it holds the whole
// bucket (a launch copies its whole parameter block, so 32 KiB for a bucket of 5 tensors would be
// waste), the large one when the bucket needs more and the device and driver allow it, and otherwise
// one small launch per 120 segments (a few microseconds of launch each, on the same stream, in order).
// A build with an architecture older than sm_70 (NCCLAVG_CUDA_ARCHS) compiles no large table: setup.py
// then defines NCCLAVG_PACK_SMALL_TABLE_ONLY, since nvcc refuses large parameters for those targets.
// The tables are __grid_constant__ (where the build allows it): read in place from the constant bank
// even with a dynamic index, never copied to per-thread local memory.
// Chunks of kChunk = 8192 elements give a 25 MiB fp32 bucket 800 blocks (several waves on an H200's
// 132 SMs) while each thread still moves 32-64 bytes per chunk in 16-byte accesses with kUnroll loads
// in flight. See Note [16-byte accesses] in vector_io.h.
#include <cuda_runtime.h>

#include <vector>

#include "../common/check.h"
#include "../common/pack_math.h"
#include "cuda_check.h"
#include "pack_cuda.h"
#include "vector_io.h"

namespace ncclavg {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;          // independent vector loads in flight per thread
constexpr int64_t kChunk = 8192;    // elements per block; a multiple of every vector width


#if CUDART_VERSION >= 12010 && !defined(NCCLAVG_PACK_SMALL_TABLE_ONLY)
#define NCCLAVG_PACK_LARGE_TABLE 1
#endif

struct SegmentEntry {
  const void* src;
  void* dst;
  int64_t numel;
  int32_t first_block;  // blocks [first_block, next entry's first_block) of this launch work on it
  int16_t src_dtype;
  int16_t dst_dtype;
};

template <int kCapacity>
struct SegmentTable {
  static constexpr int kSize = kCapacity;
  SegmentEntry seg[kCapacity];
  int32_t count;
};

// See Note [Pack chunk table]. The two floats are the kernel's other parameters.
constexpr int kSmallSegments = 120;
constexpr int kLargeSegments = 1020;
static_assert(sizeof(SegmentTable<kSmallSegments>) + 2 * sizeof(float) <= 4096,
              "a small table must fit the 4 KiB parameter limit of every toolkit and architecture");
static_assert(sizeof(SegmentTable<kLargeSegments>) + 2 * sizeof(float) <= 32764,
              "a large table must fit the 32,764-byte parameter limit of CUDA 12.1 on sm_70+");

template <typename S, typename D, int kMode>
__device__ __forceinline__ typename D::T convert(typename S::T x, float mul, float div) {
  return D::from_float(ew::pack_scale<kMode>(S::to_float(x), mul, div));
}

// `__restrict__` pointers: a segment's source and destination never overlap (the plan checks it), so
// the compiler may keep loads ahead of stores. Except for an in-place scale (a tensor that IS its
// bucket slot), where they are the same memory and that promise would be false.
template <typename T, bool kInPlace>
struct Ptr {
  using type = T* __restrict__;
};
template <typename T>
struct Ptr<T, true> {
  using type = T*;
};

// Copies n elements src -> dst (one chunk) with the whole block. See Note [16-byte accesses].
template <typename S, typename D, int kMode, bool kInPlace>
__device__ void copy_chunk(typename Ptr<const typename S::T, kInPlace>::type src,
                           typename Ptr<typename D::T, kInPlace>::type dst, int n, float mul, float div) {
  constexpr int V = VecElems<S, D>::value;
  using SV = Vec<typename S::T, V>;
  using DV = Vec<typename D::T, V>;
  const int head = static_cast<int>(common_head(reinterpret_cast<uintptr_t>(src), sizeof(typename S::T),
                                                reinterpret_cast<uintptr_t>(dst), sizeof(typename D::T), n));
  const int nvec = (n - head) / V;
  const int tid = threadIdx.x;
  for (int i = tid; i < head; i += blockDim.x) dst[i] = convert<S, D, kMode>(src[i], mul, div);
  typename Ptr<const SV, kInPlace>::type vsrc = reinterpret_cast<const SV*>(src + head);
  typename Ptr<DV, kInPlace>::type vdst = reinterpret_cast<DV*>(dst + head);
  for (int base = tid; base < nvec; base += kUnroll * blockDim.x) {
    SV in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load first: kUnroll requests in flight
      const int j = base + u * blockDim.x;
      if (j < nvec) in[u] = vsrc[j];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = base + u * blockDim.x;
      if (j >= nvec) continue;
      DV out;
#pragma unroll
      for (int e = 0; e < V; ++e) out.e[e] = convert<S, D, kMode>(in[u].e[e], mul, div);
      vdst[j] = out;
    }
  }
  for (int i = head + nvec * V + tid; i < n; i += blockDim.x) dst[i] = convert<S, D, kMode>(src[i], mul, div);
}

template <typename S, typename D, int kMode, bool kInPlace = false>
__device__ __forceinline__ void copy_chunk_of(const SegmentEntry& s, int64_t start, int n, float mul, float div) {
  copy_chunk<S, D, kMode, kInPlace>(static_cast<const typename S::T*>(s.src) + start,
                                    static_cast<typename D::T*>(s.dst) + start, n, mul, div);
}

// The dtype pair is uniform over the block (one segment per block): no divergence.
template <typename S, int kMode>
__device__ __forceinline__ void dispatch_dst(const SegmentEntry& s, int64_t start, int n, float mul, float div) {
  if (s.src == s.dst) {  // an in-place scale; the plan allows that overlap only with the same dtype
    copy_chunk_of<S, S, kMode, true>(s, start, n, mul, div);
    return;
  }
  switch (static_cast<DType>(s.dst_dtype)) {
    case DType::kFloat16: copy_chunk_of<S, F16, kMode>(s, start, n, mul, div); break;
    case DType::kBFloat16: copy_chunk_of<S, BF16, kMode>(s, start, n, mul, div); break;
    default: copy_chunk_of<S, F32, kMode>(s, start, n, mul, div); break;
  }
}

// The entry whose blocks include `block`: the last one with first_block <= block.
template <typename Table>
__device__ __forceinline__ int find_segment(const Table& t, int block) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t.seg[mid].first_block <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <int kMode, typename Table>
__device__ __forceinline__ void run_block(const Table& table, float mul, float div) {
  const SegmentEntry s = table.seg[find_segment(table, blockIdx.x)];
  const int64_t start = static_cast<int64_t>(blockIdx.x - s.first_block) * kChunk;
  const int n = static_cast<int>(s.numel - start < kChunk ? s.numel - start : kChunk);
  switch (static_cast<DType>(s.src_dtype)) {
    case DType::kFloat16: dispatch_dst<F16, kMode>(s, start, n, mul, div); break;
    case DType::kBFloat16: dispatch_dst<BF16, kMode>(s, start, n, mul, div); break;
    default: dispatch_dst<F32, kMode>(s, start, n, mul, div); break;
  }
}

// __grid_constant__ needs sm_70+, which every build with the large table targets (Note [Pack chunk table]).
#ifdef NCCLAVG_PACK_LARGE_TABLE
#define NCCLAVG_TABLE_PARAM const __grid_constant__
#else
#define NCCLAVG_TABLE_PARAM const
#endif

template <int kMode, int kCapacity>
__global__ void __launch_bounds__(kThreads) pack_kernel(NCCLAVG_TABLE_PARAM SegmentTable<kCapacity> table, float mul,
                                                        float div) {
  run_block<kMode>(table, mul, div);
}

template <typename Table>
void launch(const Table& table, unsigned blocks, float mul, float div, cudaStream_t st) {
  constexpr int kCap = Table::kSize;
  switch (ew::pack_mode(mul, div)) {
    case ew::kPackCopy: pack_kernel<ew::kPackCopy, kCap><<<blocks, kThreads, 0, st>>>(table, mul, div); break;
    case ew::kPackMul: pack_kernel<ew::kPackMul, kCap><<<blocks, kThreads, 0, st>>>(table, mul, div); break;
    case ew::kPackDiv: pack_kernel<ew::kPackDiv, kCap><<<blocks, kThreads, 0, st>>>(table, mul, div); break;
    default: pack_kernel<ew::kPackMulDiv, kCap><<<blocks, kThreads, 0, st>>>(table, mul, div); break;
  }
  NCCLAVG_CUDA_CHECK_LAUNCH();
}

#ifdef NCCLAVG_PACK_LARGE_TABLE
// Whether `device` takes the large table: CUDA 12.1+ driver and compute capability 7.0+.
bool large_table_allowed(int device) {
  int driver = 0, major = 0;
  NCCLAVG_CUDA_CHECK(cudaDriverGetVersion(&driver));
  NCCLAVG_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return driver >= 12010 && major >= 7;
}
#endif

int64_t chunks_of(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Fills tables of Table's size and launches each when full (see Note [Pack chunk table]).
template <typename Table>
void launch_tables(const std::vector<CopySegment>& segs, float mul, float div, cudaStream_t st) {
  constexpr int64_t kMaxBlocks = 0x7fffffff;  // gridDim.x, and first_block is an int32
  Table table{};
  int64_t blocks = 0;
  for (const CopySegment& s : segs) {
    if (s.numel == 0) continue;
    if (table.count == Table::kSize || blocks + chunks_of(s.numel) > kMaxBlocks) {
      launch(table, static_cast<unsigned>(blocks), mul, div, st);
      table.count = 0;
      blocks = 0;
    }
    table.seg[table.count++] = {reinterpret_cast<const void*>(s.src), reinterpret_cast<void*>(s.dst), s.numel,
                                static_cast<int32_t>(blocks), static_cast<int16_t>(s.src_dtype),
                                static_cast<int16_t>(s.dst_dtype)};
    blocks += chunks_of(s.numel);
  }
  if (table.count > 0) launch(table, static_cast<unsigned>(blocks), mul, div, st);
}

}  // namespace

void run_segments(const std::vector<CopySegment>& segs, float mul, float div, int device, uintptr_t stream) {
  int64_t live = 0;
  for (const CopySegment& s : segs) {
    NCCLAVG_CHECK_ARG(chunks_of(s.numel) <= 0x7fffffff, "srcs", "a tensor of ", s.numel,
                      " elements is too large for one launch");
    live += s.numel > 0;
  }
  DeviceGuard guard(device);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
#ifdef NCCLAVG_PACK_LARGE_TABLE
  if (live > kSmallSegments && large_table_allowed(device)) {
    launch_tables<SegmentTable<kLargeSegments>>(segs, mul, div, st);
    return;
  }
#endif
  launch_tables<SegmentTable<kSmallSegments>>(segs, mul, div, st);
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
