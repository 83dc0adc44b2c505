// The shared-memory channel's collectives between two forked processes, exact: every input is a small
// integer, so every sum, in any order and any type, is exact and the expected bits are known. Runs
// natively and under qemu-aarch64 (memfd, an abstract unix socket with SCM_RIGHTS, cross-process
// futexes: all go through qemu's system-call translation).
//
//   shm_harness      RESULT: ok|FAIL checks=N failures=N; exit 0 when ok
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/shm_channel.h"

namespace {

using ncclavg::cpu::ShmChannel;
using ncclavg::cpu::ShmType;

int g_checks = 0, g_failures = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok && ++g_failures <= 20) std::printf("FAIL: %s\n", what.c_str());
}

// Value v (an integer of magnitude < 256) encoded in `type`: exact in all four.
void put(ShmType t, void* p, int64_t i, int v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case ShmType::kFloat32: static_cast<float*>(p)[i] = f; break;
    case ShmType::kFloat64: static_cast<double*>(p)[i] = v; break;
    case ShmType::kBFloat16: {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(u >> 16);  // exact: |v| < 256 has 8 bits
      break;
    }
    case ShmType::kFloat16: {  // integers below 2048 are exact halves
      if (v == 0) {
        static_cast<uint16_t*>(p)[i] = 0;
        break;
      }
      const int a = v < 0 ? -v : v;
      int e = 0;
      while ((a >> (e + 1)) != 0) ++e;
      const uint16_t m = static_cast<uint16_t>((a << (10 - e)) & 0x3ff);
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((e + 15) << 10) | m);
      break;
    }
  }
}

// Rank r's input element i, a small integer.
int input(int r, int64_t i) { return static_cast<int>((i * 7 + r * 13) % 61) - 30; }

std::vector<unsigned char> buffer(ShmType t, int64_t n) { return std::vector<unsigned char>(n * type_size(t) + 8); }

bool same(ShmType t, const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, int64_t n) {
  return std::memcmp(a.data(), b.data(), n * type_size(t)) == 0;
}

void run_rank(ShmChannel& ch, int rank, int nranks) {
  const double timeout = 60.0;
  for (ShmType t : {ShmType::kFloat32, ShmType::kFloat16, ShmType::kBFloat16, ShmType::kFloat64}) {
    const std::string tn = type_name(t);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{17}, int64_t{1000}, int64_t{300001}}) {
      const std::string what = tn + " n=" + std::to_string(n);
      // all_reduce: the sum, and the sum of doubled inputs divided by 2 (the channel's scale), both
      // the plain sum of the inputs.
      for (int div : {1, 2}) {
        auto data = buffer(t, n), want = buffer(t, n);
        for (int64_t i = 0; i < n; ++i) {
          put(t, data.data(), i, input(rank, i) * div);
          int s = 0;
          for (int r = 0; r < nranks; ++r) s += input(r, i);
          put(t, want.data(), i, s);
        }
        bool bad = true;
        ch.all_reduce_sum(reinterpret_cast<uintptr_t>(data.data()), n, static_cast<int>(t), timeout, 1.0, div, {},
                          &bad);
        check(same(t, data, want, n), "all_reduce " + what + " div=" + std::to_string(div));
        check(!bad, "all_reduce " + what + ": finite values flagged");
      }
      // reduce_scatter: slice `rank` of the sum.
      {
        auto in = buffer(t, n * nranks), out = buffer(t, n), want = buffer(t, n);
        for (int64_t i = 0; i < n * nranks; ++i) put(t, in.data(), i, input(rank, i));
        for (int64_t i = 0; i < n; ++i) {
          int s = 0;
          for (int r = 0; r < nranks; ++r) s += input(r, rank * n + i);
          put(t, want.data(), i, s);
        }
        ch.reduce_scatter_sum(reinterpret_cast<uintptr_t>(in.data()), reinterpret_cast<uintptr_t>(out.data()), n,
                              static_cast<int>(t), timeout);
        check(same(t, out, want, n), "reduce_scatter " + what);
      }
      // all_gather and broadcast: copies.
      {
        auto in = buffer(t, n), out = buffer(t, n * nranks), want = buffer(t, n * nranks);
        for (int64_t i = 0; i < n; ++i) put(t, in.data(), i, input(rank, i));
        for (int r = 0; r < nranks; ++r) {
          for (int64_t i = 0; i < n; ++i) put(t, want.data(), r * n + i, input(r, i));
        }
        ch.all_gather(reinterpret_cast<uintptr_t>(in.data()), reinterpret_cast<uintptr_t>(out.data()), n,
                      static_cast<int>(t), timeout);
        check(same(t, out, want, n * nranks), "all_gather " + what);
        auto b = buffer(t, n), bw = buffer(t, n);
        for (int64_t i = 0; i < n; ++i) {
          put(t, b.data(), i, input(rank, i));
          put(t, bw.data(), i, input(1, i));
        }
        ch.broadcast(reinterpret_cast<uintptr_t>(b.data()), n, static_cast<int>(t), 1, timeout);
        check(same(t, b, bw, n), "broadcast " + what);
      }
    }
  }
  ch.barrier(timeout);
}

int rank_main(const std::string& name, int rank, int nranks) {
  try {
    std::unique_ptr<ShmChannel> ch;
    for (int attempt = 0;; ++attempt) {  // rank 1 may ask before rank 0's door is open
      try {
        ch = std::make_unique<ShmChannel>(name, rank, nranks, 64 * 1024, 12345);
        break;
      } catch (const std::runtime_error&) {
        if (rank == 0 || attempt > 600) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    run_rank(*ch, rank, nranks);
    ch->close_door();
  } catch (const std::exception& e) {
    std::printf("FAIL: rank %d: %s\n", rank, e.what());
    return 2;
  }
  std::printf("rank %d: checks=%d failures=%d\n", rank, g_checks, g_failures);
  return g_failures ? 1 : 0;
}

}  // namespace

int main() {
  std::fflush(stdout);
  const std::string name = "ncclavg-native-" + std::to_string(getpid());
  const pid_t child = fork();
  if (child < 0) return 2;
  if (child == 0) {
    const int rc = rank_main(name, 1, 2);
    std::fflush(stdout);  // _exit does not flush
    _exit(rc);
  }
  const int rc0 = rank_main(name, 0, 2);
  int status = 0;
  waitpid(child, &status, 0);
  const int rc1 = WIFEXITED(status) ? WEXITSTATUS(status) : 2;
  const bool ok = rc0 == 0 && rc1 == 0;
  std::printf("RESULT: %s ranks=2 rank0=%d rank1=%d\n", ok ? "ok" : "FAIL", rc0, rc1);
  return ok ? 0 : 1;
}
