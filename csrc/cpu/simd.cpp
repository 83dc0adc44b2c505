#include "simd.h"

#include <atomic>
#include <cstdlib>

#include "../common/check.h"

namespace ncclavg {
namespace cpu {

const char* simd_level_name(SimdLevel l) {
  switch (l) {
    case SimdLevel::kScalar: return "scalar";
    case SimdLevel::kAvx2: return "avx2";
    case SimdLevel::kAvx512: return "avx512";
  }
  return "unknown";
}

bool simd_level_supported(SimdLevel l) {
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
  }
  return false;
}

SimdLevel simd_level_best_supported() {
  if (simd_level_supported(SimdLevel::kAvx512)) return SimdLevel::kAvx512;
  if (simd_level_supported(SimdLevel::kAvx2)) return SimdLevel::kAvx2;
  return SimdLevel::kScalar;
}

namespace {

const KernelTable* table_for(SimdLevel l) {
  switch (l) {
    case SimdLevel::kAvx512: return &kAvx512Kernels;
    case SimdLevel::kAvx2: return &kAvx2Kernels;
    default: return &kScalarKernels;
  }
}

SimdLevel parse_level(const std::string& name, const char* argname) {
  if (name == "auto" || name.empty()) return simd_level_best_supported();
  SimdLevel l;
  if (name == "scalar") l = SimdLevel::kScalar;
  else if (name == "avx2") l = SimdLevel::kAvx2;
  else if (name == "avx512") l = SimdLevel::kAvx512;
  else NCCLAVG_CHECK_ARG(false, argname, "unknown SIMD level '", name, "'; use auto, scalar, avx2 or avx512");
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
