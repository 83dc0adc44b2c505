// The module definition only: every function here forwards to the core. Calls that can take more than
// a few microseconds release the GIL.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>

#include "common/buffer.h"
#include "common/check.h"
#include "cpu/pack.h"
#include "cpu/optim.h"
#include "cpu/reduce.h"
#include "cpu/replica_hash.h"
#include "transport/host_lanes.h"
#include "transport/shm_channel.h"
#include "transport/ucx_api.h"
#include "cpu/simd.h"
#include "python/group_allreduce.h"
#include "python/fast_all_reduce.h"
#include "cuda/nccl_api.h"
#ifdef NCCLAVG_WITH_CUDA
#include "cuda/comm.h"
#include "cuda/cuda_ops.h"
#include "cuda/pack_cuda.h"
#endif

namespace py = pybind11;
using namespace ncclavg;

#ifndef NCCLAVG_CUDA_ARCHS
#define NCCLAVG_CUDA_ARCHS ""
#endif
#ifndef NCCLAVG_VERSION
#define NCCLAVG_VERSION "0.0.0"
#endif

namespace {

// A user call's tag from its two Python integers (Note [Call signatures] in csrc/transport/shm_calls.cpp).
cpu::ShmCallTag call_tag(uint64_t word, int64_t count) {
  cpu::ShmCallTag t;
  t.word = word;
  t.count = count;
  cpu::check_call_tag(t, "tag");
  return t;
}

// (calls ever logged, the last max_calls calls' earliest stamps, their ranks' lateness row by row), the
// stamps and lateness as native int64 ns in bytes: a log's copy for ncclavg/transport/stragglers.py.
py::tuple arrivals_of(const cpu::ArrivalLog& log, int64_t max_calls) {
  std::vector<int64_t> starts, late;
  uint64_t total;
  {
    py::gil_scoped_release nogil;
    total = log.copy(max_calls, starts, late);
  }
  return py::make_tuple(total, py::bytes(reinterpret_cast<const char*>(starts.data()), starts.size() * 8),
                        py::bytes(reinterpret_cast<const char*>(late.data()), late.size() * 8));
}

bool cuda_built() {
#ifdef NCCLAVG_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// check_finite (host buffers): whether every mean written is finite, None when nothing was written (one
// buffer) or not checked (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h).
std::optional<bool> average_(const std::vector<Buffer>& bufs, uintptr_t stream, bool check_finite) {
  if (!bufs.empty() && !bufs[0].on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
    cuda::average_inplace(bufs, stream);
    return std::nullopt;
#else
    NCCLAVG_CHECK_ARG(false, "buffers", "buffers[0] is on ", bufs[0].describe(),
                      " but this build of ncclavg has no CUDA support (rebuild with NCCLAVG_CUDA=1)");
#endif
  }
  const bool nonfinite = cpu::average_inplace(bufs, check_finite);
  if (!check_finite || bufs.size() < 2) return std::nullopt;
  return !nonfinite;
}

// What a checked host pass returns to Python: whether everything it wrote is finite (None: not checked).
std::optional<bool> finite_answer(bool checked, bool nonfinite) {
  return checked ? std::optional<bool>(!nonfinite) : std::nullopt;
}

py::dict nccl_info_dict(const nccl::LoadInfo& i) {
  py::dict d;
  d["loaded"] = i.loaded;
  d["path"] = i.path;
  d["source"] = i.source;
  d["version_code"] = i.version;
  d["version"] = i.loaded ? nccl::version_string(i.version) : std::string();
  d["error"] = i.error;
  return d;
}

py::dict core_info() {
  py::dict d;
  d["version"] = NCCLAVG_VERSION;
  d["cuda"] = cuda_built();
  d["cuda_archs"] = std::string(NCCLAVG_CUDA_ARCHS);
  d["simd_level"] = cpu::simd_level_name(cpu::current_simd_level());
  d["simd_best_supported"] = cpu::simd_level_name(cpu::simd_level_best_supported());
  d["openmp_threads"] = omp_get_max_threads();
  d["compiler"] = std::string(__VERSION__);
#ifdef NCCLAVG_WITH_CUDA
  cuda::RuntimeInfo r = cuda::runtime_info();
  d["cuda_runtime_version"] = r.runtime_version;
  d["driver_version"] = r.driver_version;
  d["driver_error"] = r.driver_error;
  d["device_count"] = r.device_count;
  d["device_names"] = r.device_names;
  d["device_capabilities"] = r.device_capabilities;
#endif
  return d;
}

}  // namespace

#ifdef NCCLAVG_WITH_CUDA
namespace {
// See Note [Teardown] in csrc/cuda/comm.cpp: the destructor may wait (bounded by the communicator's
// timeout) for collectives in flight, so Python's deallocation runs it without the GIL.
struct NcclCommDeleter {
  void operator()(nccl::NcclComm* c) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete c;
    } else {
      delete c;
    }
  }
};
using NcclCommHolder = std::unique_ptr<nccl::NcclComm, NcclCommDeleter>;

DType dtype_from_code(int code) {
  NCCLAVG_CHECK_TYPE(dtype_valid(code), "dtype", "unknown dtype code ", code, " (0 float32, 1 float16, 2 bfloat16)");
  return static_cast<DType>(code);
}
}  // namespace
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "ncclavg compiled core";

  py::register_exception<NcclError>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  auto comm_timeout_error = py::register_exception<TimeoutError>(m, "CommTimeoutError", PyExc_TimeoutError);
  py::register_exception<cpu::ShmTimeoutError>(m, "ShmTimeoutError", comm_timeout_error.ptr());
  auto shm_peer_error = py::register_exception<cpu::ShmPeerError>(m, "ShmPeerError", PyExc_RuntimeError);
  py::register_exception<cpu::ShmMismatchError>(m, "ShmMismatchError", shm_peer_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ncclavg::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  py::class_<Buffer>(m, "Buffer")
      .def(py::init([](uintptr_t ptr, int64_t numel, int dtype, int device, bool readonly) {
             NCCLAVG_CHECK_TYPE(dtype_valid(dtype), "dtype", "unknown dtype code ", dtype);
             // Name the constructor's own arguments; validate_buffer is the defence for every call.
             NCCLAVG_CHECK_ARG(numel >= 0, "numel", "must be >= 0, got ", numel);
             NCCLAVG_CHECK_ARG(numel == 0 || ptr != 0, "ptr", "is null but numel is ", numel);
             NCCLAVG_CHECK_ARG(device >= -1, "device", "must be -1 (cpu) or a CUDA ordinal, got ", device);
             Buffer b{ptr, numel, static_cast<DType>(dtype), device, readonly};
             validate_buffer(b, "Buffer");
             return b;
           }),
           py::arg("ptr"), py::arg("numel"), py::arg("dtype"), py::arg("device") = -1,
           py::arg("readonly") = false)
      .def_readonly("ptr", &Buffer::ptr)
      .def_readonly("numel", &Buffer::numel)
      .def_property_readonly("dtype", [](const Buffer& b) { return static_cast<int>(b.dtype); })
      .def_property_readonly("dtype_name", [](const Buffer& b) { return dtype_name(b.dtype); })
      .def_readonly("device", &Buffer::device)
      .def_readonly("readonly", &Buffer::readonly)
      .def_property_readonly("nbytes", &Buffer::nbytes)
      .def("__repr__", &Buffer::describe);

  m.def("average_", &average_, py::arg("buffers"), py::arg("stream") = 0, py::arg("check_finite") = false,
        py::call_guard<py::gil_scoped_release>(),
        "In-place mean of N equal buffers in one pass (fp32 accumulation); check_finite (host): returns "
        "whether every mean written is finite (None when nothing was written).");

#ifdef NCCLAVG_WITH_CUDA
  m.def("divide_", [](const Buffer& b, float divisor, uintptr_t stream) { cuda::divide_inplace(b, divisor, stream); },
        py::arg("buffer"), py::arg("divisor"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "In place on a device buffer: b / divisor in fp32, one rounding (the divide kernel of SUM + divide).");
  m.def("nccl_parse_test_reduction", [](const std::string& value) {
    std::string kind;
    int divisor = 0;
    nccl::parse_test_reduction(value, &kind, &divisor);
    return py::make_tuple(kind, divisor);
  }, py::arg("value"), "NCCLAVG_TEST_REDUCTION's value -> (kind, divisor; 0: the size). Tests only.");
#endif
  m.def("core_info", &core_info);
  m.def("nccl_load", [](const std::vector<std::string>& wheel_candidates) {
    const nccl::LoadInfo* i;
    {
      py::gil_scoped_release nogil;
      i = &nccl::load(wheel_candidates);
    }
    return nccl_info_dict(*i);
  }, py::arg("wheel_candidates"));
  m.def("nccl_multi_rank_gpu_refusal", [](int version_code, std::optional<std::string> env_value) {
    return nccl::multi_rank_gpu_refusal(version_code, env_value ? env_value->c_str() : nullptr);
  }, py::arg("version_code"), py::arg("env_value") = py::none(),
     "Why NCCL `version_code` with NCCL_MULTI_RANK_GPU_ENABLE=`env_value` (None: unset) refuses several ranks "
     "on one GPU, or '' when it allows them.");

  m.def("simd_level", [] { return cpu::simd_level_name(cpu::current_simd_level()); });
  m.def("set_simd_level", &cpu::set_simd_level, py::arg("level"),
        "Force the CPU kernel ISA: auto, scalar, avx2 or avx512 on x86-64, auto, scalar, neon or sve on aarch64 "
        "(must be supported by this CPU).");
  m.def("simd_levels_supported", [] {
    std::vector<std::string> out;
    for (auto l : cpu::simd_levels_of_arch())
      if (cpu::simd_level_supported(l)) out.emplace_back(cpu::simd_level_name(l));
    return out;
  });
  // ---- Gradient buckets: fused multi-tensor pack/unpack (one call per bucket, cast + scale fused) ----
  m.def("pack_",
        [](const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float scale,
           float divisor, uintptr_t stream, bool check_finite) -> std::optional<bool> {
          if (!dst.on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
            cuda::pack(srcs, dst, offsets, scale, divisor, stream);
            return std::nullopt;
#else
            NCCLAVG_CHECK_ARG(false, "dst", "is on ", dst.describe(), " but this build of ncclavg has no CUDA "
                              "support (rebuild with NCCLAVG_CUDA=1)");
#endif
          }
          return finite_answer(check_finite, cpu::pack(srcs, dst, offsets, scale, divisor, check_finite));
        },
        py::arg("srcs"), py::arg("dst"), py::arg("offsets"), py::arg("scale") = 1.0f, py::arg("divisor") = 1.0f,
        py::arg("stream") = 0, py::arg("check_finite") = false, py::call_guard<py::gil_scoped_release>(),
        "dst[offsets[i] : offsets[i] + srcs[i].numel] = srcs[i] * scale / divisor, cast to dst's dtype; "
        "one call for all tensors. check_finite (host): returns whether every value written is finite.");
  m.def("unpack_",
        [](const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float scale,
           float divisor, uintptr_t stream, bool check_finite) -> std::optional<bool> {
          if (!src.on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
            cuda::unpack(src, dsts, offsets, scale, divisor, stream);
            return std::nullopt;
#else
            NCCLAVG_CHECK_ARG(false, "src", "is on ", src.describe(), " but this build of ncclavg has no CUDA "
                              "support (rebuild with NCCLAVG_CUDA=1)");
#endif
          }
          return finite_answer(check_finite, cpu::unpack(src, dsts, offsets, scale, divisor, check_finite));
        },
        py::arg("src"), py::arg("dsts"), py::arg("offsets"), py::arg("scale") = 1.0f, py::arg("divisor") = 1.0f,
        py::arg("stream") = 0, py::arg("check_finite") = false, py::call_guard<py::gil_scoped_release>(),
        "dsts[i] = src[offsets[i] : offsets[i] + dsts[i].numel] * scale / divisor, cast to dsts[i]'s dtype; "
        "one call for all tensors. check_finite (host): returns whether every value written is finite.");

  // ---- Fused CPU optimizers (csrc/cpu/optim.h): AdamW/Adam, SGD, gradient statistics, fp32 copy-out.
  auto step_dict = [](const cpu::StepResult& r) {
    py::dict d;
    d["skipped"] = r.skipped;
    d["stats_computed"] = r.stats_computed;
    d["grad_norm"] = r.stats_computed ? r.grad_norm : std::numeric_limits<double>::quiet_NaN();
    d["sumsq"] = r.stats_computed ? r.sumsq : std::numeric_limits<double>::quiet_NaN();
    d["clip_coef"] = r.clip_coef;
    return d;
  };
  auto grad_options = [](double grad_scale, bool check_finite, std::optional<double> max_grad_norm,
                         double clip_coef, std::optional<double> sumsq_start, std::optional<bool> grads_finite) {
    cpu::GradOptions go;
    go.grad_scale = grad_scale;
    go.check_finite = check_finite;
    go.grads_finite = grads_finite;
    go.max_grad_norm = max_grad_norm;
    go.clip_coef = clip_coef;
    go.sumsq_start = sumsq_start;
    return go;
  };
  m.def("adam_step",
        [=](const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
            const std::vector<Buffer>& exp_avg, const std::vector<Buffer>& exp_avg_sq,
            const std::vector<Buffer>& max_exp_avg_sq, const std::vector<double>& steps,
            const std::vector<Buffer>& out, double lr, double beta1, double beta2, double eps,
            double weight_decay, bool decoupled, bool amsgrad, bool maximize, double grad_scale,
            bool check_finite, std::optional<double> max_grad_norm, double clip_coef,
            const std::vector<Buffer>& step_tensors, std::optional<double> sumsq_start,
            std::optional<bool> grads_finite) {
          cpu::AdamHyper hp{lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize};
          const cpu::GradOptions go =
              grad_options(grad_scale, check_finite, max_grad_norm, clip_coef, sumsq_start, grads_finite);
          cpu::StepResult r;
          {
            py::gil_scoped_release nogil;
            r = cpu::adam_step(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, out, hp, go,
                               step_tensors);
          }
          return step_dict(r);
        },
        py::arg("params"), py::arg("grads"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("max_exp_avg_sq"), py::arg("steps"), py::arg("out"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled") = true,
        py::arg("amsgrad") = false, py::arg("maximize") = false, py::arg("grad_scale") = 1.0,
        py::arg("check_finite") = false, py::arg("max_grad_norm") = py::none(), py::arg("clip_coef") = 1.0,
        py::arg("step_tensors") = std::vector<Buffer>{}, py::arg("sumsq_start") = py::none(),
        py::arg("grads_finite") = py::none(),
        "Fused AdamW (decoupled=True) / Adam step over fp32 segments; grads[tower][segment] averaged on "
        "the fly; steps (step numbers) or step_tensors (float32 counters, incremented unless skipped); "
        "sumsq_start: also sum the gradients' squares during the update, from this value; grads_finite: "
        "the finiteness of the grads as the pass that wrote them noted it (None: unknown). "
        "Returns {skipped, stats_computed, grad_norm, sumsq, clip_coef}.");
  m.def("sgd_step",
        [=](const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
            const std::vector<Buffer>& momentum_buffers, const std::vector<bool>& first,
            const std::vector<Buffer>& out, double lr, double momentum, double dampening,
            double weight_decay, bool nesterov, bool maximize, double grad_scale, bool check_finite,
            std::optional<double> max_grad_norm, double clip_coef, std::optional<double> sumsq_start,
            std::optional<bool> grads_finite) {
          cpu::SgdHyper hp{lr, momentum, dampening, weight_decay, nesterov, maximize};
          const cpu::GradOptions go =
              grad_options(grad_scale, check_finite, max_grad_norm, clip_coef, sumsq_start, grads_finite);
          cpu::StepResult r;
          {
            py::gil_scoped_release nogil;
            r = cpu::sgd_step(params, grads, momentum_buffers, first, out, hp, go);
          }
          return step_dict(r);
        },
        py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("first"), py::arg("out"),
        py::arg("lr"), py::arg("momentum") = 0.0, py::arg("dampening") = 0.0, py::arg("weight_decay") = 0.0,
        py::arg("nesterov") = false, py::arg("maximize") = false, py::arg("grad_scale") = 1.0,
        py::arg("check_finite") = false, py::arg("max_grad_norm") = py::none(), py::arg("clip_coef") = 1.0,
        py::arg("sumsq_start") = py::none(), py::arg("grads_finite") = py::none(),
        "Fused SGD (momentum, dampening, Nesterov) step over fp32 segments (arguments as adam_step's).");
  m.def("grad_stats",
        [](const std::vector<std::vector<Buffer>>& grads, double grad_scale, std::optional<double> max_grad_norm) {
          cpu::GradStats st;
          {
            py::gil_scoped_release nogil;
            st = cpu::grad_stats(grads, grad_scale, max_grad_norm);
          }
          py::dict d;
          d["sumsq"] = st.sumsq;
          d["grad_norm"] = st.norm;
          d["finite"] = st.finite;
          d["clip_coef"] = st.clip_coef;
          return d;
        },
        py::arg("grads"), py::arg("grad_scale") = 1.0, py::arg("max_grad_norm") = py::none(),
        "Global L2 norm (float64 accumulation) and finiteness of the averaged, unscaled grads[tower][segment].");
  m.def("grads_finite", &cpu::grads_finite, py::arg("grads"), py::arg("grad_scale") = 1.0,
        py::call_guard<py::gil_scoped_release>(),
        "grad_stats(grads, grad_scale)['finite'], from a scan of the raw bits when 1/grad_scale <= 1.");
  m.def("cast_copy", &cpu::cast_copy, py::arg("srcs"), py::arg("dsts"),
        py::call_guard<py::gil_scoped_release>(),
        "dsts[i] = srcs[i] (float32) rounded to dsts[i]'s dtype (nearest even).");
  m.def("digest", &cpu::digest_spans, py::arg("spans"), py::call_guard<py::gil_scoped_release>(),
        "The 64-bit digest of each span (address, bytes) of host memory, then of all of them in order "
        "(Note [Replica digest] in csrc/cpu/replica_hash.h): equal bytes give equal digests on every process. "
        "The caller keeps the memory alive.");

  // ---- shared-memory channel between the processes of one host (csrc/transport/shm_channel.h)
  {
    using cpu::ShmChannel;
    using Release = py::call_guard<py::gil_scoped_release>;
    // The small-message fast path (ncclavg/comm/fast_average.py): the GIL is held unless the call has to wait.
    py::class_<py_glue::ShmExec>(m, "ShmExec")
        .def(py::init<>())
        .def("acquire", &py_glue::ShmExec::acquire, py::arg("blocking") = true)
        .def("release", &py_glue::ShmExec::release)
        .def("__enter__", [](py_glue::ShmExec& e) { e.acquire(true); })
        .def("__exit__", [](py_glue::ShmExec& e, py::args) { e.release(); })
        .def("add_outstanding", &py_glue::ShmExec::add_outstanding, py::arg("delta"))
        .def_property_readonly("outstanding", &py_glue::ShmExec::outstanding);
    // Note [An asynchronous call whose peers wait] in csrc/transport/shm_channel.cpp
    m.attr("SHM_ASYNC_INLINE_BYTES") = py_glue::FastAllReduce::kAsyncInlineBytes;
    py::class_<py_glue::FastAllReduce>(m, "FastAllReduce")
        .def(py::init<ShmChannel*, py_glue::ShmExec*, py::object>(), py::arg("channel"), py::arg("exec"),
             py::arg("prepare"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
        .def(py::init<cpu::HostLanes*, py_glue::ShmExec*, py::object>(), py::arg("lanes"), py::arg("exec"),
             py::arg("prepare"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
        .def("run", [](py_glue::FastAllReduce& f, py::handle tensors, double timeout_s) { return f.run(tensors, timeout_s); },
             py::arg("tensors"), py::arg("timeout_s"),
             "the all-reduce of tensors[0] (through the channel or the lanes): True when done, False for the "
             "general path")
        .def("run_async",
             [](py_glue::FastAllReduce& f, py::handle tensors, double timeout_s, double ready_wait_s) -> py::object {
               bool nonfinite = false;
               if (!f.run(tensors, timeout_s, nullptr, ready_wait_s, &nonfinite)) return py::none();
               return py::bool_(!nonfinite);
             },
             py::arg("tensors"), py::arg("timeout_s"), py::arg("ready_wait_s"),
             "an asynchronous all-reduce of tensors[0] through the channel, run now when it is small and its peers "
             "are in it within ready_wait_s: whether every value it wrote is finite; None for the general path")
        .def("record_to", &py_glue::FastAllReduce::record_to, py::arg("recorder"), py::arg("what"),
             py::arg("done_word"), "write every call it runs into a flight Recorder's ring, as Recorder.done")
        .def("disable", &py_glue::FastAllReduce::disable)
        .def_property_readonly("cached", &py_glue::FastAllReduce::cached);
    // The torch backend's allreduce for the calls the fast path takes (ncclavg/process_group/fast_path.py)
    py::class_<py_glue::GroupAllreduce>(m, "GroupAllreduce")
        .def(py::init<py_glue::FastAllReduce*, py_glue::FastAllReduce*, py::handle>(), py::arg("sum"), py::arg("avg"),
             py::arg("hooks"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
        .def("__call__", &py_glue::GroupAllreduce::call, py::arg("tensors"), py::arg("opts") = py::none())
        .def("disable", &py_glue::GroupAllreduce::disable);
    py::class_<ShmChannel>(m, "ShmChannel")
        .def(py::init<const std::string&, int, int, int64_t, uint64_t, std::vector<int>>(), py::arg("name"),
             py::arg("rank"), py::arg("nranks"), py::arg("slot_bytes"), py::arg("nonce"),
             py::arg("labels") = std::vector<int>(), Release(),
             "Rank 0 creates the segment and opens the door `name`; the others join through it "
             "(Note [Shared-memory channel], Note [Segment without a name]).")
        .def("close_door", &ShmChannel::close_door, Release())
        .def("peers_ready", &ShmChannel::peers_ready, py::arg("max_wait_s"),
             "True when every peer has posted the round this rank posts next (Note [An asynchronous call "
             "whose peers wait]); call it holding the channel's order. Holds the GIL: max_wait_s is short.")
        // tag, tag_count: the user's call (Note [Call signatures] in csrc/transport/shm_calls.cpp)
        .def("all_reduce_sum",
             [](ShmChannel& c, uintptr_t data, int64_t count, int type, double timeout_s, double mul, double div,
                uint64_t tag, int64_t tag_count, bool check_finite) {
               bool nonfinite = false;
               c.all_reduce_sum(data, count, type, timeout_s, mul, div, call_tag(tag, tag_count),
                                check_finite ? &nonfinite : nullptr);
               return finite_answer(check_finite, nonfinite);
             },
             py::arg("data"), py::arg("count"), py::arg("type"), py::arg("timeout_s"), py::arg("mul") = 1.0,
             py::arg("div") = 1.0, py::arg("tag") = 0, py::arg("tag_count") = 0, py::arg("check_finite") = false,
             Release(), "check_finite: returns whether every value written is finite (the same on every rank).")
        .def("reduce_scatter_sum",
             [](ShmChannel& c, uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, double mul,
                double div, uint64_t tag, int64_t tag_count, bool check_finite) {
               bool nonfinite = false;
               c.reduce_scatter_sum(in, out, count, type, timeout_s, mul, div, call_tag(tag, tag_count),
                                    check_finite ? &nonfinite : nullptr);
               return finite_answer(check_finite, nonfinite);
             },
             py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("type"), py::arg("timeout_s"),
             py::arg("mul") = 1.0, py::arg("div") = 1.0, py::arg("tag") = 0, py::arg("tag_count") = 0,
             py::arg("check_finite") = false, Release())
        .def("all_gather",
             [](ShmChannel& c, uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, uint64_t tag,
                int64_t tag_count) { c.all_gather(in, out, count, type, timeout_s, call_tag(tag, tag_count)); },
             py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("type"), py::arg("timeout_s"),
             py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("broadcast",
             [](ShmChannel& c, uintptr_t data, int64_t count, int type, int root, double timeout_s, uint64_t tag,
                int64_t tag_count) { c.broadcast(data, count, type, root, timeout_s, call_tag(tag, tag_count)); },
             py::arg("data"), py::arg("count"), py::arg("type"), py::arg("root"), py::arg("timeout_s"),
             py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("barrier",
             [](ShmChannel& c, double timeout_s, uint64_t tag, int64_t tag_count) {
               c.barrier(timeout_s, call_tag(tag, tag_count));
             },
             py::arg("timeout_s"), py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("abort", &ShmChannel::abort, py::arg("why"), py::arg("mismatch") = false)
        .def("resident_slot_bytes", &ShmChannel::resident_slot_bytes, py::arg("r"))
        .def_property_readonly("rank", &ShmChannel::rank)
        .def_property_readonly("nranks", &ShmChannel::nranks)
        .def_property_readonly("waiting_on", &ShmChannel::waiting_on)
        .def_property_readonly("slot_bytes", &ShmChannel::slot_bytes)
        .def_property_readonly("collectives", &ShmChannel::collectives)
        .def_property_readonly("labels", &ShmChannel::labels)
        .def("begin_one_call", &ShmChannel::begin_one_call,
             "The channel collectives until end_one_call() serve one user call: only the first logs its "
             "arrivals (Note [Arrival times] in csrc/transport/shm_arrivals.h).")
        .def("end_one_call", &ShmChannel::end_one_call)
        .def(
            "arrivals", [](const ShmChannel& c, int64_t max_calls) { return arrivals_of(c.arrivals(), max_calls); },
            py::arg("max_calls") = -1,
            "(calls ever logged, the last max_calls calls' earliest start stamps, their ranks' lateness), the "
            "stamps and lateness as native int64 ns in bytes, lateness row by row (Note [Arrival times] in "
            "csrc/transport/shm_arrivals.h).");
    // The lanes between hosts on UCX (ncclavg/transport/ucx.py; Note [Lanes between hosts]).
    m.def("ucx_load", [](const std::vector<std::string>& candidates) {
      const ucx::LoadInfo* found;
      {
        py::gil_scoped_release nogil;
        found = &ucx::load(candidates);
      }
      const ucx::LoadInfo& i = *found;
      py::dict d;
      d["loaded"] = i.loaded;
      d["path"] = i.path;
      d["version"] = i.version;
      d["error"] = i.error;
      return d;
    }, py::arg("candidates"), "Loads libucp from the first loadable candidate, once per process.");
    m.attr("HOSTS_WHOLE_BYTES") = cpu::HostLanes::kWholeBytes;
    py::class_<cpu::LaneLayout>(m, "LaneLayout")
        .def(py::init<std::vector<std::vector<int>>, int>(), py::arg("hosts"), py::arg("rank"))
        .def_readonly("hosts", &cpu::LaneLayout::hosts)
        .def_readonly("rank", &cpu::LaneLayout::rank)
        .def_readonly("lanes", &cpu::LaneLayout::lanes)
        .def_readonly("host", &cpu::LaneLayout::host)
        .def_readonly("local", &cpu::LaneLayout::local)
        .def_property_readonly("local_size", &cpu::LaneLayout::local_size)
        .def("lanes_of", &cpu::LaneLayout::lanes_of, py::arg("local"))
        .def("carrier", &cpu::LaneLayout::carrier, py::arg("host"), py::arg("lane"))
        .def("slice_owner", &cpu::LaneLayout::slice_owner, py::arg("host"), py::arg("lane"))
        .def("peers", &cpu::LaneLayout::peers);
    py::class_<cpu::HostLanes>(m, "HostLanes")
        .def(py::init<std::vector<std::vector<int>>, int, ShmChannel*, const std::string&, const std::string&, int64_t,
                      int, int64_t, int64_t>(),
             py::arg("hosts"), py::arg("rank"), py::arg("channel"), py::arg("tls"), py::arg("devices"),
             py::arg("chunk_bytes"), py::arg("depth"), py::arg("spin_us") = cpu::HostLanes::kSpinUs,
             py::arg("slow_chunk_us") = cpu::HostLanes::kSlowChunkUs, py::keep_alive<1, 4>(), Release())
        .def_property_readonly("address", [](const cpu::HostLanes& h) { return py::bytes(h.address()); })
        .def_property_readonly("ucx_settings", &cpu::HostLanes::ucx_settings)
        .def_property_readonly("spin_us", &cpu::HostLanes::spin_us)
        .def_property_readonly("chunk_us", &cpu::HostLanes::chunk_us)
        .def_property_readonly("wait_window_us", &cpu::HostLanes::wait_window_us)
        .def_readonly_static("SPIN_US", &cpu::HostLanes::kSpinUs)
        .def_readonly_static("MAX_SPIN_US", &cpu::HostLanes::kMaxSpinUs)
        .def_readonly_static("SLOW_SPIN_US", &cpu::HostLanes::kSlowSpinUs)
        .def_readonly_static("SLOW_CHUNK_US", &cpu::HostLanes::kSlowChunkUs)
        .def("peers", [](const cpu::HostLanes& h) { return h.layout().peers(); })
        .def("connect",
             [](cpu::HostLanes& h, const std::vector<py::bytes>& addresses, double timeout_s) {
               std::vector<std::string> a(addresses.begin(), addresses.end());
               py::gil_scoped_release nogil;
               h.connect(a, timeout_s);
             },
             py::arg("addresses"), py::arg("timeout_s"))
        .def("all_reduce_sum",
             [](cpu::HostLanes& h, uintptr_t data, int64_t count, int type, double timeout_s, uint64_t tag,
                int64_t tag_count, double div) {
               h.all_reduce_sum(data, count, type, timeout_s, call_tag(tag, tag_count), div);
             },
             py::arg("data"), py::arg("count"), py::arg("type"), py::arg("timeout_s"), py::arg("tag") = 0,
             py::arg("tag_count") = 0, py::arg("div") = 1.0, Release())
        .def("broadcast",
             [](cpu::HostLanes& h, uintptr_t data, int64_t count, int type, int root, double timeout_s, uint64_t tag,
                int64_t tag_count) { h.broadcast(data, count, type, root, timeout_s, call_tag(tag, tag_count)); },
             py::arg("data"), py::arg("count"), py::arg("type"), py::arg("root"), py::arg("timeout_s"),
             py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("all_gather",
             [](cpu::HostLanes& h, uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, uint64_t tag,
                int64_t tag_count) { h.all_gather(in, out, count, type, timeout_s, call_tag(tag, tag_count)); },
             py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("type"), py::arg("timeout_s"),
             py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("reduce_scatter_sum",
             [](cpu::HostLanes& h, uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s,
                uint64_t tag, int64_t tag_count) {
               h.reduce_scatter_sum(in, out, count, type, timeout_s, call_tag(tag, tag_count));
             },
             py::arg("inp"), py::arg("out"), py::arg("count"), py::arg("type"), py::arg("timeout_s"),
             py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("check",
             [](cpu::HostLanes& h, double timeout_s, uint64_t tag, int64_t tag_count) {
               h.check(timeout_s, call_tag(tag, tag_count));
             },
             py::arg("timeout_s"), py::arg("tag") = 0, py::arg("tag_count") = 0, Release())
        .def("abort", &cpu::HostLanes::abort, py::arg("why"))
        .def_property_readonly("failed", &cpu::HostLanes::failed)
        .def_property_readonly("failure", &cpu::HostLanes::failure)
        .def_property_readonly("waiting_on", &cpu::HostLanes::waiting_on)
        .def_property_readonly("calls", &cpu::HostLanes::calls)
        .def_property_readonly("messages_sent", &cpu::HostLanes::messages_sent)
        .def_property_readonly("chunk_bytes", &cpu::HostLanes::chunk_bytes)
        .def_property_readonly("depth", &cpu::HostLanes::depth)
        .def_property_readonly("labels", [](const cpu::HostLanes& h) { return h.arrivals().labels(); })
        .def("begin_one_call", &cpu::HostLanes::begin_one_call,
             "The calls between hosts until end_one_call() serve one user call: only the first logs its "
             "arrivals (Note [Arrival times between hosts] in csrc/transport/host_arrivals.h).")
        .def("end_one_call", &cpu::HostLanes::end_one_call)
        .def(
            "arrivals",
            [](const cpu::HostLanes& h, int64_t max_calls) { return arrivals_of(h.arrivals().log(), max_calls); },
            py::arg("max_calls") = -1,
            "As ShmChannel.arrivals, over every rank of every host, on this process's clock (Note [Arrival "
            "times between hosts] in csrc/transport/host_arrivals.h).")
        .def(
            "clock_offset",
            [](const cpu::HostLanes& h, int peer) {
              NCCLAVG_CHECK_ARG(peer >= 0 && peer < static_cast<int>(h.arrivals().labels().size()) &&
                                    h.layout().host != h.layout().host_of(peer),
                                "peer", "must be a rank of another host, got ", peer);
              const int64_t off = h.arrivals().offset_of(peer);
              return off == cpu::LaneHello::kUnknown ? py::object(py::none()) : py::object(py::int_(off));
            },
            py::arg("peer"),
            "The estimate of peer's clock to this process's in ns (add it to a stamp of theirs), None before "
            "there is one: Note [Arrival times between hosts].");
    m.def("dtype_codes", [] {
      static_assert(static_cast<int>(cpu::ShmType::kFloat32) == static_cast<int>(DType::kFloat32) &&
                        static_cast<int>(cpu::ShmType::kFloat16) == static_cast<int>(DType::kFloat16) &&
                        static_cast<int>(cpu::ShmType::kBFloat16) == static_cast<int>(DType::kBFloat16),
                    "the channel's codes extend the core's");
      py::dict d;
      for (int code = 0; code < cpu::kShmTypeCount; ++code) d[cpu::type_name(static_cast<cpu::ShmType>(code))] = code;
      return d;
    }, "The element types of the core and their codes: a Buffer takes float32, float16 and bfloat16; the "
       "shared-memory channel float64 too (ncclavg/buffers.py builds its tables from this one).");
    m.def("shm_call_names", [] {
      py::dict d;
      d["collectives"] = cpu::shm_collective_names();
      d["dtypes"] = cpu::shm_dtype_names();
      d["ops"] = cpu::shm_op_names();
      return d;
    }, "The tables behind a call tag's codes (Note [Call signatures] in csrc/transport/shm_calls.cpp).");
    m.def("shm_describe_call", [](uint64_t tag, int64_t tag_count) {
      const cpu::ShmCallTag t = call_tag(tag, tag_count);
      return cpu::describe_call(t);
    }, py::arg("tag"), py::arg("tag_count"), "A call tag in words, as the channel's errors give it.");
  }

#ifdef NCCLAVG_WITH_CUDA
  // ---- NCCL communicator (csrc/cuda/comm.h). Present only in CUDA builds: hasattr(_C, "NcclComm").
  // NCCL must be loaded first: ncclavg._ext.require_nccl() (Python does it before creating comms).
  using nccl::NcclComm;
  using Release = py::call_guard<py::gil_scoped_release>;
  m.def("nccl_unique_id", [] {
    std::string id;
    {
      py::gil_scoped_release nogil;
      id = NcclComm::unique_id();
    }
    return py::bytes(id);
  }, "A fresh 128-byte ncclUniqueId for NcclComm.init_rank (rank 0 makes it, every rank uses it).");

  py::class_<NcclComm, NcclCommHolder>(m, "NcclComm")
      .def_static("init_all", [](const std::vector<int>& devices, double timeout_s) {
             return NcclCommHolder(NcclComm::init_all(devices, timeout_s).release());
           }, py::arg("devices"), py::arg("timeout_s"), Release(),
           "One process over several CUDA devices, one rank per entry (non-blocking NCCL init, bounded by timeout_s).")
      .def_static("init_rank", [](const std::string& unique_id, int nranks, int rank, int device, double timeout_s) {
             return NcclCommHolder(NcclComm::init_rank(unique_id, nranks, rank, device, timeout_s).release());
           }, py::arg("unique_id"), py::arg("nranks"), py::arg("rank"), py::arg("device"), py::arg("timeout_s"),
           Release(), "One rank of a multi-process communicator.")
      .def_static("init_ranks", [](const std::string& unique_id, int nranks, int first_rank,
                                   const std::vector<int>& devices, double timeout_s) {
             return NcclCommHolder(NcclComm::init_ranks(unique_id, nranks, first_rank, devices, timeout_s).release());
           }, py::arg("unique_id"), py::arg("nranks"), py::arg("first_rank"), py::arg("devices"), py::arg("timeout_s"),
           Release(), "This process's towers of a multi-process communicator: ranks first_rank.. on `devices`, in one "
           "group (ranks numbered process-major).")
      .def_property_readonly("size", &NcclComm::size)
      .def_property_readonly("local_size", &NcclComm::local_size)
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("ranks", &NcclComm::ranks)
      .def_property_readonly("devices", &NcclComm::devices)
      .def_property_readonly("nccl_version", &NcclComm::nccl_version)
      .def_property_readonly("nccl_version_string", [](const NcclComm& c) { return nccl::version_string(c.nccl_version()); })
      .def_property_readonly("timeout", &NcclComm::timeout)
      .def_property_readonly("collective_mode", &NcclComm::collective_mode,
                             "'blocking' or 'nonblocking': the communicators the collectives run on.")
      .def_property_readonly("collective_mode_reason", &NcclComm::collective_mode_reason)
      // These take the communicator's mutex, which an enqueue holds while it polls NCCL: drop the GIL.
      .def_property_readonly("aborted", [](const NcclComm& c) { py::gil_scoped_release g; return c.aborted(); })
      .def_property_readonly("destroyed", [](const NcclComm& c) { py::gil_scoped_release g; return c.destroyed(); })
      .def_property_readonly("abort_reason", [](const NcclComm& c) {
             std::string r;
             {
               py::gil_scoped_release g;
               r = c.abort_reason();
             }
             return r;
           })
      .def_property_readonly("streams", [](const NcclComm& c) {
             std::vector<uintptr_t> s;
             {
               py::gil_scoped_release g;
               s = c.streams();
             }
             return s;
           })
      .def_property_readonly("pending", [](NcclComm& c) { py::gil_scoped_release g; return c.pending(); })
      .def("reduction", [](const NcclComm& c, int dtype, bool predivide, const std::string& op, bool all_reduce) {
             return c.reduction(dtype_from_code(dtype), predivide, op, all_reduce);
           }, py::arg("dtype"), py::arg("predivide") = false, py::arg("op") = "avg", py::arg("all_reduce") = true,
           "The NCCL reduction a collective of this dtype would use, e.g. 'ncclAvg' or 'ncclSum + divide by 3'.")
      .def("all_reduce_avg", [](NcclComm& c, const std::vector<Buffer>& buffers, const std::vector<uintptr_t>& after_streams,
                                bool predivide, std::optional<double> timeout_s, const std::string& tag) {
             return c.all_reduce(buffers, after_streams, predivide, "avg", timeout_s, tag);
           }, py::arg("buffers"), py::arg("after_streams") = std::vector<uintptr_t>{}, py::arg("predivide") = false,
           py::arg("timeout_s") = py::none(), py::arg("tag") = "", Release(),
           "In place, one buffer per local device: the mean over all ranks. Returns the sequence number.")
      .def("all_reduce_sum", [](NcclComm& c, const std::vector<Buffer>& buffers, const std::vector<uintptr_t>& after_streams,
                                std::optional<double> timeout_s, const std::string& tag) {
             return c.all_reduce(buffers, after_streams, false, "sum", timeout_s, tag);
           }, py::arg("buffers"), py::arg("after_streams") = std::vector<uintptr_t>{},
           py::arg("timeout_s") = py::none(), py::arg("tag") = "", Release())
      .def("reduce_scatter_avg", [](NcclComm& c, const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                                    const std::vector<uintptr_t>& after_streams, bool predivide,
                                    std::optional<double> timeout_s, const std::string& tag) {
             return c.reduce_scatter(inputs, outputs, after_streams, predivide, "avg", timeout_s, tag);
           }, py::arg("inputs"), py::arg("outputs"), py::arg("after_streams") = std::vector<uintptr_t>{},
           py::arg("predivide") = false, py::arg("timeout_s") = py::none(), py::arg("tag") = "", Release())
      .def("reduce_scatter_sum", [](NcclComm& c, const std::vector<Buffer>& inputs, const std::vector<Buffer>& outputs,
                                    const std::vector<uintptr_t>& after_streams, std::optional<double> timeout_s,
                                    const std::string& tag) {
             return c.reduce_scatter(inputs, outputs, after_streams, false, "sum", timeout_s, tag);
           }, py::arg("inputs"), py::arg("outputs"), py::arg("after_streams") = std::vector<uintptr_t>{},
           py::arg("timeout_s") = py::none(), py::arg("tag") = "", Release())
      .def("all_gather", &NcclComm::all_gather, py::arg("inputs"), py::arg("outputs"),
           py::arg("after_streams") = std::vector<uintptr_t>{}, py::arg("timeout_s") = py::none(),
           py::arg("tag") = "", Release())
      .def("wait", &NcclComm::wait, py::arg("timeout_s") = py::none(), py::arg("seq") = 0, Release(),
           "Host waits for collective `seq` (0: all enqueued); on timeout aborts and raises CommTimeoutError.")
      .def("done", &NcclComm::done, py::arg("seq") = 0, Release())
      .def("stream_wait", &NcclComm::stream_wait, py::arg("streams"), py::arg("seq") = 0, Release(),
           "Orders `streams` (one per local device) after collective `seq` (0: the last enqueued), with "
           "events; the host does not wait.")
      .def("abort", &NcclComm::abort, Release())
      .def("destroy", &NcclComm::destroy, Release())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](NcclComm& c, py::args) {
             py::gil_scoped_release nogil;
             c.destroy();
           })
      .def("__repr__", [](NcclComm& c) {
             std::string state;
             {
               py::gil_scoped_release g;
               state = c.aborted() ? "aborted" : c.destroyed() ? "destroyed" : "active";
             }
             std::string devs;
             for (size_t i = 0; i < c.devices().size(); ++i) devs += (i ? ", " : "") + std::to_string(c.devices()[i]);
             return "NcclComm(size=" + std::to_string(c.size()) + ", rank=" + std::to_string(c.rank()) +
                    ", devices=[" + devs + "], nccl=" + nccl::version_string(c.nccl_version()) + ", " +
                    c.collective_mode() + " collectives, " + state + ")";
           });
#endif
}
