// Splits an element range over OpenMP threads in cache-line-aligned slices. Small ranges run on the
// calling thread: waking the pool costs more than it saves below a few hundred KiB.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace ncclavg {
namespace cpu {

constexpr int64_t kParallelMinElements = 1 << 16;

template <class Fn>
void parallel_for_range(int64_t numel, Fn&& fn) {
  if (numel <= 0) return;
  if (numel < kParallelMinElements || omp_get_max_threads() == 1) {
    fn(int64_t{0}, numel);
    return;
  }
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    // 64 elements: one cache line of fp32 and two of 16-bit data, so no two threads share a line.
    const int64_t chunk = ((numel + nt - 1) / nt + 63) / 64 * 64;
    const int64_t b = std::min(numel, t * chunk);
    const int64_t e = std::min(numel, b + chunk);
    if (b < e) fn(b, e);
  }
}

}  // namespace cpu
}  // namespace ncclavg
