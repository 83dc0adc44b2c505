// Note [Segment without a name]
// A POSIX shm segment has a name in /dev/shm from its creation until someone unlinks it. A rank 0 killed
// in between (SIGKILL during setup) leaves it there, and a later job that cleans up names "of dead
// processes" must judge liveness by pid, which is wrong across pid namespaces (containers sharing
// /dev/shm) and after pid reuse: it can delete a live job's segment. So the segment has no name at all:
// rank 0 creates an anonymous memory file (memfd_create), and the other ranks receive its descriptor
// over a unix socket (SCM_RIGHTS). The socket lives in the abstract namespace, which the kernel removes
// with the socket's last descriptor, a crash included; nothing is ever left to clean up. The memory is
// freed when the last rank unmaps it. (Processes of one host share the network namespace, and so the
// abstract socket namespace: see Note [When the shared-memory channel is used] in shm.py.)
// The door answers only the user that created it (SO_PEERCRED), only requests carrying the channel's
// 64-bit random nonce and shape, and each rank once; it closes when every rank has its descriptor, or
// when the creator says so. memfd memory is not limited by the size of /dev/shm (a container's 64 MiB),
// only by the memory of the machine (and the cgroup), which checked_segment_bytes bounds.
#include "shm_segment.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "../common/check.h"

namespace ncclavg {
namespace cpu {

namespace {
constexpr int kAnswerMs = 5000;   // a connected rank sends its request at once; never wait longer

struct DoorAnswer {
  int32_t ok;
  char message[252];
};

// Reads /proc/<pid>/stat: its state letter and start time; false when the file cannot be read.
bool read_stat(int pid, char* state, uint64_t* start_ticks) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return false;
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');   // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  std::istringstream rest(text.substr(paren + 2));
  std::string field;
  rest >> *state;
  // fields 4 .. 21 (ppid ... itrealvalue), then 22: starttime
  for (int i = 4; i <= 21 && rest >> field; ++i) {
  }
  uint64_t start = 0;
  if (!(rest >> start)) return false;
  *start_ticks = start;
  return true;
}

sockaddr_un door_address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::string path = "ncclavg/" + name;   // abstract: sun_path[0] stays '\0'
  std::memcpy(a.sun_path + 1, path.data(), path.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + path.size());
  return a;
}

// Sends or receives exactly n bytes, waiting at most ms for each part; false on error, end or timeout.
bool transfer(int fd, void* buf, size_t n, bool sending, int ms) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pf{fd, static_cast<short>(sending ? POLLOUT : POLLIN), 0};
    if (poll(&pf, 1, ms) <= 0) return false;
    const ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

std::string errno_text(const char* call) { return std::string(call) + ": " + std::strerror(errno); }
}  // namespace

void check_channel_name(const std::string& name) {
  bool printable = !name.empty() && name.size() <= 100;
  for (char c : name) printable = printable && c > ' ' && c < 127;
  NCCLAVG_CHECK_ARG(printable, "name", "must be 1 to 100 printable characters without spaces, got '", name, "'");
}

uint64_t process_start_ticks(int pid) {
  char state = 0;
  uint64_t start = 0;
  return read_stat(pid, &state, &start) ? start : 0;
}

bool process_gone(int pid, uint64_t start_ticks) {
  if (pid <= 0) return false;
  char state = 0;
  uint64_t start = 0;
  if (!read_stat(pid, &state, &start)) {   // no /proc entry: gone, unless /proc cannot tell
    if (kill(pid, 0) != 0) return errno == ESRCH;
    return false;
  }
  if (state == 'Z' || state == 'X') return true;
  return start_ticks != 0 && start != start_ticks;   // the pid was reused by a later process
}

size_t checked_segment_bytes(size_t data_offset, int nranks, int64_t slot_bytes) {
  size_t slots = 0, total = 0;
  const bool overflow = __builtin_mul_overflow(static_cast<size_t>(nranks) * 2, static_cast<size_t>(slot_bytes), &slots) ||
                        __builtin_add_overflow(slots, data_offset, &total);
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  const double half_memory = pages > 0 && page > 0 ? 0.5 * static_cast<double>(pages) * static_cast<double>(page) : 1e300;
  NCCLAVG_CHECK_ARG(!overflow && static_cast<double>(total) <= half_memory, "slot_bytes",
                    "a segment of 2 x ", nranks, " ranks x ", slot_bytes,
                    " bytes does not fit in half of this machine's memory (", half_memory / double(1 << 20), " MiB)");
  return total;
}

int create_memory_file(size_t bytes) {
  const int fd = memfd_create("ncclavg-shm-channel", MFD_CLOEXEC);
  if (fd < 0) throw std::runtime_error("shared-memory channel: " + errno_text("memfd_create"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string why = errno_text("ftruncate");
    ::close(fd);
    throw std::runtime_error("shared-memory channel: " + why);
  }
  return fd;
}

void reserve_memory(int fd, size_t offset, size_t bytes, const std::string& what) {
  const int err = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  if (err != 0) {
    throw std::runtime_error("shared-memory channel: cannot reserve " + std::to_string(bytes) + " bytes for " +
                             what + ": " + std::strerror(err) + " (is memory, or the cgroup's limit, short?)");
  }
}

ShmDoor::ShmDoor(const std::string& name, int fd, const ShmDoorRequest& expected)
    : fd_(fd), expected_(expected), served_(static_cast<size_t>(expected.nranks), 0),
      remaining_(expected.nranks - 1), owner_pid_(getpid()) {
  check_channel_name(name);
  listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw std::runtime_error("shared-memory channel: " + errno_text("socket"));
  socklen_t len = 0;
  const sockaddr_un addr = door_address(name, &len);
  if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || listen(listen_fd_, 64) != 0) {
    const std::string why = errno_text("bind/listen");
    ::close(listen_fd_);
    listen_fd_ = -1;
    throw std::runtime_error("shared-memory channel '" + name + "': cannot open its door (" + why +
                             "; a name in use belongs to another channel)");
  }
  if (remaining_ > 0) thread_ = std::thread([this] { serve(); });
}

ShmDoor::~ShmDoor() { close(); }

void ShmDoor::close() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) {
    if (getpid() == owner_pid_) {
      thread_.join();
    } else {   // a forked child has a copy of this object but not the thread: leave the handle alone
      new std::thread(std::move(thread_));   // never destroyed: destroying it would std::terminate
    }
  }
  close_fds();
}

void ShmDoor::close_fds() {
  if (listen_fd_ >= 0) ::close(listen_fd_);   // the abstract name goes with it
  if (fd_ >= 0) ::close(fd_);
  listen_fd_ = fd_ = -1;
}

void ShmDoor::serve() {
  while (remaining_ > 0 && !stop_.load(std::memory_order_acquire)) {
    pollfd pf{listen_fd_, POLLIN, 0};
    if (poll(&pf, 1, 50) <= 0) continue;   // 50 ms: how soon close() is obeyed
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    answer(conn);
    ::close(conn);
  }
  close_fds();   // every rank has joined (or close() asked): nobody may come in any more
}

void ShmDoor::answer(int conn) {
  ShmDoorRequest req{};
  DoorAnswer ans{};
  ucred cred{};
  socklen_t clen = sizeof(cred);
  std::string refusal;
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
    refusal = "its credentials cannot be read";
  } else if (cred.uid != geteuid()) {
    refusal = "it belongs to user " + std::to_string(geteuid()) + ", not to user " + std::to_string(cred.uid);
  }
  if (!transfer(conn, &req, sizeof(req), false, kAnswerMs)) return;   // a caller that went away
  if (refusal.empty()) {
    if (req.magic != expected_.magic || req.nonce != expected_.nonce) {
      refusal = "the request does not carry this channel's nonce";
    } else if (req.nranks != expected_.nranks || req.slot_bytes != expected_.slot_bytes) {
      refusal = "the request is for " + std::to_string(req.nranks) + " ranks and slots of " +
                std::to_string(req.slot_bytes) + " bytes, the channel has " + std::to_string(expected_.nranks) +
                " and " + std::to_string(expected_.slot_bytes);
    } else if (req.rank < 1 || req.rank >= expected_.nranks) {
      refusal = "rank " + std::to_string(req.rank) + " is not one of the ranks that join (1 .. " +
                std::to_string(expected_.nranks - 1) + ")";
    } else if (served_[req.rank]) {
      refusal = "rank " + std::to_string(req.rank) + " has joined already (pid " + std::to_string(cred.pid) +
                " asked again)";
    }
  }
  ans.ok = refusal.empty();
  std::strncpy(ans.message, refusal.c_str(), sizeof(ans.message) - 1);
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&ans, sizeof(ans)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (ans.ok) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd_, sizeof(int));
  }
  pollfd pf{conn, POLLOUT, 0};
  if (poll(&pf, 1, kAnswerMs) <= 0 || sendmsg(conn, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(ans))) return;
  if (ans.ok) {
    served_[req.rank] = 1;
    --remaining_;
  }
}

int receive_memory_file(const std::string& name, const ShmDoorRequest& request, double timeout_s) {
  check_channel_name(name);
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) throw std::runtime_error("shared-memory channel: " + errno_text("socket"));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{s};
  socklen_t len = 0;
  const sockaddr_un addr = door_address(name, &len);
  if (connect(s, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    throw std::runtime_error("shared-memory channel '" + name + "': no door is open there (" + errno_text("connect") +
                             "): rank 0 has not created the channel yet, or every rank has joined, or it ended");
  }
  const int ms = static_cast<int>(std::min(timeout_s, 3600.0) * 1000.0);
  ShmDoorRequest req = request;
  DoorAnswer ans{};
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{&ans, sizeof(ans)};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  pollfd pf{s, POLLIN, 0};
  if (!transfer(s, &req, sizeof(req), true, ms) || poll(&pf, 1, ms) <= 0) {
    throw std::runtime_error("shared-memory channel '" + name + "': rank 0's door did not answer within " +
                             std::to_string(timeout_s) + " s");
  }
  const ssize_t got = recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  }
  if (got != static_cast<ssize_t>(sizeof(ans)) || !ans.ok || fd < 0) {
    if (fd >= 0) ::close(fd);
    ans.message[sizeof(ans.message) - 1] = '\0';
    throw std::runtime_error("shared-memory channel '" + name + "': rank 0 refused rank " + std::to_string(request.rank) +
                             ": " + (got == static_cast<ssize_t>(sizeof(ans)) ? ans.message : "no answer"));
  }
  return fd;
}

}  // namespace cpu
}  // namespace ncclavg
