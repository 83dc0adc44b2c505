// What a user called when a channel collective ran: the user-level call (collective, element type,
// reduction, root, element count) that the channel puts into every round's signature, so that ranks
// which called different collectives fail with both calls named even where the bytes on the wire would
// have paired. See Note [Call signatures] in shm_calls.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ncclavg {
namespace cpu {

// One user call. `word`: collective | dtype << 8 | op << 16 | (root + 1) << 24, each an index into the
// tables below (0: none); `count`: the call's element count (in its own dtype). The default, all zero,
// is "no user call": the channel describes the wire call alone.
struct ShmCallTag {
  uint64_t word = 0;
  int64_t count = 0;

  int collective() const { return static_cast<int>(word & 0xff); }
  int dtype() const { return static_cast<int>((word >> 8) & 0xff); }
  int op() const { return static_cast<int>((word >> 16) & 0xff); }
  int root() const { return static_cast<int>((word >> 24) & kRootMask) - 1; }   // -1: none
  static constexpr uint64_t kRootMask = (uint64_t{1} << 20) - 1;
};

// The names behind the indices: Python encodes its calls with the same tables (ncclavg/transport/calls.py
// reads them from here), so that one place says what each code means.
const std::vector<std::string>& shm_collective_names();
const std::vector<std::string>& shm_dtype_names();
const std::vector<std::string>& shm_op_names();

// Checks that `tag` indexes the tables and that its root fits (the channel refuses it otherwise).
void check_call_tag(const ShmCallTag& tag, const char* argname);
// "all_reduce(MAX) of 4 int32", "broadcast of 10 uint8 from root 1", "barrier".
std::string describe_call(const ShmCallTag& tag);

}  // namespace cpu
}  // namespace ncclavg
