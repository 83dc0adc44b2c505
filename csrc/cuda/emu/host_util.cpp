// Helpers and the main() of the host-logic harness. See host_util.h.
#include "host_util.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "../../common/elementwise.h"
#include "../nccl_api.h"
#include "emu_host.h"

namespace emu_host {

namespace {
struct Entry {
  Scenario fn;
  double budget_s;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
std::string g_scenario;
}  // namespace

void fail_now(const std::string& why) {
  std::printf("FAIL %s: %s\n", g_scenario.c_str(), why.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(1);
}

Registration::Registration(const char* name, Scenario s, double budget_s) { registry()[name] = Entry{s, budget_s}; }

DeviceMemory::DeviceMemory(int device, size_t numel, DType dtype) : numel_(numel), dtype_(dtype), device_(device) {
  const bool had = ncclavg_emu::has_context();  // restore only a device the thread chose: no context on 0
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  if (cudaMalloc(&p_, numel * ncclavg::dtype_size(dtype)) != cudaSuccess) fail("cudaMalloc failed");
  if (had) cudaSetDevice(prev);
  for (size_t i = 0; i < numel; ++i) set(i, 0.0f);
}

DeviceMemory::~DeviceMemory() { cudaFree(p_); }

Buffer DeviceMemory::slice(size_t offset, size_t numel) const {
  Buffer b = buffer();
  b.ptr += offset * ncclavg::dtype_size(dtype_);
  b.numel = static_cast<int64_t>(numel);
  return b;
}

float DeviceMemory::get(size_t i) const {
  switch (dtype_) {
    case DType::kFloat32: return static_cast<float*>(p_)[i];
    case DType::kFloat16: return static_cast<float>(static_cast<_Float16*>(p_)[i]);
    case DType::kBFloat16: return ncclavg::ew::bf16_bits_to_float(static_cast<uint16_t*>(p_)[i]);
  }
  return 0;
}

void DeviceMemory::set(size_t i, float v) {
  switch (dtype_) {
    case DType::kFloat32: static_cast<float*>(p_)[i] = v; break;
    case DType::kFloat16: static_cast<_Float16*>(p_)[i] = static_cast<_Float16>(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(p_)[i] = ncclavg::ew::float_to_bf16_bits(v); break;
  }
}

float round_to(DType t, float v) {
  switch (t) {
    case DType::kFloat32: return v;
    case DType::kFloat16: return static_cast<float>(static_cast<_Float16>(v));
    case DType::kBFloat16: return ncclavg::ew::bf16_bits_to_float(ncclavg::ew::float_to_bf16_bits(v));
  }
  return v;
}

// reduction: what NcclComm::reduction() names ("ncclAvg", "PreMulSum(1/3)", "ncclSum + divide by 3",
// "divide by 3 + ncclSum", "ncclSum"). The inputs are exact (host_util.h), so the sums are exact too.
float expected_mean(const std::string& reduction, const std::vector<float>& inputs, DType t) {
  const int n = static_cast<int>(inputs.size());
  auto premul = [&](float scalar) {
    const float s = round_to(t, scalar);
    float acc = 0;
    for (float x : inputs) acc += round_to(t, x * s);
    return round_to(t, acc);
  };
  float sum = 0;
  for (float x : inputs) sum += x;
  if (reduction == "ncclSum") return round_to(t, sum);
  if (reduction == "ncclAvg") return premul(1.0f / static_cast<float>(n));
  int d = 0;
  if (std::sscanf(reduction.c_str(), "PreMulSum(1/%d)", &d) == 1) return premul(1.0f / static_cast<float>(d));
  if (std::sscanf(reduction.c_str(), "ncclSum + divide by %d", &d) == 1) return round_to(t, round_to(t, sum) / d);
  if (std::sscanf(reduction.c_str(), "divide by %d + ncclSum", &d) == 1) {
    float acc = 0;
    for (float x : inputs) acc += round_to(t, x / d);
    return round_to(t, acc);
  }
  fail("unknown reduction name '", reduction, "'");
}

float input_value(int rank, size_t i) {
  // small integers (|v| <= 24) times 2^-2: sums of up to 8 ranks are exact in bf16's 8 bits
  const int v = static_cast<int>((rank * 7 + i * 5) % 49) - 24;
  return static_cast<float>(v) * 0.25f;
}

std::vector<Buffer> RankData::buffers() const {
  std::vector<Buffer> out;
  for (const auto& m : mem) out.push_back(m->buffer());
  return out;
}

RankData make_inputs(const std::vector<int>& devices, const std::vector<int>& ranks, size_t numel, DType t) {
  RankData d;
  for (size_t k = 0; k < devices.size(); ++k) {
    d.mem.push_back(std::make_unique<DeviceMemory>(devices[k], numel, t));
    for (size_t i = 0; i < numel; ++i) d.mem.back()->set(i, input_value(ranks[k], i));
  }
  return d;
}

void check_all_reduce(const RankData& got, int nranks, const std::string& reduction, DType t, const char* what) {
  for (size_t k = 0; k < got.mem.size(); ++k) {
    for (size_t i = 0; i < got.mem[k]->numel(); ++i) {
      std::vector<float> in;
      for (int r = 0; r < nranks; ++r) in.push_back(round_to(t, input_value(r, i)));
      const float want = expected_mean(reduction, in, t);
      const float have = got.mem[k]->get(i);
      if (!(have == want))
        fail(what, ": element ", i, " of local buffer ", k, " is ", have, ", expected ", want, " (", reduction, ", ",
             ncclavg::dtype_name(t), ")");
    }
  }
}

Stats stats() {
  using Fn = void (*)(Stats*);
  const auto& info = ncclavg::nccl::load_info();
  void* h = dlopen(info.path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  auto fn = h ? reinterpret_cast<Fn>(dlsym(h, "ncclEmuStats")) : nullptr;
  if (!fn) fail("the loaded NCCL is not the stand-in (no ncclEmuStats): ", info.path);
  Stats s;
  fn(&s);
  return s;
}

void load_nccl() {
  const auto& info = ncclavg::nccl::load({});
  if (!info.loaded) fail("NCCL not loaded: ", info.error);
}

std::string unique_id() { return NcclComm::unique_id(); }

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

void run_threads(int n, const std::function<void(int)>& f) {
  std::mutex m;
  std::string first;
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i) {
    ts.emplace_back([&, i] {
      try {
        f(i);
      } catch (const std::exception& e) {
        fail_now("thread " + std::to_string(i) + ": " + e.what());
      }
    });
  }
  for (auto& t : ts) t.join();
}

// Note [Children by fork and exec]
// A child made by fork() alone inherits every lock that another thread held at that instant, with no
// thread left to release it: the harness already runs its budget watchdog, the emulated runtime its stream
// threads, and ASan's allocator takes a lock on every thread's start and on many allocations. One run in
// about fifteen of the 2+2 init froze that way in the child's first allocation (both processes then
// reported an init timeout). So a child is this executable again (/proc/self/exe, the same scenario),
// exec'd right after the fork with nothing but async-signal-safe calls in between; it is told its index
// and the parent's `shared` value through the environment and runs only f(index) when it reaches
// run_processes. A pending alarm() survives the exec: an orphan never outlives the scenario for long.
namespace {
constexpr const char* kChildIndexEnv = "NCCLEMU_HOST_CHILD";
constexpr const char* kChildSharedEnv = "NCCLEMU_HOST_SHARED";

std::string to_hex(const std::string& b) {
  static const char* digits = "0123456789abcdef";
  std::string h;
  for (unsigned char c : b) {
    h += digits[c >> 4];
    h += digits[c & 15];
  }
  return h;
}

std::string from_hex(const char* h) {
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string b;
  for (; h[0] && h[1]; h += 2) b += static_cast<char>(nibble(h[0]) << 4 | nibble(h[1]));
  return b;
}

[[noreturn]] void run_child(int index, const std::string& shared, const std::function<void(int, const std::string&)>& f) {
  try {
    f(index, shared);
  } catch (const std::exception& e) {
    fail_now("process " + std::to_string(index) + ": " + e.what());
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(0);  // no static destructors: stream threads of the emulated runtime may still run
}
}  // namespace

void run_processes(int n, double timeout_s, const std::string& shared,
                   const std::function<void(int, const std::string&)>& f) {
  if (const char* child = std::getenv(kChildIndexEnv); child && child[0]) {
    const char* given = std::getenv(kChildSharedEnv);
    run_child(std::atoi(child), from_hex(given ? given : ""), f);
  }
  // Everything the child needs is built here, before the fork.
  std::vector<std::string> env_own;
  for (char** e = environ; *e; ++e) env_own.emplace_back(*e);
  env_own.push_back(std::string(kChildSharedEnv) + "=" + to_hex(shared));
  env_own.emplace_back();  // the index, set per child below
  std::string self = "/proc/self/exe";
  std::vector<pid_t> kids;
  for (int i = 1; i < n; ++i) {
    env_own.back() = std::string(kChildIndexEnv) + "=" + std::to_string(i);
    std::vector<char*> envp;
    for (auto& v : env_own) envp.push_back(v.data());
    envp.push_back(nullptr);
    std::vector<char*> argv{self.data(), g_scenario.data(), nullptr};
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(static_cast<unsigned>(timeout_s) + 1);
      execve(self.c_str(), argv.data(), envp.data());
      static const char msg[] = "FAIL: cannot exec the harness for a child process\n";
      (void)!write(1, msg, sizeof msg - 1);
      _exit(4);
    }
    if (pid < 0) fail("fork failed");
    kids.push_back(pid);
  }
  f(0, shared);
  const double end = now() + timeout_s;
  for (pid_t pid : kids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (now() > end) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fail("process ", pid, " did not finish within ", timeout_s, " s");
      }
      sleep_s(0.005);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail("process ", pid, " failed (status ", status, ")");
  }
}

void info(const std::string& line) {
  std::printf("INFO %s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace emu_host

int main(int argc, char** argv) {
  using namespace emu_host;
  if (argc == 2 && std::string(argv[1]) == "--list") {
    for (const auto& [name, e] : registry()) std::printf("%s %g\n", name.c_str(), e.budget_s);
    return 0;
  }
  if (argc != 2 || !registry().count(argv[1])) {
    std::fprintf(stderr, "usage: emu_host --list | emu_host <scenario>\n");
    return 2;
  }
  const std::string name = argv[1];
  g_scenario = name;
  const Entry e = registry()[name];
  ncclavg_emu::set_launches_async(true);  // the divide kernel runs on its stream, after NCCL's item
  // A scenario that hangs is a failure with its name, not a stuck CI job.
  std::thread([name, budget = e.budget_s] {
    sleep_s(budget);
    std::printf("FAIL %s: did not finish within its budget of %g s (a hang)\n", name.c_str(), budget);
    std::fflush(stdout);
    _exit(3);
  }).detach();
  try {
    load_nccl();
    e.fn();
  } catch (const std::exception& ex) {
    fail_now(std::string("uncaught: ") + ex.what());
  }
  std::printf("PASS %s\n", name.c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(0);  // See run_processes: frozen peers and stream threads are left to the OS
}
