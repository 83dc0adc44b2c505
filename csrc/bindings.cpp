// The module definition only: every function here forwards to the core. Calls that can take more than
// a few microseconds release the GIL.
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/buffer.h"
#include "common/check.h"
#include "cpu/pack.h"
#include "cpu/reduce.h"
#include "cpu/simd.h"
#include "cuda/nccl_api.h"
#ifdef NCCLAVG_WITH_CUDA
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

bool cuda_built() {
#ifdef NCCLAVG_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void average_(const std::vector<Buffer>& bufs, uintptr_t stream) {
  if (!bufs.empty() && !bufs[0].on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
    cuda::average_inplace(bufs, stream);
    return;
#else
    NCCLAVG_CHECK_ARG(false, "buffers", "buffers[0] is on ", bufs[0].describe(),
                      " but this build of ncclavg has no CUDA support (rebuild with NCCLAVG_CUDA=1)");
#endif
  }
  cpu::average_inplace(bufs);
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "ncclavg compiled core";

  py::register_exception<NcclError>(m, "NcclError", PyExc_RuntimeError);
  py::register_exception<CudaError>(m, "CudaError", PyExc_RuntimeError);
  py::register_exception<TimeoutError>(m, "CommTimeoutError", PyExc_TimeoutError);
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

  m.def("average_", &average_, py::arg("buffers"), py::arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "In-place mean of N equal buffers in one pass (fp32 accumulation).");

  m.def("core_info", &core_info);
  m.def("nccl_load", [](const std::vector<std::string>& wheel_candidates) {
    const nccl::LoadInfo* i;
    {
      py::gil_scoped_release nogil;
      i = &nccl::load(wheel_candidates);
    }
    return nccl_info_dict(*i);
  }, py::arg("wheel_candidates"));

  m.def("simd_level", [] { return cpu::simd_level_name(cpu::current_simd_level()); });
  m.def("set_simd_level", &cpu::set_simd_level, py::arg("level"),
        "Force the CPU kernel ISA: auto, scalar, avx2 or avx512 (must be supported by this CPU).");
  m.def("simd_levels_supported", [] {
    std::vector<std::string> out;
    for (auto l : {cpu::SimdLevel::kScalar, cpu::SimdLevel::kAvx2, cpu::SimdLevel::kAvx512})
      if (cpu::simd_level_supported(l)) out.emplace_back(cpu::simd_level_name(l));
    return out;
  });
  // ---- Gradient buckets: fused multi-tensor pack/unpack (one call per bucket, cast + scale fused) ----
  m.def("pack_",
        [](const std::vector<Buffer>& srcs, const Buffer& dst, const std::vector<int64_t>& offsets, float scale,
           float divisor, uintptr_t stream) {
          if (!dst.on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
            cuda::pack(srcs, dst, offsets, scale, divisor, stream);
            return;
#else
            NCCLAVG_CHECK_ARG(false, "dst", "is on ", dst.describe(), " but this build of ncclavg has no CUDA "
                              "support (rebuild with NCCLAVG_CUDA=1)");
#endif
          }
          cpu::pack(srcs, dst, offsets, scale, divisor);
        },
        py::arg("srcs"), py::arg("dst"), py::arg("offsets"), py::arg("scale") = 1.0f, py::arg("divisor") = 1.0f,
        py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "dst[offsets[i] : offsets[i] + srcs[i].numel] = srcs[i] * scale / divisor, cast to dst's dtype; "
        "one call for all tensors.");
  m.def("unpack_",
        [](const Buffer& src, const std::vector<Buffer>& dsts, const std::vector<int64_t>& offsets, float scale,
           float divisor, uintptr_t stream) {
          if (!src.on_cpu()) {
#ifdef NCCLAVG_WITH_CUDA
            cuda::unpack(src, dsts, offsets, scale, divisor, stream);
            return;
#else
            NCCLAVG_CHECK_ARG(false, "src", "is on ", src.describe(), " but this build of ncclavg has no CUDA "
                              "support (rebuild with NCCLAVG_CUDA=1)");
#endif
          }
          cpu::unpack(src, dsts, offsets, scale, divisor);
        },
        py::arg("src"), py::arg("dsts"), py::arg("offsets"), py::arg("scale") = 1.0f, py::arg("divisor") = 1.0f,
        py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "dsts[i] = src[offsets[i] : offsets[i] + dsts[i].numel] * scale / divisor, cast to dsts[i]'s dtype; "
        "one call for all tensors.");
}
