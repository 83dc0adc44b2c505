// Host-logic scenarios: the collectives (reductions chosen per NCCL version, predivide, forced
// reductions, reduce-scatter, all-gather), stream ordering, bad input. See host_util.h.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdlib>

#include "../nccl_api.h"
#include "emu_host.h"
#include "host_util.h"

namespace emu_host {
namespace {

using ncclavg::ArgError;
using ncclavg::NcclError;
using ncclavg::TypeError;
namespace nccl = ncclavg::nccl;

const DType kTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// The table of Note [Choosing the reduction], written out again from the Note: what NcclComm must name.
std::string expected_reduction(int n, DType t, bool predivide, bool average, const char* forced) {
  const bool avg = nccl::at_least(nccl::since::kAvg);
  const bool premul = nccl::api().RedOpCreatePreMulSum && nccl::at_least(nccl::since::kPreMulSum);
  const std::string d = std::to_string(n);
  if (forced && forced[0] && average) {
    std::string kind = forced, div = d;
    if (auto colon = kind.find(':'); colon != std::string::npos) {
      div = kind.substr(colon + 1);
      kind = kind.substr(0, colon);
    }
    if (kind == "avg") return "ncclAvg";
    if (kind == "premulsum") return "PreMulSum(1/" + div + ")";
    return "ncclSum + divide by " + div;
  }
  if (!average || n == 1) return "ncclSum";
  if (predivide) {
    if (premul) return "PreMulSum(1/" + d + ")";
    if (avg) return "ncclAvg";
    return "divide by " + d + " + ncclSum";
  }
  if (avg && (t == DType::kFloat32 || (n & (n - 1)) == 0)) return "ncclAvg";
  return "ncclSum + divide by " + d;
}

bool dtype_ok(DType t) { return t != DType::kBFloat16 || nccl::at_least(nccl::since::kBfloat16); }

}  // namespace

// Every dtype, both ops and predivide on 1..4 local ranks: the reduction NcclComm names is the one of
// the Note, and the data are what that reduction gives (bit for bit, exact inputs).
SCENARIO(all_reduce_reductions, 30) {
  const char* forced = std::getenv("NCCLAVG_TEST_REDUCTION");
  for (int n : {1, 2, 3, 4}) {
    std::vector<int> devices;
    for (int i = 0; i < n; ++i) devices.push_back(i);
    auto c = NcclComm::init_all(devices, 10.0);
    for (DType t : kTypes) {
      for (bool predivide : {false, true}) {
        for (const char* op : {"avg", "sum"}) {
          RankData d = make_inputs(devices, c->ranks(), 41, t);
          if (!dtype_ok(t)) {
            throws<NcclError>(HERE, {"bfloat16 collectives need NCCL >= 2.10"}, [&] { c->all_reduce(d.buffers(), {}, predivide, op, std::nullopt, ""); });
            continue;
          }
          const std::string want = expected_reduction(n, t, predivide, std::string(op) == "avg", forced);
          const std::string named = c->reduction(t, predivide, op, true);
          EXPECT(named == want, named, " != ", want, " (n=", n, " ", ncclavg::dtype_name(t), " predivide=", predivide,
                 " op=", op, ")");
          const uint64_t seq = c->all_reduce(d.buffers(), {}, predivide, op, std::nullopt, "case");
          c->wait(10.0, seq);
          check_all_reduce(d, n, named, t, named.c_str());
        }
      }
    }
    c->destroy();
  }
  EXPECT(stats().misuse == 0, stats().last_misuse);
}

// Reduce-scatter (separate and in-place shards) and all-gather (separate and in place).
SCENARIO(reduce_scatter_and_all_gather, 30) {
  const std::vector<int> devices{0, 1, 2, 3};
  const int n = 4;
  const size_t shard = 13;
  auto c = NcclComm::init_all(devices, 10.0);
  for (DType t : kTypes) {
    if (!dtype_ok(t)) continue;
    RankData full = make_inputs(devices, c->ranks(), shard * n, t);
    RankData out;
    for (int d : devices) out.mem.push_back(std::make_unique<DeviceMemory>(d, shard, t));
    const std::string red = c->reduction(t, false, "avg", false);
    c->wait(10.0, c->reduce_scatter(full.buffers(), out.buffers(), {}, false, "avg", std::nullopt, "rs"));
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < shard; ++i) {
        std::vector<float> in;
        for (int r = 0; r < n; ++r) in.push_back(round_to(t, input_value(r, k * shard + i)));
        const float want = expected_mean(red, in, t);
        EXPECT(out.mem[k]->get(i) == want, "rs rank ", k, " element ", i, ": ", out.mem[k]->get(i), " vs ", want);
      }
    }
    // all-gather the shards back, in place: rank k's shard is at offset k * shard of its own full buffer
    RankData gathered;
    std::vector<Buffer> shards, fulls;
    for (int k = 0; k < n; ++k) {
      gathered.mem.push_back(std::make_unique<DeviceMemory>(devices[k], shard * n, t));
      for (size_t i = 0; i < shard; ++i) gathered.mem[k]->set(k * shard + i, out.mem[k]->get(i));
      shards.push_back(gathered.mem[k]->slice(k * shard, shard));
      fulls.push_back(gathered.mem[k]->buffer());
    }
    c->wait(10.0, c->all_gather(shards, fulls, {}, std::nullopt, "ag in place"));
    for (int k = 0; k < n; ++k)
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < shard; ++i)
          EXPECT(gathered.mem[k]->get(r * shard + i) == out.mem[r]->get(i), "ag rank ", k, " shard ", r, " element ", i);
  }
  // the shard layout is checked before anything is enqueued
  RankData bad = make_inputs(devices, c->ranks(), 10, DType::kFloat32);
  RankData small = make_inputs(devices, c->ranks(), 3, DType::kFloat32);
  throws<ArgError>(HERE, {"'inputs'", "communicator size (4)"}, [&] { c->reduce_scatter(bad.buffers(), small.buffers(), {}, false, "avg", std::nullopt, ""); });
  EXPECT(stats().misuse == 0, stats().last_misuse);
}

// The collective starts after the caller's stream (an event, no host wait) and a reader ordered with
// stream_wait(seq) sees its result: a host function on the caller's stream writes the input late, a
// host function on the reader's stream copies the output.
SCENARIO(ordering_after_the_callers_stream_and_before_the_readers, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  const size_t numel = 29;
  RankData d = make_inputs({0, 1}, c->ranks(), numel, DType::kFloat32);
  RankData copy = make_inputs({0, 1}, c->ranks(), numel, DType::kFloat32);
  std::vector<cudaStream_t> user(2), reader(2);
  for (int k = 0; k < 2; ++k) {
    cudaSetDevice(k);
    cudaStreamCreateWithFlags(&user[k], cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&reader[k], cudaStreamNonBlocking);
  }
  struct Late {
    DeviceMemory* m;
    int rank;
  };
  std::vector<Late> late;
  for (int k = 0; k < 2; ++k) {
    for (size_t i = 0; i < numel; ++i) d.mem[k]->set(i, -1000.0f);  // what an unordered collective reads
    late.push_back(Late{d.mem[k].get(), k});
  }
  for (int k = 0; k < 2; ++k) {
    cudaLaunchHostFunc(user[k], [](void* p) {
      auto* l = static_cast<Late*>(p);
      sleep_s(0.05);  // the producer is slow: the collective must wait for it on the device
      for (size_t i = 0; i < l->m->numel(); ++i) l->m->set(i, input_value(l->rank, i));
    }, &late[k]);
  }
  const uint64_t seq = c->all_reduce(d.buffers(), {reinterpret_cast<uintptr_t>(user[0]), reinterpret_cast<uintptr_t>(user[1])},
                                     false, "avg", std::nullopt, "ordered");
  c->stream_wait({reinterpret_cast<uintptr_t>(reader[0]), reinterpret_cast<uintptr_t>(reader[1])}, seq);
  struct Copy {
    DeviceMemory* from;
    DeviceMemory* to;
  };
  std::vector<Copy> copies{{d.mem[0].get(), copy.mem[0].get()}, {d.mem[1].get(), copy.mem[1].get()}};
  for (int k = 0; k < 2; ++k) {
    cudaLaunchHostFunc(reader[k], [](void* p) {
      auto* cp = static_cast<Copy*>(p);
      for (size_t i = 0; i < cp->from->numel(); ++i) cp->to->set(i, cp->from->get(i));
    }, &copies[k]);
  }
  for (int k = 0; k < 2; ++k) EXPECT(cudaStreamSynchronize(reader[k]) == cudaSuccess);
  check_all_reduce(copy, 2, c->reduction(DType::kFloat32, false, "avg", true), DType::kFloat32, "the reader's copy");
  c->wait(10.0);
}

// Every refused argument names itself, enqueues nothing and leaves the communicator usable.
SCENARIO(bad_input_names_the_argument_and_keeps_the_comm_usable, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 16, DType::kFloat32);
  RankData other = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  const long before = stats().collectives;
  auto bufs = d.buffers();
  throws<ArgError>(HERE, {"'buffers'", "one buffer per local device"}, [&] { c->all_reduce({bufs[0]}, {}, false, "avg", std::nullopt, ""); });
  std::vector<float> host(16);
  auto on_host = bufs;
  on_host[1].ptr = reinterpret_cast<uintptr_t>(host.data());
  throws<ArgError>(HERE, {"'buffers[1]'", "host memory"}, [&] { c->all_reduce(on_host, {}, false, "avg", std::nullopt, ""); });
  auto wrong_dev = bufs;
  wrong_dev[1].device = 0;
  throws<ArgError>(HERE, {"'buffers[1]'"}, [&] { c->all_reduce(wrong_dev, {}, false, "avg", std::nullopt, ""); });
  auto lying = bufs;
  lying[1].ptr = bufs[0].ptr;  // says cuda:1, points into cuda:0's memory
  throws<ArgError>(HERE, {"'buffers[1]'", "its memory is on cuda:0"}, [&] { c->all_reduce(lying, {}, false, "avg", std::nullopt, ""); });
  auto mixed = bufs;
  mixed[1] = other.buffers()[1];
  throws<ArgError>(HERE, {"'buffers[1]'"}, [&] { c->all_reduce(mixed, {}, false, "avg", std::nullopt, ""); });
  auto ro = bufs;
  ro[0].readonly = true;
  throws<ArgError>(HERE, {"'buffers[0]'", "read-only"}, [&] { c->all_reduce(ro, {}, false, "avg", std::nullopt, ""); });
  throws<ArgError>(HERE, {"'op'", "'max'"}, [&] { c->all_reduce(bufs, {}, false, "max", std::nullopt, ""); });
  throws<ArgError>(HERE, {"'timeout_s'"}, [&] { c->all_reduce(bufs, {}, false, "avg", -1.0, ""); });
  throws<ArgError>(HERE, {"'after_streams'"}, [&] { c->all_reduce(bufs, {0}, false, "avg", std::nullopt, ""); });
  throws<ArgError>(HERE, {"'seq'"}, [&] { c->wait(1.0, 99); });
  throws<ArgError>(HERE, {"'streams'"}, [&] { c->stream_wait({0}, 0); });
  EXPECT(stats().collectives == before, "a refused call reached NCCL");
  c->wait(10.0, c->all_reduce(bufs, {}, false, "avg", std::nullopt, "after the refusals"));
  check_all_reduce(d, 2, c->reduction(DType::kFloat32, false, "avg", true), DType::kFloat32, "after the refusals");
}

// Several threads issue collectives on one communicator at once (mu_): each keeps its own data right.
SCENARIO(collectives_from_several_threads, 30) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  run_threads(3, [&](int) {
    for (int it = 0; it < 10; ++it) {
      RankData d = make_inputs({0, 1}, c->ranks(), 17, DType::kFloat32);
      c->wait(10.0, c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "threaded"));
      check_all_reduce(d, 2, "ncclAvg", DType::kFloat32, "threaded");
    }
  });
  EXPECT(c->pending() == 0);
}

// An error at the call or at ncclGroupEnd is an NcclError with NCCL's words; the communicator itself
// is healthy (its async state says so), so it stays usable.
SCENARIO(enqueue_error_is_reported_and_the_comm_stays_usable, 20) {
  auto c = NcclComm::init_all({0, 1}, 10.0);
  RankData d = make_inputs({0, 1}, c->ranks(), 8, DType::kFloat32);
  const std::string m = throws<NcclError>(HERE, {"could not be enqueued", "emulated error"}, [&] { c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "faulty"); });
  info("error=" + m);
  EXPECT(!c->aborted());
  c->wait(10.0, c->all_reduce(d.buffers(), {}, false, "avg", std::nullopt, "next"));
  check_all_reduce(d, 2, "ncclAvg", DType::kFloat32, "next");
}

}  // namespace emu_host
