#include "simd.h"

#include <atomic>
#include <cstdlib>

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "../common/check.h"

namespace ncclavg {
namespace cpu {

const char* simd_level_name(SimdLevel l) {
  switch (l) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
    case SimdLevel::kNeon: return "neon";
    case SimdLevel::kSve: return "sve";
  }
  return "unknown";
}

const std::vector<SimdLevel>& simd_levels_of_arch() {
#if defined(__x86_64__)
  static const std::vector<SimdLevel> levels{SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512};
#elif defined(__aarch64__)
  static const std::vector<SimdLevel> levels{SimdLevel::kScalar, SimdLevel::kNeon, SimdLevel::kSve};
#else
  static const std::vector<SimdLevel> levels{SimdLevel::kScalar};
#endif
  return levels;
}

bool simd_level_supported(SimdLevel l) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  switch (l) {
    case SimdLevel::kScalar: return true;
    case SimdLevel::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case SimdLevel::kAvx512:
      return simd_level_supported(SimdLevel::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    default: return false;  // another architecture's level
  }
#elif defined(__aarch64__)
  switch (l) {
    case SimdLevel::kScalar: return true;
    case SimdLevel::kNeon: return true;  // Advanced SIMD is mandatory in ARMv8-A
    case SimdLevel::kSve: return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
    default: return false;
  }
#else
  return l == SimdLevel::kScalar;
#endif
}

SimdLevel simd_level_best_supported() {
  const std::vector<SimdLevel>& levels = simd_levels_of_arch();
  for (auto it = levels.rbegin(); it != levels.rend(); ++it) {
    if (simd_level_supported(*it)) return *it;
  }
  return SimdLevel::kScalar;
}

namespace {

const KernelTable* table_for(SimdLevel l) {
  switch (l) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return &kAvx512Kernels;
    case SimdLevel::kAvx2: return &kAvx2Kernels;
#elif defined(__aarch64__)
    case SimdLevel::kSve: return &kSveKernels;
    case SimdLevel::kNeon: return &kNeonKernels;
#endif
    default: return &kScalarKernels;
  }
}

// "auto, scalar, avx2 or avx512": the choices on this architecture.
std::string level_choices() {
  std::string out = "auto";
  const std::vector<SimdLevel>& levels = simd_levels_of_arch();
  for (size_t k = 0; k < levels.size(); ++k) {
    out += k + 1 == levels.size() ? " or " : ", ";
    out += simd_level_name(levels[k]);
  }
  return out;
}

SimdLevel parse_level(const std::string& name, const char* argname) {
  if (name == "auto" || name.empty()) return simd_level_best_supported();
  SimdLevel l = SimdLevel::kScalar;
  bool known = false;
  for (SimdLevel c : simd_levels_of_arch()) {
    if (name == simd_level_name(c)) {
      l = c;
      known = true;
    }
  }
  NCCLAVG_CHECK_ARG(known, argname, "unknown SIMD level '", name, "'; use ", level_choices());
  NCCLAVG_CHECK_ARG(simd_level_supported(l), argname, "this CPU does not support '", name,
                    "' (best supported: ", simd_level_name(simd_level_best_supported()), ")");
  return l;
}

std::atomic<const KernelTable*> g_table{nullptr};

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (t) return *t;
  const char* env = std::getenv("NCCLAVG_SIMD");
  t = table_for(parse_level(env ? env : "auto", "NCCLAVG_SIMD"));
  g_table.store(t, std::memory_order_release);
  return *t;
}

void set_simd_level(const std::string& name) {
  g_table.store(table_for(parse_level(name, "level")), std::memory_order_release);
}

SimdLevel current_simd_level() { return kernels().level; }

}  // namespace cpu
}  // namespace ncclavg
