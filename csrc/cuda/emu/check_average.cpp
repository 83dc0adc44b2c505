// The in-place average through the real entry point (cuda::average_inplace -> launch -> average_kernel),
// against the scalar CPU kernel of ops.average_ (kScalarKernels.average) on the same inputs.
#include <cuda_runtime_api.h>

#include <exception>
#include <sstream>

#include "../../common/buffer.h"
#include "../../cpu/simd.h"
#include "../cuda_ops.h"
#include "harness.h"

namespace emu_harness {
namespace {

using ncclavg::Buffer;
using ncclavg::dtype_size;

struct AverageCase {
  DType dtype;
  int n;                         // buffers
  int64_t numel;
  std::vector<size_t> misalign;  // bytes past a 256-byte boundary, per buffer
  bool exact;                    // fill_exact inputs instead of edge values
};

std::string label_of(const AverageCase& c) {
  std::ostringstream os;
  os << "average " << ncclavg::dtype_name(c.dtype) << " n=" << c.n << " numel=" << c.numel << " misalign(bytes)="
     << c.misalign[0] << (c.misalign.size() > 1 && c.misalign[1] != c.misalign[0] ? ",mixed" : "")
     << (c.exact ? " exact" : "");
  return os.str();
}

void instantiate(const AverageCase& c, uint64_t seed, int device, Arena& a, std::vector<Buffer>& bufs) {
  const size_t es = dtype_size(c.dtype);
  for (int k = 0; k < c.n; ++k) {
    Guarded& g = a.add(c.numel * es, c.misalign[k % c.misalign.size()]);
    // Edge values in a few buffers per element position at most: one NaN among n makes the mean NaN,
    // and then nothing else about that element is tested.
    if (c.exact) {
      fill_exact(c.dtype, g.data(), c.numel, seed * 977 + k);
    } else {
      fill(c.dtype, g.data(), c.numel, seed * 977 + k, 0.6 / c.n);
    }
    bufs.push_back(Buffer{reinterpret_cast<uintptr_t>(g.data()), c.numel, c.dtype, device, false});
  }
}

void run_case(const AverageCase& c, uint64_t seed, Tally& t) {
  ++t.cases;
  const std::string label = label_of(c);
  Arena ref;
  std::vector<Buffer> ref_bufs;
  instantiate(c, seed, ncclavg::kCpuDevice, ref, ref_bufs);
  std::vector<void*> ptrs;
  for (const Buffer& b : ref_bufs) ptrs.push_back(reinterpret_cast<void*>(b.ptr));
  if (c.n > 1) ncclavg::cpu::kScalarKernels.average(ptrs.data(), c.n, c.dtype, 0, c.numel, nullptr);
  const int64_t want_launches = c.n > 1 && c.numel > 0 ? 1 : 0;
  const int device = static_cast<int>(seed % ncclavg_emu::kDeviceCount);
  const uintptr_t stream = 0x7000 + 16 * (seed % 4096);
  std::unique_ptr<Arena> first;
  for (ncclavg_emu::Order order : kOrders) {
    auto a = std::make_unique<Arena>();
    std::vector<Buffer> bufs;
    instantiate(c, seed, device, *a, bufs);
    const std::string where = label + " [" + ncclavg_emu::order_name(order) + "]";
    ncclavg_emu::set_order(order, seed);
    if (!run_checked(where, want_launches, device, stream, t,
                     [&] { ncclavg::cuda::average_inplace(bufs, stream); })) {
      return;
    }
    for (int k = 0; k < c.n; ++k) {
      int64_t nan_diffs = 0;
      const int64_t bad = compare(c.dtype, a->bufs[k]->data(), ref.bufs[k]->data(), c.numel, t, &nan_diffs);
      t.nan_payload += nan_diffs;
      if (bad >= 0) {
        t.fail("MISMATCH " + where + " buffer " + std::to_string(k) + " element " + std::to_string(bad) +
               ": emulated " + describe_elem(c.dtype, a->bufs[k]->data(), bad) + ", CPU " +
               describe_elem(c.dtype, ref.bufs[k]->data(), bad));
        return;
      }
      if (first && !same_bytes(a->bufs[k]->data(), first->bufs[k]->data(), a->bufs[k]->size())) {
        t.fail("ORDER DEPENDENCE " + where + ": buffer " + std::to_string(k) + " differs from the forward order");
        return;
      }
    }
    if (!first) first = std::move(a);
  }
}

// Expects the entry point to refuse the arguments (ArgError naming them) without launching anything.
void expect_refusal(const std::string& label, const std::vector<Buffer>& bufs, Tally& t) {
  expect_refused(label, t, [&] { ncclavg::cuda::average_inplace(bufs, 0); });
}

}  // namespace

void check_average(Tally& t, bool quick) {
  uint64_t seed = 100000;
  // 1. Every common misalignment (vector path after a head), sizes around the vector width and around
  //    the grid-stride step (kUnroll = 2 vectors per thread, 256 threads per block).
  for (DType dt : kDTypes) {
    const int v = vec_elems(dt);
    const size_t es = dtype_size(dt);
    const std::vector<int64_t> sizes = {1, v - 1, v, v + 1, 2 * v + 1, 5 * v + 3, 512 * v - 1, 512 * v + v + 1};
    for (int n : {2, 3, 4, 5, 8, 9}) {
      for (int m = 0; m < v; ++m) {
        if (quick && m > 1 && m != v - 1) continue;
        for (int64_t numel : sizes) {
          if (numel > 64 && (n > 4 || m % 3 != 0)) continue;  // the big sizes on a subset
          run_case(AverageCase{dt, n, numel, {m * es}, (n + m) % 3 == 0}, seed++, t);
        }
      }
    }
    // 2. Buffers whose addresses differ modulo 16 (no common head: element by element), and ones equal
    //    modulo 16 but not equal (a common head although the bases differ).
    for (int64_t numel : {int64_t{3}, int64_t{v + 1}, int64_t{1000}}) {
      run_case(AverageCase{dt, 3, numel, {0, es, 0}, false}, seed++, t);
      run_case(AverageCase{dt, 4, numel, {es, es + 16, es + 48, es}, false}, seed++, t);
      run_case(AverageCase{dt, 2, numel, {(v - 1) * es, 0}, true}, seed++, t);
    }
    // 3. Many buffers, up to the 256 of one parameter table.
    for (int n : {16, 31, 100, 255, 256}) {
      if (quick && n != 256 && n != 31) continue;
      run_case(AverageCase{dt, n, 3 * v + 1, {es}, false}, seed++, t);
      run_case(AverageCase{dt, n, 700, {0}, n % 2 == 0}, seed++, t);
    }
    // 4. Nothing to launch: one buffer, or no elements.
    run_case(AverageCase{dt, 1, 33, {0}, false}, seed++, t);
    run_case(AverageCase{dt, 3, 0, {0}, false}, seed++, t);
  }
  // 5. Refused before any launch: 257 buffers (more than the table holds), a buffer passed twice.
  Arena a;
  std::vector<Buffer> many;
  for (int k = 0; k < 257; ++k) {
    many.push_back(Buffer{reinterpret_cast<uintptr_t>(a.add(16, 0).data()), 4, DType::kFloat32, 0, false});
  }
  expect_refusal("257 buffers", many, t);
  expect_refusal("a buffer twice", {many[0], many[1], many[0]}, t);
}

}  // namespace emu_harness
