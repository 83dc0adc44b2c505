// The native SIMD harness: every CPU kernel family at the SIMD level in use (NCCLAVG_SIMD, else the best
// the CPU supports) against the scalar level, bit for bit, and against a float64 reference, over sizes
// that reach every tail, for float32, float16 and bfloat16, with infs and NaNs. No Python: it runs under
// qemu-aarch64 as well as natively (tests/test_native_simd.py builds and runs it).
//
//   harness [--quick]      prints the levels, one line per family, and
//                          RESULT: ok|FAIL level=L cases=N checks=N failures=N; exit 0 when ok
//   harness --info         only the levels: supported, the best, the one chosen
// Exit 1: a check failed; 3: the level could not be chosen (its message is printed as ERROR: ...).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "cpu/simd.h"
#include "harness.h"

#if defined(__aarch64__)
#include <sys/prctl.h>
#endif

namespace harness {
Tally& tally() {
  static Tally t;
  return t;
}
}  // namespace harness

int main(int argc, char** argv) {
  using namespace ncclavg::cpu;
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool info = argc > 1 && std::strcmp(argv[1], "--info") == 0;
  std::string supported;
  for (SimdLevel l : simd_levels_of_arch()) {
    if (simd_level_supported(l)) supported += std::string(supported.empty() ? "" : " ") + simd_level_name(l);
  }
  std::printf("supported: %s\nbest: %s\n", supported.c_str(), simd_level_name(simd_level_best_supported()));
  SimdLevel level;
  try {
    level = current_simd_level();
  } catch (const std::exception& e) {
    std::printf("ERROR: %s\n", e.what());
    return 3;
  }
  std::printf("level: %s\n", simd_level_name(level));
#if defined(__aarch64__) && defined(PR_SVE_GET_VL)
  if (level == SimdLevel::kSve) std::printf("sve vector bits: %d\n", (prctl(PR_SVE_GET_VL) & PR_SVE_VL_LEN_MASK) * 8);
#endif
  if (info) return 0;
  struct Family {
    const char* name;
    void (*run)(bool);
  };
  const Family families[] = {{"average+sum", harness::check_average_and_sum},
                             {"pack", harness::check_pack},
                             {"optim", harness::check_optim}};
  for (const Family& f : families) {
    const harness::Tally before = harness::tally();
    const auto t0 = std::chrono::steady_clock::now();
    f.run(quick);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const harness::Tally& t = harness::tally();
    std::printf("%-12s cases=%lld checks=%lld failures=%lld seconds=%.1f\n", f.name,
                static_cast<long long>(t.cases - before.cases), static_cast<long long>(t.checks - before.checks),
                static_cast<long long>(t.failures - before.failures), secs);
  }
  const harness::Tally& t = harness::tally();
  std::printf("RESULT: %s level=%s cases=%lld checks=%lld failures=%lld\n", t.failures ? "FAIL" : "ok",
              simd_level_name(level), static_cast<long long>(t.cases), static_cast<long long>(t.checks),
              static_cast<long long>(t.failures));
  return t.failures ? 1 : 0;
}
