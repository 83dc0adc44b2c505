// The emulator's own rules, checked with two small kernels: built like the kernel files (cuda_emu.h
// force-included), so these launches go through the same code as the real ones.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "harness.h"

namespace {

// Each thread writes the parameter it got, then changes its own copy: no other thread may see that.
__global__ void record_param(int v, int* out) {
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  out[b * blockDim.x * blockDim.y * blockDim.z + t] += v;
  v = -1;
  (void)v;
}

// Records the order threads ran in.
__global__ void record_order(int* out, int* next) { out[(*next)++] = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); }

// Parameters above the portable 4 KiB: allowed only on some systems (Note [Kernel parameter limit]).
struct BigParams {
  int v[2000];
};
__global__ void record_big(const __grid_constant__ BigParams p, int* out) { out[threadIdx.x] = p.v[1999 - threadIdx.x]; }

}  // namespace

namespace emu_harness {

void check_launch_rules(Tally& t) {
  using ncclavg_emu::launch_kernel;
  // Every thread of a 3-D grid runs exactly once and sees the parameter as passed, in every order.
  for (ncclavg_emu::Order o : kOrders) {
    ++t.cases;
    ncclavg_emu::set_order(o, 42);
    std::vector<int> out(2 * 3 * 4 * 2 * 3, 0);
    launch_kernel(record_param, dim3(2, 3, 1), dim3(4, 2, 3))(7, out.data());
    if (cudaGetLastError() != cudaSuccess || std::any_of(out.begin(), out.end(), [](int x) { return x != 7; })) {
      t.fail(std::string("LAUNCH RULES: a thread ran twice, never, or saw another's parameter copy [") +
             ncclavg_emu::order_name(o) + "]");
    }
  }
  // The orders differ: forward starts with thread 0, reverse ends with it, shuffled is neither.
  std::vector<int> seen[3];
  for (int k = 0; k < 3; ++k) {
    ncclavg_emu::set_order(kOrders[k], 42);
    seen[k].assign(4 * 64, -1);
    int next = 0;
    launch_kernel(record_order, 4, 64)(seen[k].data(), &next);
  }
  ++t.cases;
  if (seen[0].front() != 0 || seen[1].back() != 0 || seen[2] == seen[0] || seen[2] == seen[1]) {
    t.fail("LAUNCH RULES: the three thread orders are not forward, reverse and shuffled");
  }
  // Configurations the runtime refuses: the kernel does not run and the error sticks until read.
  struct Bad {
    dim3 grid, block;
    size_t smem;
  };
  const Bad bad[] = {{dim3(1), dim3(1025), 0},   {dim3(1), dim3(32, 32, 2), 0}, {dim3(0), dim3(32), 0},
                     {dim3(1), dim3(1, 1, 65), 0}, {dim3(1, 65536), dim3(1), 0},  {dim3(1), dim3(0), 0},
                     {dim3(1), dim3(32), 48 * 1024 + 1}};
  ncclavg_emu::set_order(ncclavg_emu::Order::kForward);
  for (const Bad& b : bad) {
    ++t.cases;
    int out[1] = {0};
    ncclavg_emu::reset_launch_log();
    launch_kernel(record_param, b.grid, b.block, b.smem)(1, out);
    const bool refused = ncclavg_emu::launch_log().refused == 1 && out[0] == 0;
    const bool sticky = cudaPeekAtLastError() != cudaSuccess && cudaPeekAtLastError() != cudaSuccess;
    const bool cleared = cudaGetLastError() != cudaSuccess && cudaGetLastError() == cudaSuccess;
    if (!refused || !sticky || !cleared) t.fail("LAUNCH RULES: a bad configuration was not refused like the runtime does");
  }
  // A parameter block above 4 KiB runs on a 12.1+ driver and an sm_70+ device, and is refused (the
  // kernel does not run, the error sticks) on an older driver or device.
  const struct {
    ncclavg_emu::EmulatedSystem sys;
    bool runs;
  } big_cases[] = {{{13000, 9, 0}, true}, {{12010, 7, 0}, true}, {{12000, 9, 0}, false}, {{13000, 6, 1}, false}};
  static BigParams big;
  for (int k = 0; k < 2000; ++k) big.v[k] = k;
  for (const auto& bc : big_cases) {
    ++t.cases;
    ncclavg_emu::set_system(bc.sys);
    ncclavg_emu::reset_launch_log();
    int out[2] = {-1, -1};
    launch_kernel(record_big, 1, 2)(big, out);
    const cudaError_t e = cudaGetLastError();
    const bool ran = out[0] == 1999 && out[1] == 1998 && e == cudaSuccess;
    const bool refused = out[0] == -1 && e == cudaErrorNotSupported && ncclavg_emu::launch_log().refused == 1;
    if (bc.runs ? !ran : !refused) {
      t.fail("LAUNCH RULES: a kernel with " + std::to_string(sizeof(BigParams)) + " bytes of parameters on driver " +
             std::to_string(bc.sys.driver_version) + ", sm_" + std::to_string(bc.sys.cc_major) +
             std::to_string(bc.sys.cc_minor) + (bc.runs ? " did not run" : " was not refused"));
    }
  }
  ncclavg_emu::set_system(ncclavg_emu::EmulatedSystem{});
  ++t.cases;
  if (cudaSetDevice(ncclavg_emu::kDeviceCount) != cudaErrorInvalidDevice || cudaGetLastError() != cudaErrorInvalidDevice) {
    t.fail("LAUNCH RULES: cudaSetDevice accepted a device that does not exist");
  }
}

}  // namespace emu_harness
