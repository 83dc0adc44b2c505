// The host-logic harness: NcclComm (csrc/cuda/comm*.cpp) driven over the emulated CUDA runtime and the
// stand-in NCCL. `emu_host --list` names the scenarios, `emu_host <scenario>` runs one (exit 0: PASS).
// Each scenario runs in its own process, so faults chosen by environment variables apply to it alone
// and a scenario that leaves a frozen peer behind cannot disturb the next one.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../common/buffer.h"
#include "../../common/check.h"
#include "../comm.h"

namespace emu_host {

using ncclavg::Buffer;
using ncclavg::DType;
using ncclavg::nccl::NcclComm;

// Prints "FAIL <scenario>: <why>" and ends the process at once: unwinding would run the destructors
// of communicators whose peers a fault froze, which wait out their timeouts before the result shows.
[[noreturn]] void fail_now(const std::string& why);

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  fail_now(os.str());
}

#define EXPECT(cond, ...)                                                                       \
  do {                                                                                          \
    if (!(cond)) ::emu_host::fail(__FILE__, ":", __LINE__, ": expected ", #cond, ": ", ##__VA_ARGS__); \
  } while (0)

// Runs f, which must throw E whose message contains every one of `words`; returns the message.
template <typename E>
std::string expect_throw(const std::function<void()>& f, const std::vector<std::string>& words, const char* where) {
  try {
    f();
  } catch (const E& e) {
    const std::string m = e.what();
    for (const auto& w : words)
      if (m.find(w) == std::string::npos) fail(where, ": the error lacks '", w, "': ", m);
    return m;
  } catch (const std::exception& e) {
    fail(where, ": threw the wrong kind of error: ", e.what());
  }
  fail(where, ": did not throw");
}
template <typename E>
std::string throws(const char* where, const std::vector<std::string>& words, const std::function<void()>& f) {
  return expect_throw<E>(f, words, where);
}
#define NCCLAVG_EMU_STR2(x) #x
#define NCCLAVG_EMU_STR(x) NCCLAVG_EMU_STR2(x)
#define HERE __FILE__ ":" NCCLAVG_EMU_STR(__LINE__)

// Emulated device memory (cudaMalloc on `device`), freed with the object.
class DeviceMemory {
 public:
  DeviceMemory(int device, size_t numel, DType dtype);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  Buffer buffer() const { return Buffer{reinterpret_cast<uintptr_t>(p_), static_cast<int64_t>(numel_), dtype_, device_}; }
  Buffer slice(size_t offset, size_t numel) const;
  // Element values as float (fp16/bf16 widened), and writes of floats rounded to the dtype.
  float get(size_t i) const;
  void set(size_t i, float v);
  size_t numel() const { return numel_; }
  void* data() const { return p_; }

 private:
  void* p_ = nullptr;
  size_t numel_;
  DType dtype_;
  int device_;
};

float round_to(DType t, float v);  // v rounded to the element type, widened again

// The arithmetic the stand-in does for each reduction NcclComm can name, computed here from the
// inputs: what the collective must produce when NcclComm chose and passed that reduction.
float expected_mean(const std::string& reduction, const std::vector<float>& inputs, DType t);

// The stand-in's counters (ncclEmuStats).
struct Stats {
  long inits, destroys, aborts, collectives, misuse, destroy_in_flight;
  char last_misuse[256];
};
Stats stats();

// Loads NCCL through the project's loader (NCCLAVG_NCCL_LIBRARY names the stand-in); fails the
// scenario if it cannot.
void load_nccl();
std::string unique_id();
double now();
void sleep_s(double s);

// Runs f(0..n-1) on n threads and rethrows the first failure.
void run_threads(int n, const std::function<void(int)>& f);
// Runs f(p, shared) for p = 0..n-1 in n processes (f(0) in this one) and fails if any child fails or does
// not finish within `timeout_s`. Each child is this harness started afresh on the same scenario (fork, then
// exec at once: see Note [Children by fork and exec] in host_util.cpp), so the scenario's code before this
// call runs in every process and must only prepare; a child gets this process's `shared` in place of its
// own (e.g. the one NCCL unique id of the communicator).
void run_processes(int n, double timeout_s, const std::string& shared,
                   const std::function<void(int, const std::string&)>& f);

// A one-line result a test can grep, e.g. "INFO mode=blocking".
void info(const std::string& line);

using Scenario = void (*)();
struct Registration {
  Registration(const char* name, Scenario s, double budget_s);
};
#define SCENARIO(name, budget_s)                                              \
  static void scenario_##name();                                              \
  static ::emu_host::Registration reg_##name(#name, scenario_##name, budget_s); \
  static void scenario_##name()

// One collective's buffers, one per local device, filled with exact values (small integers times a
// power of two: every sum is exact in every dtype, so only the reduction's own rounding remains).
struct RankData {
  std::vector<std::unique_ptr<DeviceMemory>> mem;
  std::vector<Buffer> buffers() const;
};
RankData make_inputs(const std::vector<int>& devices, const std::vector<int>& ranks, size_t numel, DType t);
float input_value(int rank, size_t i);
// Checks every element of `got` against expected_mean of the ranks' inputs under `reduction`.
void check_all_reduce(const RankData& got, int nranks, const std::string& reduction, DType t, const char* what);

}  // namespace emu_host
