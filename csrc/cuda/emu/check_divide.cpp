// The in-place division of SUM-then-scale through the real entry point (cuda::divide_inplace ->
// divide_kernel), against the CPU pack kernel in its divide mode (y = x / div, Note [Pack scale modes]):
// the same correctly rounded fp32 division and one rounding to the storage type.
#include <cuda_runtime_api.h>

#include <cstring>
#include <exception>
#include <sstream>

#include "../../common/buffer.h"
#include "../../cpu/pack.h"
#include "../cuda_ops.h"
#include "harness.h"

namespace emu_harness {
namespace {

using ncclavg::Buffer;
using ncclavg::dtype_size;

// Divisors: the tower counts SUM-then-scale uses, and ones whose quotients overflow, underflow into
// subnormals or land on rounding ties.
constexpr float kDivisors[] = {3.0f, 7.0f, 2.0f, 0.1f, 1e-30f, 1e30f, 6.0f, 1.5f};

void run_case(DType dt, int64_t numel, size_t misalign, float divisor, uint64_t seed, Tally& t) {
  ++t.cases;
  std::ostringstream os;
  os << "divide " << ncclavg::dtype_name(dt) << " numel=" << numel << " misalign(bytes)=" << misalign
     << " divisor=" << divisor;
  const std::string label = os.str();
  const size_t bytes = numel * dtype_size(dt);
  Arena ref;
  Guarded& input = ref.add(bytes, misalign);
  Guarded& want = ref.add(bytes, misalign);
  fill(dt, input.data(), numel, seed);
  if (divisor == 1.0f) {
    std::memcpy(want.data(), input.data(), bytes);
  } else {
    ncclavg::cpu::kScalarPackKernels.convert(input.data(), dt, want.data(), dt, numel, 1.0f, divisor, nullptr);
  }
  const int64_t want_launches = numel > 0 && divisor != 1.0f ? 1 : 0;
  const int device = static_cast<int>(seed % ncclavg_emu::kDeviceCount);
  const uintptr_t stream = 0x9000 + 16 * (seed % 4096);
  std::unique_ptr<Arena> first;
  for (ncclavg_emu::Order order : kOrders) {
    auto a = std::make_unique<Arena>();
    Guarded& g = a->add(bytes, misalign);
    std::memcpy(g.data(), input.data(), bytes);
    const std::string where = label + " [" + ncclavg_emu::order_name(order) + "]";
    ncclavg_emu::set_order(order, seed);
    const Buffer b{reinterpret_cast<uintptr_t>(g.data()), numel, dt, device, false};
    if (!run_checked(where, want_launches, device, stream, t,
                     [&] { ncclavg::cuda::divide_inplace(b, divisor, stream); })) {
      return;
    }
    int64_t nan_diffs = 0;
    const int64_t bad = compare(dt, g.data(), want.data(), numel, t, &nan_diffs);
    t.nan_payload += nan_diffs;
    if (bad >= 0) {
      t.fail("MISMATCH " + where + " element " + std::to_string(bad) + ": emulated " +
             describe_elem(dt, g.data(), bad) + ", CPU " + describe_elem(dt, want.data(), bad) + " (input " +
             describe_elem(dt, input.data(), bad) + ")");
      return;
    }
    if (first && !same_bytes(g.data(), first->bufs[0]->data(), bytes)) {
      t.fail("ORDER DEPENDENCE " + where);
      return;
    }
    if (!first) first = std::move(a);
  }
}

void expect_refusal(const std::string& label, const Buffer& b, float divisor, Tally& t) {
  expect_refused(label, t, [&] { ncclavg::cuda::divide_inplace(b, divisor, 0); });
}

}  // namespace

void check_divide(Tally& t, bool quick) {
  uint64_t seed = 200000;
  int k = 0;
  for (DType dt : kDTypes) {
    const int v = vec_elems(dt);
    const size_t es = dtype_size(dt);
    // Around the vector width, and around the grid-stride step (kUnroll = 4 vectors x 256 threads).
    const std::vector<int64_t> sizes = {1, v - 1, v, v + 1, 2 * v + 1, 7 * v + 5, 1024 * v - 1, 1024 * v + 2 * v + 1};
    for (int m = 0; m < v; ++m) {
      for (int64_t numel : sizes) {
        if (numel > 64 && quick && m > 1) continue;
        run_case(dt, numel, m * es, kDivisors[k++ % std::size(kDivisors)], seed++, t);
      }
    }
    run_case(dt, 40, es, 1.0f, seed++, t);  // divisor 1: nothing to do, no launch
    run_case(dt, 0, 0, 3.0f, seed++, t);    // no elements: no launch
  }
  Arena a;
  const Buffer b{reinterpret_cast<uintptr_t>(a.add(64, 0).data()), 16, DType::kFloat32, 0, false};
  expect_refusal("divisor 0", b, 0.0f, t);
  expect_refusal("negative divisor", b, -2.0f, t);
  Buffer ro = b;
  ro.readonly = true;
  expect_refusal("read-only buffer", ro, 3.0f, t);
}

}  // namespace emu_harness
