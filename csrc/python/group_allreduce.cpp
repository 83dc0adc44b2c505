// See group_allreduce.h and Note [The backend's fast path] in ncclavg/process_group/fast_path.py. The
// same steps as the Python they replace, in the same order: each attribute read here costs what the
// attribute's own getter costs, without the ~60 ns of bytecode around it, and the call to this object
// is the only Python call between torch and the channel.
#include "group_allreduce.h"

#include <exception>

#include "../common/check.h"
#include "../transport/shm_channel.h"

namespace ncclavg {
namespace py_glue {

namespace {
// A new reference to attribute `name` of `obj`; throws error_already_set when there is none.
py::object attr(py::handle obj, const py::object& name) {
  PyObject* got = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (got == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(got);
}

bool truthy(const py::object& value) {
  int yes = PyObject_IsTrue(value.ptr());
  if (yes < 0) throw py::error_already_set();
  return yes != 0;
}
}  // namespace

GroupAllreduce::GroupAllreduce(FastAllReduce* sum, FastAllReduce* avg, py::handle hooks)
    : sum_(sum),
      avg_(avg),
      group_(hooks.attr("group")),
      done_work_(hooks.attr("done_work")),
      record_(hooks.attr("record")),
      profiler_(hooks.attr("profiler")),
      unset_(hooks.attr("unset")),
      errors_(hooks.attr("errors")),
      default_s_(hooks.attr("default_s").cast<double>()),
      async_ready_s_(hooks.attr("async_ready_s").cast<double>()),
      sum_hash_(hooks.attr("sum_hash").cast<Py_hash_t>()),
      avg_hash_(hooks.attr("avg_hash").cast<Py_hash_t>()),
      s_async_(py::str("asyncOp")),
      s_reduce_op_(py::str("reduceOp")),
      s_timeout_(py::str("timeout")),
      s_profiler_on_(py::str("_is_profiler_enabled")),
      s_total_seconds_(py::str("total_seconds")),
      s_dtype_(py::str("dtype")),
      s_all_reduce_(py::str("all_reduce")),
      s_general_(py::str("_allreduce")),
      s_failed_(py::str("_fast_allreduce_failed")),
      s_result_(py::str("_result")) {
  // what the recorder stores: ("all_reduce", RedOpType, None), made once (a ReduceOp read from the options
  // is a new object each call, whose release from the ring would cost more than the record)
  sum_what_ = py::make_tuple(s_all_reduce_, hooks.attr("sum_kind"), py::none());
  avg_what_ = py::make_tuple(s_all_reduce_, hooks.attr("avg_kind"), py::none());
  if (py::len(errors_) != 4) throw std::invalid_argument("hooks.errors: expected 4 exception types");
}

// The group's general path: the group is alive while torch calls this (it holds the group), so a
// dead reference means this object was called on its own after the group went.
py::object GroupAllreduce::general(py::handle tensors, py::handle opts) {
  py::object group = group_();
  if (group.is_none()) throw std::runtime_error("ncclavg allreduce: the process group no longer exists");
  return group.attr(s_general_)(tensors, opts);
}

// The failed Work of a round that failed with error `which` (an index into errors_: mismatch, peer, the
// channel's timeout, the lanes' timeout).
py::object GroupAllreduce::failed(py::handle tensors, py::handle op, double limit, const char* what, int which) {
  py::object error = errors_[py::int_(which)](py::str(what));
  py::object group = group_();
  if (group.is_none()) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw py::error_already_set();
  }
  return group.attr(s_failed_)(tensors, op, limit, error);
}

void GroupAllreduce::disable() {
  enabled_ = false;
  last_work_ = py::object();
}

py::object GroupAllreduce::call(py::handle tensors, py::handle opts) {
  if (!enabled_ || opts.is_none() || truthy(attr(profiler_, s_profiler_on_))) return general(tensors, opts);
  // async_op=True: here only when its peers are already in it (Note [An asynchronous call whose peers
  // wait] in csrc/transport/shm_channel.cpp), else queued by the general path
  const double ready_wait = truthy(attr(opts, s_async_)) ? async_ready_s_ : -1.0;
  py::object op = attr(opts, s_reduce_op_);
  Py_hash_t h = PyObject_Hash(op.ptr());
  if (h == -1) throw py::error_already_set();
  FastAllReduce* path = h == sum_hash_ ? sum_ : h == avg_hash_ ? avg_ : nullptr;
  if (path == nullptr) return general(tensors, opts);
  // the call's timeout as group.py's call_limit reads it: torch's per-call option when set, else the group's
  double limit = default_s_;
  py::object timeout = attr(opts, s_timeout_);
  int unset = PyObject_RichCompareBool(timeout.ptr(), unset_.ptr(), Py_EQ);
  if (unset < 0) throw py::error_already_set();
  if (!unset) {
    double s = attr(timeout, s_total_seconds_)().cast<double>();
    if (s > 0) limit = s;
  }
  int64_t count = 0;
  try {
    if (!path->run(tensors, limit, &count, ready_wait)) return general(tensors, opts);
  } catch (const cpu::ShmMismatchError& e) {
    return failed(tensors, op, limit, e.what(), 0);
  } catch (const cpu::ShmPeerError& e) {
    return failed(tensors, op, limit, e.what(), 1);
  } catch (const cpu::ShmTimeoutError& e) {   // the channel's: it names the rank that stopped
    return failed(tensors, op, limit, e.what(), 2);
  } catch (const TimeoutError& e) {           // the lanes': it names none (HostLanes::throw_failure)
    return failed(tensors, op, limit, e.what(), 3);
  }
  if (!record_.is_none()) {   // Note [A ring of plain lists] in ncclavg/transport/flight.py
    PyObject* t = PyList_GET_ITEM(tensors.ptr(), 0);   // run() took it: a list of one tensor
    record_(path == sum_ ? sum_what_ : avg_what_, attr(t, s_dtype_), count);
  }
  return work(tensors);
}

// The finished Work of a call: the last one handed out when nothing else holds it any more (torch's
// dist.all_reduce drops it after wait(): refcount 1, no weak reference; a Work that torch's C++ holds is
// held through a reference to this object, PyWorkHolder), else a new one. Saves the ~0.4 us of making
// and freeing a Python subclass of a pybind11 type per call; the price is that the last call's tensors
// stay referenced until the next call or until the group shuts down (disable()).

py::object GroupAllreduce::work(py::handle tensors) {
  PyObject* w = last_work_.ptr();
  if (w != nullptr && Py_REFCNT(w) == 1) {
    PyObject** weaklist = Py_TYPE(w)->tp_weaklistoffset > 0
                              ? reinterpret_cast<PyObject**>(reinterpret_cast<char*>(w) + Py_TYPE(w)->tp_weaklistoffset)
                              : nullptr;
    if (weaklist == nullptr || *weaklist == nullptr) {
      if (PyObject_SetAttr(w, s_result_.ptr(), tensors.ptr()) != 0) throw py::error_already_set();
      return last_work_;
    }
  }
  last_work_ = done_work_(tensors);
  return last_work_;
}

}  // namespace py_glue
}  // namespace ncclavg
