// Runs the emulated CUDA kernels against the CPU kernels: `emu_harness [--quick] [suite...]` with suites
// launch, pack, average, divide (all by default). Prints one line per suite and a RESULT line; exits 1
// on any failure. Sanitizer reports abort the process (-fno-sanitize-recover=all).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "harness.h"

int main(int argc, char** argv) {
  using namespace emu_harness;
  bool quick = false;
  bool want[4] = {false, false, false, false};
  bool any = false;
  const char* names[4] = {"launch", "pack", "average", "divide"};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
      continue;
    }
    bool known = false;
    for (int s = 0; s < 4; ++s) {
      if (std::strcmp(argv[i], names[s]) == 0) want[s] = known = any = true;
    }
    if (!known) {
      std::fprintf(stderr, "usage: %s [--quick] [launch|pack|average|divide ...]\n", argv[0]);
      return 2;
    }
  }
  Tally total;
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < 4; ++s) {
    if (any && !want[s]) continue;
    Tally t;
    const auto s0 = std::chrono::steady_clock::now();
    switch (s) {
      case 0: check_launch_rules(t); break;
      case 1: check_pack(t, quick); break;
      case 2: check_average(t, quick); break;
      case 3: check_divide(t, quick); break;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
    std::printf("%-8s cases=%lld runs=%lld elements=%lld failures=%lld nan_payload_diffs=%lld time=%.1fs\n", names[s],
                static_cast<long long>(t.cases), static_cast<long long>(t.runs), static_cast<long long>(t.elements),
                static_cast<long long>(t.failures), static_cast<long long>(t.nan_payload), secs);
    for (const std::string& m : t.messages) std::printf("  %s\n", m.c_str());
    total.cases += t.cases;
    total.runs += t.runs;
    total.elements += t.elements;
    total.failures += t.failures;
    total.nan_payload += t.nan_payload;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("RESULT: %s cases=%lld runs=%lld elements=%lld failures=%lld nan_payload_diffs=%lld time=%.1fs\n",
              total.failures == 0 ? "ok" : "FAIL", static_cast<long long>(total.cases),
              static_cast<long long>(total.runs), static_cast<long long>(total.elements),
              static_cast<long long>(total.failures), static_cast<long long>(total.nan_payload), secs);
  std::fflush(stdout);
  return total.failures == 0 ? 0 : 1;
}
