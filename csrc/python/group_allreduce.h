// The torch backend's `allreduce(tensors, opts)` for the calls its fast path takes, from the first look
// at `opts` to the finished Work, without running Python bytecode (Note [The backend's fast path] in
// ncclavg/process_group/fast_path.py). The group installs it as its own `allreduce` attribute; every
// call it does not take goes to the group's general path, unchanged.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>

#include "fast_all_reduce.h"

namespace ncclavg {
namespace py_glue {

namespace py = pybind11;

class GroupAllreduce {
 public:
  // sum, avg: the group's fast paths (SUM of the channel's float types, AVG of float32 / float64).
  // hooks: a Python object with these attributes (read once, here):
  //   group       a weak reference to the ProcessGroup (its `_allreduce(tensors, opts)` is the general path,
  //               `_fast_allreduce_failed(tensors, op, limit, error)` the failed Work of a failed round)
  //   done_work   done_work(tensors) -> the finished Work handed back
  //   record      the flight recorder's done(what, dtype, count), or None
  //   profiler    the module whose `_is_profiler_enabled` says torch's profiler runs (then: the general path)
  //   unset       the timeout torch's options hold when the caller gave none
  //   default_s   the group's timeout, in seconds
  //   async_ready_s   how long an async_op=True call looks for its peers before it is queued
  //   sum_hash, avg_hash   hash() of ReduceOp SUM and AVG (distinct from every other op: the group checks)
  //   sum_kind, avg_kind   RedOpType SUM and AVG, what the record names
  //   errors      the channel's failures, most derived first: (ShmMismatchError, ShmPeerError, CommTimeoutError)
  GroupAllreduce(FastAllReduce* sum, FastAllReduce* avg, py::handle hooks);
  py::object call(py::handle tensors, py::handle opts);
  // For good, when the group fails or shuts down: every call then takes the general path.
  void disable();

 private:
  py::object general(py::handle tensors, py::handle opts);
  py::object work(py::handle tensors);
  py::object failed(py::handle tensors, py::handle op, double limit, const char* what, int which);

  FastAllReduce* sum_;
  FastAllReduce* avg_;
  py::object group_, done_work_, record_, profiler_, unset_, errors_;
  double default_s_, async_ready_s_;
  bool enabled_ = true;
  Py_hash_t sum_hash_, avg_hash_;
  py::object s_async_, s_reduce_op_, s_timeout_, s_profiler_on_, s_total_seconds_, s_dtype_, s_all_reduce_,
      s_general_, s_failed_, s_result_;
  py::object last_work_, sum_what_, avg_what_;
};

}  // namespace py_glue
}  // namespace ncclavg
