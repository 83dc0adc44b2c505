// The shared-memory channel's segment and the processes around it: an anonymous memory file (memfd)
// that no name in /dev/shm ever points at, handed from rank 0 to the other ranks through a unix socket
// (SCM_RIGHTS), and a test of whether a peer process still runs that a reused pid cannot fool.
// See Note [Segment without a name] in shm_segment.cpp.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace ncclavg {
namespace cpu {

// The largest slot a channel accepts: 256 MiB (the default is 1 MiB; more buys nothing but memory).
constexpr int64_t kShmMaxSlotBytes = int64_t{256} << 20;

// What a rank asks rank 0's door for; the door answers only a request that matches its channel.
struct ShmDoorRequest {
  uint64_t magic;
  uint64_t nonce;
  int32_t rank;
  int32_t nranks;
  int64_t slot_bytes;
};

// The process start time (clock ticks since boot, /proc/<pid>/stat field 22), 0 when unknown. A pid and
// its start time name one process for the life of the machine: a reused pid has a later start.
uint64_t process_start_ticks(int pid);
// True when process `pid` started at `start_ticks` (0: unknown) no longer runs: gone, a zombie, or the
// pid now belongs to another process.
bool process_gone(int pid, uint64_t start_ticks);

// Checked size arithmetic of a segment: throws ArgError naming slot_bytes when the product overflows or
// the segment would not fit in half of this machine's memory.
size_t checked_segment_bytes(size_t data_offset, int nranks, int64_t slot_bytes);

// An anonymous shared-memory file of `bytes` bytes (sparse until reserve()).
int create_memory_file(size_t bytes);
// Allocates [offset, offset + bytes) of the file now, from the calling process (so on its NUMA node),
// so that a lack of memory fails here with a message and not with SIGBUS later.
void reserve_memory(int fd, size_t offset, size_t bytes, const std::string& what);

// Rank 0's door: a listening unix socket in the abstract namespace (it vanishes with its last
// descriptor, so a crash leaves nothing behind) through which a serving thread hands the segment's
// descriptor to each other rank once: same user only, matching nonce and shape, each rank once.
class ShmDoor {
 public:
  ShmDoor(const std::string& name, int fd, const ShmDoorRequest& expected);
  ~ShmDoor();
  ShmDoor(const ShmDoor&) = delete;
  ShmDoor& operator=(const ShmDoor&) = delete;
  // Stops serving and closes the socket and this process's descriptor of the file (the mapping stays).
  void close();

 private:
  void serve();
  void answer(int conn);
  void close_fds();

  int listen_fd_ = -1;
  int fd_ = -1;
  ShmDoorRequest expected_;
  std::vector<char> served_;   // per rank: its descriptor was handed out
  int remaining_;
  int owner_pid_;   // the process whose thread serves
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A rank other than 0: asks the door `name` for the segment's descriptor (waits at most timeout_s for
// the answer). Throws std::runtime_error when nobody listens there or the door refuses.
int receive_memory_file(const std::string& name, const ShmDoorRequest& request, double timeout_s);

// Checks a channel name: 1 to 100 printable characters (it becomes an abstract socket address).
void check_channel_name(const std::string& name);

}  // namespace cpu
}  // namespace ncclavg
