// Pack/unpack through the real entry points (cuda::pack / cuda::unpack -> run_segments -> the chunk-table
// kernel), against the CPU path: the same plan (plan_pack / plan_unpack) and the scalar CPU kernel.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <exception>
#include <random>
#include <sstream>

#include "../../common/pack_plan.h"
#include "../../cpu/pack.h"
#include "../pack_cuda.h"
#include "harness.h"

namespace emu_harness {
namespace {

using ncclavg::Buffer;
using ncclavg::dtype_size;

constexpr int64_t kChunk = 8192;          // pack_kernel.cu's elements per block
constexpr int64_t kSmallSegments = 120;   // its segments per launch in a 4 KiB parameter block
constexpr int64_t kLargeSegments = 1020;  // and in a large one (32,764 bytes)

// The launches the entry points should make for `nsegs` non-empty segments on the emulated system:
// See Note [Pack chunk table] (one small table when it holds them all, else large tables where the
// driver and device allow them, else one small table per 120).
int64_t expected_launches(size_t nsegs) {
  const ncclavg_emu::EmulatedSystem& sys = ncclavg_emu::emulated_system();
  const bool large = static_cast<int64_t>(nsegs) > kSmallSegments && sys.driver_version >= 12010 && sys.cc_major >= 7;
  const int64_t per = large ? kLargeSegments : kSmallSegments;
  return (static_cast<int64_t>(nsegs) + per - 1) / per;
}

struct TensorSpec {
  DType dtype;
  int64_t numel;
  size_t misalign;  // elements past a 256-byte boundary (separate tensors)
  int64_t offset;   // slot in the bucket, in elements
  bool alias;       // the tensor IS its bucket slot (a view): an in-place scale
};

struct PackCase {
  std::string label;
  bool unpack = false;
  DType bucket_dtype = DType::kFloat32;
  int64_t bucket_numel = 0;
  size_t bucket_misalign = 0;
  std::vector<TensorSpec> tensors;
  float mul = 1.0f, div = 1.0f;
};

struct Instance {
  Arena arena;
  Buffer bucket;
  std::vector<Buffer> tensors;
  std::vector<int64_t> offsets;
};

// Lays the case out in fresh guarded memory and fills it; `device` -1 for the reference.
void instantiate(const PackCase& c, uint64_t seed, int device, Instance& in) {
  const size_t bs = dtype_size(c.bucket_dtype);
  Guarded& b = in.arena.add(c.bucket_numel * bs, c.bucket_misalign * bs);
  fill(c.bucket_dtype, b.data(), c.bucket_numel, seed);
  in.bucket = Buffer{reinterpret_cast<uintptr_t>(b.data()), c.bucket_numel, c.bucket_dtype, device, false};
  for (size_t k = 0; k < c.tensors.size(); ++k) {
    const TensorSpec& t = c.tensors[k];
    uintptr_t ptr;
    if (t.alias) {
      ptr = in.bucket.ptr + static_cast<uintptr_t>(t.offset) * bs;
    } else {
      Guarded& g = in.arena.add(t.numel * dtype_size(t.dtype), t.misalign * dtype_size(t.dtype));
      fill(t.dtype, g.data(), t.numel, seed * 1000 + k + 1);
      ptr = reinterpret_cast<uintptr_t>(g.data());
    }
    in.tensors.push_back(Buffer{ptr, t.numel, t.alias ? c.bucket_dtype : t.dtype, device, false});
    in.offsets.push_back(t.offset);
  }
}

// The CPU path without its OpenMP split: the plan, then the scalar kernel on each segment.
size_t run_reference(const PackCase& c, Instance& in) {
  const std::vector<ncclavg::CopySegment> segs =
      c.unpack ? ncclavg::plan_unpack(in.bucket, in.tensors, in.offsets, c.mul, c.div)
               : ncclavg::plan_pack(in.tensors, in.bucket, in.offsets, c.mul, c.div);
  for (const ncclavg::CopySegment& s : segs) {
    ncclavg::cpu::kScalarPackKernels.convert(reinterpret_cast<const void*>(s.src), s.src_dtype,
                                             reinterpret_cast<void*>(s.dst), s.dst_dtype, s.numel, c.mul, c.div, nullptr);
  }
  return segs.size();
}

// Every buffer of `got` against `want` (the reference) and against `first` (the first thread order).
bool compare_instances(const PackCase& c, const Instance& got, const Instance& want, const Instance* first,
                       const std::string& where, Tally& t) {
  const size_t n = got.arena.bufs.size();
  for (size_t k = 0; k < n; ++k) {
    const Guarded& g = *got.arena.bufs[k];
    // Buffer 0 is the bucket; the others are the separate (non-alias) tensors in order.
    DType dt = c.bucket_dtype;
    for (size_t j = 0, seen = 0; k > 0 && j < c.tensors.size(); ++j) {
      if (!c.tensors[j].alias && ++seen == k) dt = c.tensors[j].dtype;
    }
    const int64_t numel = static_cast<int64_t>(g.size() / dtype_size(dt));
    int64_t nan_diffs = 0;
    const int64_t bad = compare(dt, g.data(), want.arena.bufs[k]->data(), numel, t, &nan_diffs);
    t.nan_payload += nan_diffs;
    if (bad >= 0) {
      std::ostringstream os;
      os << "MISMATCH " << where << " buffer " << k << " (" << (k == 0 ? "bucket" : "tensor") << ", "
         << ncclavg::dtype_name(dt) << ") element " << bad << ": emulated " << describe_elem(dt, g.data(), bad)
         << ", CPU " << describe_elem(dt, want.arena.bufs[k]->data(), bad);
      t.fail(os.str());
      return false;
    }
    if (first && !same_bytes(g.data(), first->arena.bufs[k]->data(), g.size())) {
      t.fail("ORDER DEPENDENCE " + where + ": buffer " + std::to_string(k) + " differs from the forward order");
      return false;
    }
  }
  return true;
}

void run_case(const PackCase& c, uint64_t seed, Tally& t) {
  ++t.cases;
  Instance ref;
  instantiate(c, seed, ncclavg::kCpuDevice, ref);
  size_t nsegs = 0;
  try {
    nsegs = run_reference(c, ref);
  } catch (const std::exception& e) {
    t.fail("BAD CASE " + c.label + ": the CPU plan refused it: " + e.what());
    return;
  }
  const int64_t want_launches = expected_launches(nsegs);
  const int device = static_cast<int>(seed % ncclavg_emu::kDeviceCount);
  const uintptr_t stream = 0x5000 + 16 * (seed % 4096);  // an opaque handle, as the binding passes it
  std::unique_ptr<Instance> first;
  for (ncclavg_emu::Order order : kOrders) {
    auto in = std::make_unique<Instance>();
    instantiate(c, seed, device, *in);
    const std::string where = c.label + " [" + ncclavg_emu::order_name(order) + "]";
    const int before = (device + 1) % ncclavg_emu::kDeviceCount;  // the guard must restore it
    cudaSetDevice(before);
    ncclavg_emu::set_order(order, seed);
    const bool ok = run_checked(where, want_launches, device, stream, t, [&] {
      if (c.unpack) {
        ncclavg::cuda::unpack(in->bucket, in->tensors, in->offsets, c.mul, c.div, stream);
      } else {
        ncclavg::cuda::pack(in->tensors, in->bucket, in->offsets, c.mul, c.div, stream);
      }
    });
    if (!ok) return;
    int now = -1;
    cudaGetDevice(&now);
    if (now != before) {
      t.fail("DEVICE " + where + ": the current device was not restored");
      return;
    }
    if (!compare_instances(c, *in, ref, first.get(), where, t)) return;
    if (!first) first = std::move(in);
  }
}

// Tensors laid out one after another in the bucket; every slot starts `slot_mis` elements past a
// vector boundary of the bucket (whose own base is 256-byte aligned).
PackCase sequence(const std::string& label, bool unpack, DType bdt, DType tdt, const std::vector<int64_t>& sizes,
                  size_t tensor_mis, size_t slot_mis, float mul, float div) {
  PackCase c;
  c.label = label;
  c.unpack = unpack;
  c.bucket_dtype = bdt;
  const int64_t step = vec_elems(bdt);
  int64_t off = 0;
  for (int64_t n : sizes) {
    off = (off + step - 1) / step * step + static_cast<int64_t>(slot_mis);
    c.tensors.push_back(TensorSpec{tdt, n, tensor_mis, off, false});
    off += n;
  }
  c.bucket_numel = off + 3;  // a few bucket elements no slot covers: they must stay as they were
  c.mul = mul;
  c.div = div;
  return c;
}

constexpr float kMuls[4] = {1.0f, 0.37f, 1.0f, 2.5f};  // indexed by mode: copy, mul, div, mul+div
constexpr float kDivs[4] = {1.0f, 1.0f, 3.0f, 7.0f};

std::string pair_label(const char* what, DType s, DType d, size_t ms, size_t md, int mode) {
  std::ostringstream os;
  os << what << " " << ncclavg::dtype_name(s) << "->" << ncclavg::dtype_name(d) << " src+" << ms << " dst+" << md
     << " mode " << mode;
  return os.str();
}

}  // namespace

void check_pack(Tally& t, bool quick) {
  uint64_t seed = 1;
  // 1. Every misalignment of source and destination (0 .. vector width - 1 elements) of every dtype pair
  //    and both directions, at sizes around the vector width; the scale mode rotates over the grid.
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      const int v = vec_elems(s, d);
      const std::vector<int64_t> sizes = {1, v - 1, v, v + 1, 2 * v + 1, 3 * v, 4 * v + 3, 37 * v + 5};
      for (int ms = 0; ms < v; ++ms) {
        for (int md = 0; md < v; ++md) {
          if (quick && ms != md && ms != 0 && md != 0) continue;
          const int mode = (ms * v + md) % 4;
          // pack: tensor (s) -> slot (d); unpack: slot (s) -> tensor (d)
          run_case(sequence(pair_label("pack", s, d, ms, md, mode), false, d, s, sizes, ms, md, kMuls[mode],
                            kDivs[mode]),
                   seed++, t);
          const int umode = (mode + 1) % 4;
          run_case(sequence(pair_label("unpack", s, d, ms, md, umode), true, s, d, sizes, md, ms, kMuls[umode],
                            kDivs[umode]),
                   seed++, t);
        }
      }
    }
  }
  // 2. Chunk boundaries: a segment of kChunk +- 1 elements spans one or two blocks.
  const std::vector<int64_t> big = {kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 9, 3 * kChunk - 3};
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      const int v = vec_elems(s, d);
      const size_t mis[4][2] = {{0, 0}, {1, 1}, {1, 0}, {static_cast<size_t>(v - 1), 2}};
      for (int m = 0; m < (quick ? 2 : 4); ++m) {
        run_case(sequence(pair_label("pack chunks", s, d, mis[m][0], mis[m][1], 3), false, d, s, big, mis[m][0],
                          mis[m][1], 0.75f, 3.0f),
                 seed++, t);
        run_case(sequence(pair_label("unpack chunks", s, d, mis[m][1], mis[m][0], 2), true, s, d, big, mis[m][0],
                          mis[m][1], 1.0f, 5.0f),
                 seed++, t);
      }
    }
  }
  // 3. More segments than one launch's table (See Note [Pack chunk table]): exactly as many as a small
  //    or a large table holds and one more, and several tables' worth, with empty tensors, mixed dtypes,
  //    random misalignments and in-place views; on a system that allows large tables, on a driver
  //    older than CUDA 12.1 and on a pre-Volta device (small tables only, and no large launch at all:
  //    the emulated driver refuses one there).
  std::mt19937_64 rng(12345);
  const ncclavg_emu::EmulatedSystem systems[] = {{13000, 9, 0}, {12000, 9, 0}, {13000, 6, 1}};
  // (A large table's launch costs the emulator a 32 KiB parameter copy per thread: the 1020 and 1021
  // counts run with fp32 buckets only.)
  const int counts[] = {120, 121, 250, 1020, 1021};
  for (const ncclavg_emu::EmulatedSystem& sys : systems) {
    ncclavg_emu::set_system(sys);
    const std::string system_label = " (driver " + std::to_string(sys.driver_version) + ", sm_" +
                                     std::to_string(sys.cc_major) + std::to_string(sys.cc_minor) + ")";
    for (int count : counts) {
      for (int dir = 0; dir < 2; ++dir) {
        for (DType bdt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          // Every bucket dtype on the default system; the others only change how many launches.
          if (bdt != DType::kFloat32 && (quick || &sys != &systems[0] || count > 250)) continue;
          // --quick: one large bucket (1021: a full large table and one more launch) on the default
          // system; the others take 121 and 250 (a large table where it would be refused).
          if (quick && (count == 1020 || (&sys != &systems[0] && count > 250))) continue;
          PackCase c;
          c.unpack = dir == 1;
          c.bucket_dtype = bdt;
          c.mul = dir == 0 ? 1.0f : 0.5f;
          c.div = 6.0f;
          c.label = std::string(c.unpack ? "unpack " : "pack ") + std::to_string(count) + " segments, bucket " +
                    ncclavg::dtype_name(bdt) + system_label;
          int64_t off = 0;
          for (int k = 0; k < count; ++k) {
            if (rng() % 9 == 0) c.tensors.push_back(TensorSpec{kDTypes[rng() % 3], 0, 0, off, false});
            // a few tensors span several chunks (about 8 per bucket); most are small
            const bool spans = k % (count / 8 + 1) == 7;
            TensorSpec ts{kDTypes[rng() % 3], 1 + static_cast<int64_t>(rng() % (spans ? 20000 : 300)),
                          static_cast<size_t>(rng() % 8), off + static_cast<int64_t>(rng() % 3), rng() % 5 == 0};
            if (ts.alias) ts.dtype = bdt;
            c.tensors.push_back(ts);
            off = ts.offset + ts.numel;
          }
          c.bucket_numel = off + 1;
          run_case(c, seed++, t);
        }
      }
    }
  }
  ncclavg_emu::set_system(ncclavg_emu::EmulatedSystem{});
  // 4. A bucket of in-place views only: scaled in place; with nothing to scale, no launch at all.
  for (DType bdt : kDTypes) {
    for (float mul : {0.25f, 1.0f}) {
      PackCase c = sequence(std::string("in-place views, bucket ") + ncclavg::dtype_name(bdt), false, bdt, bdt,
                            {1, 7, 8, 9, 100, kChunk + 3}, 0, 1, mul, mul == 1.0f ? 1.0f : 3.0f);
      for (TensorSpec& ts : c.tensors) ts.alias = true;
      run_case(c, seed++, t);
    }
  }
}

}  // namespace emu_harness
