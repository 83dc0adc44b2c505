// NcclComm collectives: argument checks, the choice of reduction, and the one grouped NCCL call.
#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "../common/check.h"
#include "../common/elementwise.h"
#include "comm_impl.h"
#include "cuda_ops.h"

namespace ncclavg {
namespace nccl {

// Note [Choosing the reduction]
// ncclAvg (NCCL >= 2.10) is not "sum, then divide": for floating types NCCL turns it into PreMulSum,
// every rank's input multiplied by 1/n ROUNDED TO THE ELEMENT TYPE before the sum. For fp32, or for
// any n that is a power of two, that scalar is exact (or off by at most 2^-24 relative) and ncclAvg is
// the best choice: no extra pass over memory. But a bfloat16 1/3 is 0.333984 (+0.2%) and an fp16 1/3
// is 0.333252 (-0.02%): every mean over 3, 5, 6, 7 ... ranks would carry that bias. So:
//   op="sum"                                  -> ncclSum
//   size == 1                                 -> ncclSum (the mean of one rank is the input)
//   predivide, NCCL >= 2.11                   -> PreMulSum(1/size) (explicit op, created once per
//                                                comm and dtype, destroyed with the communicator)
//   predivide, NCCL 2.10                      -> ncclAvg (the same PreMulSum inside NCCL)
//   predivide, older NCCL, all-reduce         -> divide kernel on the input, then ncclSum
//   fp32 or power-of-two size, NCCL >= 2.10   -> ncclAvg
//   otherwise                                 -> ncclSum, then the divide kernel on the output
// (For fp16, any 1/n pre-multiply, ncclAvg's included, also moves inputs below n * 2^-14 into the
// subnormal range, where they lose bits, and rounds those below n * 2^-25 to zero; op="sum" plus a
// later scale avoids that when it matters.)
// "predivide" trades accuracy for range: fp16 sums of large gradients over many ranks can overflow
// 65504 before the division, pre-scaled inputs cannot. The divide kernel (scale_kernel.cu) runs on the
// comm stream right after the collective, inside the same ordering, and divides in fp32 with one
// rounding, exactly like ops.average_. A reduce-scatter never pre-scales (its input must stay intact):
// on NCCL < 2.10 it sums and divides the output.

// Note [Forcing the reduction in tests]
// A communicator of one rank never reaches NCCL's arithmetic: the mean of one rank is its input, so
// choose_reduction picks a plain ncclSum, and NCCL's one-rank in-place sum does nothing. A machine with
// one GPU and an NCCL that cannot put several ranks on it would then test none of ncclAvg, PreMulSum or
// SUM + divide. NCCLAVG_TEST_REDUCTION=<kind>[:<divisor>] (read at init; for tests only) makes every
// averaging collective of the communicator use <kind> whatever its size and dtype:
//   avg        ncclAvg (the divisor, if given, must be the size: NCCL divides by its rank count)
//   premulsum  PreMulSum(1/divisor), the scalar rounded to the element type as NCCL requires
//   sum_divide ncclSum, then the divide kernel by divisor on the output (fp32, one rounding)
// With one rank and a divisor d, an "average" is then x * fl(1/d) or fl(x / d): results a test can
// predict bit for bit, computed by NCCL's real one-rank kernels and by ours.
// Parses the switch's value: kind and divisor (0: the size). Throws ArgError naming the variable.
void parse_test_reduction(const std::string& value, std::string* kind, int* divisor) {
  const size_t colon = value.find(':');
  *kind = value.substr(0, colon);
  *divisor = 0;
  NCCLAVG_CHECK_ARG(*kind == "avg" || *kind == "premulsum" || *kind == "sum_divide", "NCCLAVG_TEST_REDUCTION",
                    "must be avg, premulsum or sum_divide, optionally followed by :<divisor>, got '", value, "'");
  if (colon == std::string::npos) return;
  const std::string d = value.substr(colon + 1);
  char* end = nullptr;
  const long v = std::strtol(d.c_str(), &end, 10);
  NCCLAVG_CHECK_ARG(!d.empty() && end && *end == '\0' && v >= 1 && v <= 1000000, "NCCLAVG_TEST_REDUCTION",
                    "the divisor after ':' must be a whole number in [1, 1000000], got '", d, "'");
  *divisor = static_cast<int>(v);
}

struct CollectivePlan {
  enum Kind { kAllReduce, kReduceScatter, kAllGather } kind;
  const char* name = "";
  std::vector<Buffer> send, recv;  // one per local device (all-reduce: the same buffers)
  size_t count = 0;                // NCCL's count argument (elements per rank for RS/AG)
  DType dtype = DType::kFloat32;
  size_t bytes = 0;                // for messages: the payload per device
  // The reduction (all-reduce and reduce-scatter), see Note [Choosing the reduction].
  ncclRedOp_t op = ncclSum;
  bool premulsum = false;
  bool prescale = false;
  bool postscale = false;
  std::string what;
};

namespace {

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
  }
  return ncclFloat32;
}

bool is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

std::string human_bytes(size_t b) {
  std::ostringstream os;
  os << b << " bytes";
  if (b >= (1u << 20)) os << " (" << static_cast<double>(b) / (1 << 20) << " MiB)";
  return os.str();
}

// One buffer per local device, each really on that device, all of the same dtype and numel.
void check_per_device(const std::vector<Buffer>& bufs, const char* argname, const std::vector<int>& devices,
                      bool writable) {
  NCCLAVG_CHECK_ARG(bufs.size() == devices.size(), argname, "needs one buffer per local device (",
                    devices.size(), ": ", list_string(devices), "), got ", bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    const Buffer& b = bufs[i];
    const std::string what = std::string(argname) + "[" + std::to_string(i) + "]";
    validate_buffer(b, what);
    NCCLAVG_CHECK_ARG(!writable || !b.readonly, what, "is read-only; the collective writes into it");
    NCCLAVG_CHECK_ARG(b.device == devices[i], what, "is on ",
                      b.on_cpu() ? std::string("cpu") : "cuda:" + std::to_string(b.device),
                      " but local device ", i, " of the communicator is cuda:", devices[i]);
    NCCLAVG_CHECK_TYPE(b.dtype == bufs[0].dtype, what, "dtype ", dtype_name(b.dtype), " differs from ", argname,
                       "[0] dtype ", dtype_name(bufs[0].dtype));
    NCCLAVG_CHECK_ARG(b.numel == bufs[0].numel, what, "has ", b.numel, " elements but ", argname, "[0] has ",
                      bufs[0].numel);
    if (b.numel == 0) continue;
    // Defence against a mislabelled pointer: ask the runtime where the memory really lives.
    cudaPointerAttributes attr{};
    cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(b.ptr));
    if (e != cudaSuccess) {
      cudaGetLastError();
      NCCLAVG_CHECK_ARG(false, what, "is not a CUDA allocation (cudaPointerGetAttributes: ", cudaGetErrorString(e),
                        ")");
    }
    NCCLAVG_CHECK_ARG(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, what,
                      "points to host memory; NCCL collectives need device memory");
    NCCLAVG_CHECK_ARG(attr.type != cudaMemoryTypeDevice || attr.device == b.device, what,
                      "says cuda:", b.device, " but its memory is on cuda:", attr.device);
  }
}

// NCCL >= 2.10 for bfloat16.
void check_dtype_supported(DType t, const char* argname) {
  if (t == DType::kBFloat16 && !at_least(since::kBfloat16)) {
    detail::fail<NcclError>(__FILE__, __LINE__, "argument '", argname, "': bfloat16 collectives need NCCL >= 2.10; "
                            "the loaded NCCL is ", version_string(load_info().version));
  }
}

bool overlaps(const Buffer& a, const Buffer& b) {
  if (a.numel == 0 || b.numel == 0) return false;
  return a.ptr < b.ptr + b.nbytes() && b.ptr < a.ptr + a.nbytes();
}

void check_distinct(const std::vector<Buffer>& bufs, const char* argname) {
  for (size_t i = 0; i < bufs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      NCCLAVG_CHECK_ARG(!overlaps(bufs[i], bufs[j]), argname, "entries ", j, " and ", i,
                        " share memory (the same buffer passed twice, or overlapping views)");
    }
  }
}

// Reduce-scatter (full in, shard out) and all-gather (shard in, full out) share one layout rule: each
// device's full buffer holds `size` shards, and the two may overlap only when the shard IS this rank's
// slice of the full buffer (NCCL's in-place form).
void check_full_and_shard(const std::vector<Buffer>& full, const char* full_name, const std::vector<Buffer>& shard,
                          const char* shard_name, int size, const std::vector<int>& ranks) {
  NCCLAVG_CHECK_ARG(full[0].numel == shard[0].numel * size, full_name, "has ", full[0].numel,
                    " elements per device; it must be the communicator size (", size, ") times ", shard_name,
                    "' ", shard[0].numel);
  for (size_t i = 0; i < full.size(); ++i) {
    const size_t offset = static_cast<size_t>(ranks[i]) * shard[i].nbytes();
    const bool in_place = shard[i].ptr == full[i].ptr + offset;
    NCCLAVG_CHECK_ARG(in_place || !overlaps(full[i], shard[i]), std::string(shard_name) + "[" + std::to_string(i) + "]",
                      "overlaps ", full_name, "[", i, "]; the only overlap allowed is the in-place shard at byte offset ",
                      offset, " of ", full_name, "[", i, "] (rank ", ranks[i], ")");
  }
}

// Every check a reduce-scatter (inputs full, outputs shards) or an all-gather (inputs shards, outputs
// full) makes on its buffers, in one place so the two collectives cannot drift apart.
void check_sharded_pair(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs, bool inputs_full,
                        const std::vector<int>& devices, int size, const std::vector<int>& ranks) {
  check_per_device(inputs, "inputs", devices, false);
  check_per_device(outputs, "outputs", devices, true);
  check_distinct(inputs, "inputs");
  check_distinct(outputs, "outputs");
  NCCLAVG_CHECK_TYPE(outputs[0].dtype == inputs[0].dtype, "outputs", "dtype ", dtype_name(outputs[0].dtype),
                     " differs from inputs dtype ", dtype_name(inputs[0].dtype));
  if (inputs_full) {
    check_full_and_shard(inputs, "inputs", outputs, "outputs", size, ranks);
  } else {
    check_full_and_shard(outputs, "outputs", inputs, "inputs", size, ranks);
  }
  check_dtype_supported(inputs[0].dtype, "inputs");
}

std::vector<uintptr_t> checked_streams(const std::vector<uintptr_t>& after, size_t n) {
  if (after.empty()) return std::vector<uintptr_t>(n, 0);  // the legacy default stream of each device
  NCCLAVG_CHECK_ARG(after.size() == n, "after_streams", "needs one stream per local device (", n, "), got ",
                    after.size(), " (or pass an empty list for the default streams)");
  return after;
}

bool parse_average(const std::string& op) {
  NCCLAVG_CHECK_ARG(op == "avg" || op == "sum", "op", "must be 'avg' or 'sum', got '", op, "'");
  return op == "avg";
}

}  // namespace


namespace {

// See Note [Choosing the reduction]. `may_prescale`: the collective may overwrite its input.
// `forced`: See Note [Forcing the reduction in tests].
void choose_reduction(CollectivePlan& p, int size, bool average, bool predivide, bool may_prescale,
                      const std::string& forced = "") {
  p.op = ncclSum;
  p.premulsum = p.prescale = p.postscale = false;
  const bool has_avg = at_least(since::kAvg);
  if (average && !forced.empty()) {
    if (forced == "avg") {
      NCCLAVG_CHECK_ARG(has_avg, "NCCLAVG_TEST_REDUCTION", "avg needs NCCL >= 2.10");
      p.op = ncclAvg;
    } else if (forced == "premulsum") {
      NCCLAVG_CHECK_ARG(api().RedOpCreatePreMulSum && at_least(since::kPreMulSum), "NCCLAVG_TEST_REDUCTION",
                        "premulsum needs NCCL >= 2.11");
      p.premulsum = true;
    } else {
      p.postscale = true;
    }
    return;
  }
  if (!average || size == 1) return;
  if (predivide) {
    if (api().RedOpCreatePreMulSum && at_least(since::kPreMulSum)) {
      p.premulsum = true;
    } else if (has_avg) {
      p.op = ncclAvg;
    } else if (may_prescale) {
      p.prescale = true;
    } else {
      p.postscale = true;
    }
    return;
  }
  if (has_avg && (p.dtype == DType::kFloat32 || is_power_of_two(size))) {
    p.op = ncclAvg;
  } else {
    p.postscale = true;
  }
}

std::string reduction_name(const CollectivePlan& p, int size) {   // size: the divisor
  std::ostringstream os;
  if (p.prescale) os << "divide by " << size << " + ";
  if (p.premulsum) {
    os << "PreMulSum(1/" << size << ")";
  } else {
    os << (p.op == ncclAvg ? "ncclAvg" : "ncclSum");
  }
  if (p.postscale) os << " + divide by " << size;
  return os.str();
}

std::string describe(const CollectivePlan& p, const std::string& tag, const std::string& where) {
  std::ostringstream os;
  os << p.name;
  if (!tag.empty()) os << "[" << tag << "]";
  os << " of " << human_bytes(p.bytes) << " (" << p.count << " x " << dtype_name(p.dtype) << " per rank) on "
     << where;
  return os.str();
}

}  // namespace

std::string NcclComm::reduction(DType dtype, bool predivide, const std::string& op, bool all_reduce) const {
  CollectivePlan p;
  p.dtype = dtype;
  choose_reduction(p, size_, parse_average(op), predivide, all_reduce, forced_reduction_);
  return reduction_name(p, divisor_);
}

void NcclComm::check_not_capturing(const std::vector<uintptr_t>& streams) const {
  for (size_t i = 0; i < streams.size(); ++i) {
    if (streams[i] == 0 || streams[i] == reinterpret_cast<uintptr_t>(cudaStreamLegacy)) continue;  // never captures
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    NCCLAVG_CUDA_CHECK(cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(streams[i]), &status));
    NCCLAVG_CHECK_ARG(status == cudaStreamCaptureStatusNone, "after_streams[" + std::to_string(i) + "]",
                      "is capturing a CUDA graph (e.g. inside torch.cuda.graph()): ncclavg's NCCL collectives "
                      "are tracked by host-side events and cannot be captured; run them outside the graph "
                      "(See Note [Event queries during a capture])");
  }
}

ncclRedOp_t NcclComm::premulsum_locked(size_t i, DType dtype, const Deadline& deadline) {
  Device& d = *dev_[i];
  const int t = static_cast<int>(dtype);
  if (d.has_premul[t]) return d.premul[t];
  const Api& a = api();
  NCCLAVG_CHECK_INTERNAL(a.RedOpCreatePreMulSum != nullptr, "PreMulSum chosen but ncclRedOpCreatePreMulSum is missing");
  // The scalar has the element type; NCCL keeps a copy (ncclScalarHostImmediate).
  const float inv = static_cast<float>(1.0 / divisor_);
  float f32 = inv;
  _Float16 f16 = static_cast<_Float16>(inv);
  uint16_t bf16 = ew::float_to_bf16_bits(inv);
  void* scalar = dtype == DType::kFloat32 ? static_cast<void*>(&f32)
                 : dtype == DType::kFloat16 ? static_cast<void*>(&f16)
                                            : static_cast<void*>(&bf16);
  ncclRedOp_t op = ncclSum;
  ncclResult_t r = a.RedOpCreatePreMulSum(&op, scalar, nccl_dtype(dtype), ncclScalarHostImmediate, d.comm);
  if (r == ncclInProgress) {
    poll_ready_locked(deadline, "ncclRedOpCreatePreMulSum");
  } else {
    NCCLAVG_NCCL_CHECK(r, d.comm);
  }
  d.premul[t] = op;
  d.has_premul[t] = true;
  return op;
}

uint64_t NcclComm::run_locked(const CollectivePlan& p, const std::vector<uintptr_t>& after_streams,
                              std::optional<double> timeout_s) {
  const Api& a = api();
  const size_t n = dev_.size();
  const std::vector<uintptr_t> after = checked_streams(after_streams, n);
  const Deadline deadline = deadline_in(timeout_s ? checked_timeout(*timeout_s, "timeout_s") : timeout_s_);
  if (closing_) throw NcclError(p.what + " refused: the communicator is being destroyed (See Note [Teardown])");
  check_not_capturing(after);  // See Note [Event queries during a capture] in comm.cpp
  prune_locked();  // keeps the in-flight queue short when nobody waits
  check_async_errors_locked("starting " + p.what);

  std::vector<ncclRedOp_t> redops(n, p.op);
  if (p.premulsum) {
    for (size_t i = 0; i < n; ++i) redops[i] = premulsum_locked(i, p.dtype, deadline);
  }
  auto op = std::make_unique<Op>();
  op->what = p.what;
  op->devices = devices_;
  for (size_t i = 0; i < n; ++i) {
    cuda::DeviceGuard guard(dev_[i]->device);
    op->done.push_back(nullptr);
    NCCLAVG_CUDA_CHECK(cudaEventCreateWithFlags(&op->done.back(), cudaEventDisableTiming));
  }
  // Order the comm streams after the callers' streams: an event, never a device sync.
  for (size_t i = 0; i < n; ++i) {
    Device& d = *dev_[i];
    cuda::DeviceGuard guard(d.device);
    NCCLAVG_CUDA_CHECK(cudaEventRecord(d.ready, reinterpret_cast<cudaStream_t>(after[i])));
    NCCLAVG_CUDA_CHECK(cudaStreamWaitEvent(d.stream, d.ready, 0));
    if (p.prescale) cuda::divide_inplace(p.send[i], static_cast<float>(divisor_), reinterpret_cast<uintptr_t>(d.stream));
  }

  // ONE grouped call over the local devices. No exception may leave between GroupStart and GroupEnd.
  NCCLAVG_NCCL_CHECK(a.GroupStart(), nullptr);
  ncclResult_t first = ncclSuccess;
  size_t first_i = 0;
  bool in_progress = false;
  const ncclDataType_t dt = nccl_dtype(p.dtype);
  for (size_t i = 0; i < n; ++i) {
    Device& d = *dev_[i];
    const void* send = reinterpret_cast<const void*>(p.send[i].ptr);
    void* recv = reinterpret_cast<void*>(p.recv[i].ptr);
    ncclResult_t r = ncclSuccess;
    switch (p.kind) {
      case CollectivePlan::kAllReduce: r = a.AllReduce(send, recv, p.count, dt, redops[i], d.comm, d.stream); break;
      case CollectivePlan::kReduceScatter:
        r = a.ReduceScatter(send, recv, p.count, dt, redops[i], d.comm, d.stream);
        break;
      case CollectivePlan::kAllGather: r = a.AllGather(send, recv, p.count, dt, d.comm, d.stream); break;
    }
    in_progress |= r == ncclInProgress;
    if (r != ncclSuccess && r != ncclInProgress && first == ncclSuccess) {
      first = r;
      first_i = i;
    }
  }
  const ncclResult_t end = a.GroupEnd();
  in_progress |= end == ncclInProgress;
  if (first != ncclSuccess || (end != ncclSuccess && end != ncclInProgress)) {
    const ncclResult_t bad = first != ncclSuccess ? first : end;
    const std::string msg = p.what + " could not be enqueued" +
                            (first != ncclSuccess ? " on cuda:" + std::to_string(dev_[first_i]->device) : "") +
                            ": " + nccl_words(bad, dev_[first_i]->comm);
    check_async_errors_locked("enqueueing " + p.what);  // aborts when the communicator itself broke
    throw NcclError(msg);
  }
  // See Note [Non-blocking init and abort]: after ncclInProgress nothing may touch the comm streams
  // until the state is back to ncclSuccess. Blocking communicators never get here: their GroupEnd has
  // enqueued everything when it returns (See Note [Blocking collectives after a bounded init]).
  if (in_progress) poll_ready_locked(deadline, p.what + " (enqueue)");

  for (size_t i = 0; i < n; ++i) {
    Device& d = *dev_[i];
    cuda::DeviceGuard guard(d.device);
    if (p.postscale) cuda::divide_inplace(p.recv[i], static_cast<float>(divisor_), reinterpret_cast<uintptr_t>(d.stream));
    NCCLAVG_CUDA_CHECK(cudaEventRecord(op->done[i], d.stream));
  }
  op->seq = next_seq_++;
  const uint64_t seq = op->seq;
  ops_.push_back(std::move(op));
  return seq;
}

// ---- the public collectives ---------------------------------------------------------------------------

uint64_t NcclComm::all_reduce(const std::vector<Buffer>& buffers, const std::vector<uintptr_t>& after_streams,
                              bool predivide, const std::string& op, std::optional<double> timeout_s,
                              const std::string& tag) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    const bool average = parse_average(op);
    check_usable_locked(average ? "all_reduce_avg" : "all_reduce_sum");
    // the pointer checks below ask the runtime too: See Note [Device guard without a current context]
    cuda::DeviceGuard guard(devices_[0]);
    check_per_device(buffers, "buffers", devices_, true);
    check_distinct(buffers, "buffers");
    check_dtype_supported(buffers[0].dtype, "buffers");
    checked_streams(after_streams, dev_.size());
    if (timeout_s) checked_timeout(*timeout_s, "timeout_s");
    if (buffers[0].numel == 0) return 0;

    CollectivePlan p;
    p.kind = CollectivePlan::kAllReduce;
    p.name = average ? "all_reduce_avg" : "all_reduce_sum";
    p.send = p.recv = buffers;
    p.count = static_cast<size_t>(buffers[0].numel);
    p.dtype = buffers[0].dtype;
    p.bytes = buffers[0].nbytes();
    choose_reduction(p, size_, average, predivide, /*may_prescale=*/true, forced_reduction_);
    p.what = describe(p, tag, where());
    return run_locked(p, after_streams, timeout_s);
  } catch (...) {
    rethrow_after_abort();  // outside mu_: See Note [Abort on a helper thread] in comm.cpp
  }
}

uint64_t NcclComm::reduce_scatter(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                                  const std::vector<uintptr_t>& after_streams, bool predivide,
                                  const std::string& op, std::optional<double> timeout_s, const std::string& tag) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    const bool average = parse_average(op);
    check_usable_locked(average ? "reduce_scatter_avg" : "reduce_scatter_sum");
    // the pointer checks below ask the runtime too: See Note [Device guard without a current context]
    cuda::DeviceGuard guard(devices_[0]);
    check_sharded_pair(inputs, outputs, /*inputs_full=*/true, devices_, size_, ranks_);
    checked_streams(after_streams, dev_.size());
    if (timeout_s) checked_timeout(*timeout_s, "timeout_s");
    if (outputs[0].numel == 0) return 0;

    CollectivePlan p;
    p.kind = CollectivePlan::kReduceScatter;
    p.name = average ? "reduce_scatter_avg" : "reduce_scatter_sum";
    p.send = inputs;
    p.recv = outputs;
    p.count = static_cast<size_t>(outputs[0].numel);
    p.dtype = inputs[0].dtype;
    p.bytes = inputs[0].nbytes();
    choose_reduction(p, size_, average, predivide, /*may_prescale=*/false, forced_reduction_);
    p.what = describe(p, tag, where());
    return run_locked(p, after_streams, timeout_s);
  } catch (...) {
    rethrow_after_abort();  // outside mu_: See Note [Abort on a helper thread] in comm.cpp
  }
}

uint64_t NcclComm::all_gather(const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                              const std::vector<uintptr_t>& after_streams, std::optional<double> timeout_s,
                              const std::string& tag) {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked("all_gather");
    // the pointer checks below ask the runtime too: See Note [Device guard without a current context]
    cuda::DeviceGuard guard(devices_[0]);
    check_sharded_pair(inputs, outputs, /*inputs_full=*/false, devices_, size_, ranks_);
    checked_streams(after_streams, dev_.size());
    if (timeout_s) checked_timeout(*timeout_s, "timeout_s");
    if (inputs[0].numel == 0) return 0;

    CollectivePlan p;
    p.kind = CollectivePlan::kAllGather;
    p.name = "all_gather";
    p.send = inputs;
    p.recv = outputs;
    p.count = static_cast<size_t>(inputs[0].numel);
    p.dtype = inputs[0].dtype;
    p.bytes = outputs[0].nbytes();
    p.what = describe(p, tag, where());
    return run_locked(p, after_streams, timeout_s);
  } catch (...) {
    rethrow_after_abort();  // outside mu_: See Note [Abort on a helper thread] in comm.cpp
  }
}

}  // namespace nccl
}  // namespace ncclavg
