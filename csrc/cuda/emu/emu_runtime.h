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

// Devices the emulated runtime reports (cudaSetDevice beyond them fails as on a real machine).
constexpr int kDeviceCount = 4;

}  // namespace ncclavg_emu
