// The harness's side of the grid emulator: the order threads run in, and what the launches did.
// See Note [Sequential threads are a legal schedule] in cuda_emu.h.
#pragma once
#include <cstdint>

namespace ncclavg_emu {

// Forward: blocks in order, threads in order within each. Reverse: both backwards. Shuffled: every
// (block, thread) pair of the grid in one random permutation (blocks interleaved too: without
// __syncthreads nothing keeps the threads of one block together).
enum class Order : int { kForward = 0, kReverse = 1, kShuffled = 2 };
const char* order_name(Order o);

// Applies to the launches of the calling thread from now on. `seed` picks the shuffled permutation.
void set_order(Order o, uint64_t seed = 0);

// What the launches of the calling thread did since the last reset_launch_log().
struct LaunchLog {
  int64_t launches = 0;          // kernels that ran
  int64_t refused = 0;           // launches the runtime checks refused (sticky error set)
  int64_t threads = 0;           // threads run, all launches together
  int last_device = -1;          // current device at the last launch
  uintptr_t last_stream = 0;     // stream handle of the last launch
  bool mixed_streams = false;    // launches went to more than one stream
  bool mixed_devices = false;    // ... or to more than one device
};
const LaunchLog& launch_log();
void reset_launch_log();

// What cudaDriverGetVersion and cudaDeviceGetAttribute report (every emulated device alike), and so
// which launches are allowed: see Note [Kernel parameter limit] in cuda_emu.h. Per host thread; the
// default is an H200 on a CUDA 13.0 driver.
struct EmulatedSystem {
  int driver_version = 13000;  // 1000 * major + 10 * minor, as cudaDriverGetVersion reports it
  int cc_major = 9;
  int cc_minor = 0;
};
void set_system(const EmulatedSystem& s);
const EmulatedSystem& emulated_system();

// Devices the emulated runtime reports (cudaSetDevice beyond them fails as on a real machine).
constexpr int kDeviceCount = 4;

}  // namespace ncclavg_emu
