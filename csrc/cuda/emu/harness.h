// The emulated-kernel harness: guarded buffers, inputs with every kind of special value, and the
// bit-for-bit comparison against the project's scalar CPU kernels. See docs/cuda_emulation.md.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../common/dtype.h"
#include "emu_runtime.h"

namespace emu_harness {

using ncclavg::DType;
constexpr DType kDTypes[3] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Note [Guarded buffers]
// Every buffer a kernel touches is its own allocation with poisoned bytes on both sides, and its END
// is flush against the poison (ASan tracks addressability per byte at the right end of a granule), so
// a vector access that runs one element past a tail is reported by ASan like compute-sanitizer would
// report it on the GPU. The start sits `misalign` bytes past a 256-byte boundary: the allocation
// alignment cudaMalloc gives, plus the element offsets of views. The left guard is exact only to ASan's
// 8-byte granule; kernels index upwards from their base, so the right end is the one that matters.
class Guarded {
 public:
  Guarded(size_t bytes, size_t misalign);
  ~Guarded();
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  uint8_t* raw_ = nullptr;
  size_t total_ = 0;
  uint8_t* p_ = nullptr;
  size_t bytes_ = 0;
};

// A set of buffers laid out twice the same way (one for the emulated GPU, one for the reference).
struct Arena {
  std::vector<std::unique_ptr<Guarded>> bufs;
  Guarded& add(size_t bytes, size_t misalign);
};

// Raw bits of `n` elements of `dt`, seeded: finite values over a wide exponent range, and with
// probability `special_rate` one of the edge cases of every storage type or random raw bits (see
// Note [Edge values] in harness_util.cpp).
void fill(DType dt, void* p, int64_t n, uint64_t seed, double special_rate = 0.25);

// Values whose averages are exact in every storage type (small integers times a power of two), so a
// wrong index shows up as a wrong value and not only as a rounding difference.
void fill_exact(DType dt, void* p, int64_t n, uint64_t seed);

struct Tally {
  int64_t cases = 0;
  int64_t runs = 0;          // kernel entry calls (cases x orders)
  int64_t elements = 0;      // elements compared
  int64_t failures = 0;      // cases with a mismatch, an order dependence or an exception
  int64_t nan_payload = 0;   // elements where both sides are NaN with different bits (reported, allowed)
  std::vector<std::string> messages;  // the first few failures, printed at the end
  void fail(const std::string& what);
};

// Compares the emulated result `got` with the CPU reference `want` (both of dtype `dt`): bit for bit,
// except that two NaNs with different payloads count in `nan_payload` (See Note [NaN payloads]).
// Returns the index of the first real mismatch, or -1.
int64_t compare(DType dt, const void* got, const void* want, int64_t n, Tally& tally, int64_t* nan_diffs);

// Bytes equal? (two runs of the same kernel in different thread orders must agree on every bit)
bool same_bytes(const void* a, const void* b, size_t n);

std::string describe_elem(DType dt, const void* p, int64_t i);

// The three thread orders every case runs in, with a seed for the shuffled one.
constexpr ncclavg_emu::Order kOrders[3] = {ncclavg_emu::Order::kForward, ncclavg_emu::Order::kReverse,
                                           ncclavg_emu::Order::kShuffled};

// Elements per 16-byte vector of a same-type kernel (average, divide) and of a pack from s to d.
inline int vec_elems(DType dt) { return static_cast<int>(16 / ncclavg::dtype_size(dt)); }
inline int vec_elems(DType s, DType d) {
  const size_t narrow = ncclavg::dtype_size(s) < ncclavg::dtype_size(d) ? ncclavg::dtype_size(s)
                                                                        : ncclavg::dtype_size(d);
  return static_cast<int>(16 / narrow);
}

// A call the entry point must refuse (std::invalid_argument, the core's ArgError) before any launch.
template <typename Call>
void expect_refused(const std::string& label, Tally& t, Call&& call) {
  ++t.cases;
  ncclavg_emu::reset_launch_log();
  try {
    call();
    t.fail("NOT REFUSED " + label);
  } catch (const std::invalid_argument&) {
    if (ncclavg_emu::launch_log().launches != 0) t.fail("LAUNCHED " + label + " before refusing it");
  }
}

// One entry call in the current thread order: counts the run, turns an exception into a failure, and
// checks the launch log (want_launches launches, none refused, all on `device` and `stream`). False when
// the call failed either way (the failure is in the tally).
template <typename Call>
bool run_checked(const std::string& where, int64_t want_launches, int device, uintptr_t stream, Tally& t,
                 Call&& call) {
  ncclavg_emu::reset_launch_log();
  ++t.runs;
  try {
    call();
  } catch (const std::exception& e) {
    t.fail("EXCEPTION " + where + ": " + e.what());
    return false;
  }
  const ncclavg_emu::LaunchLog& log = ncclavg_emu::launch_log();
  if (log.launches != want_launches || log.refused != 0 ||
      (log.launches > 0 && (log.last_device != device || log.last_stream != stream || log.mixed_streams ||
                            log.mixed_devices))) {
    t.fail("LAUNCHES " + where + ": " + std::to_string(log.launches) + " launches on device " +
           std::to_string(log.last_device) + ", want " + std::to_string(want_launches) + " on device " +
           std::to_string(device) + " and the given stream");
    return false;
  }
  return true;
}

// Suites: each adds its cases to the tally; `quick` keeps a representative subset.
void check_launch_rules(Tally& t);
void check_pack(Tally& t, bool quick);
void check_average(Tally& t, bool quick);
void check_divide(Tally& t, bool quick);

}  // namespace emu_harness
