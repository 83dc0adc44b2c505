// See Note [Small-message fast path] in ncclavg/comm/fast_average.py. Written against the Python C API
// because this is the only part of a call that Python would otherwise spend most of its time in: the
// same checks as a Python closure cost about 0.7 us around a 0.36 us channel round; here about 0.2.
#include "fast_all_reduce.h"

#include <chrono>
#include <exception>
#include <stdexcept>

namespace ncclavg {
namespace py_glue {

namespace {
// The object a weak reference points to (borrowed), or nullptr when it died.
PyObject* referent(PyObject* weak) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  if (PyWeakref_GetRef(weak, &obj) <= 0) return nullptr;
  Py_DECREF(obj);   // the cache's caller holds the tensor itself: borrowed is enough for a comparison
  return obj;
#else
  PyObject* obj = PyWeakref_GetObject(weak);
  return obj == Py_None ? nullptr : obj;
#endif
}

// An integer attribute or method result of `obj`; false (and no Python error left) when there is none.
bool int_of(PyObject* value, int64_t* out) {
  if (value == nullptr) {
    PyErr_Clear();
    return false;
  }
  *out = PyLong_AsLongLong(value);
  Py_DECREF(value);
  if (*out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}
}  // namespace

bool ShmExec::acquire(bool blocking) {
  if (try_lock()) return true;
  if (!blocking) return false;
  py::gil_scoped_release nogil;   // the holder may need the GIL to finish
  std::unique_lock<std::mutex> guard(m_);
  waiters_.fetch_add(1, std::memory_order_seq_cst);
  cv_.wait(guard, [this] { return try_lock(); });
  waiters_.fetch_sub(1, std::memory_order_seq_cst);
  return true;
}

// seq_cst store, then the waiters' count: a waiter counts itself before it tests the lock, so one side
// always sees the other and no wake-up is lost.
void ShmExec::release() {
  locked_.store(false, std::memory_order_seq_cst);
  if (waiters_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> guard(m_);
    cv_.notify_one();
  }
}

void FastAllReduce::disable() {
  enabled_ = false;
  entries_.clear();
  prepare_ = py::none();
  recorder_ = ring_ = counter_ = py::object();
}

void FastAllReduce::record_to(py::object recorder, py::object what, py::object done_word) {
  ring_ = recorder.attr("ring");
  counter_ = recorder.attr("_seq");
  capacity_ = recorder.attr("capacity").cast<int64_t>();
  if (!PyList_CheckExact(ring_.ptr()) || PyList_GET_SIZE(ring_.ptr()) != capacity_ || capacity_ <= 0)
    throw std::invalid_argument("recorder: expected a flight Recorder whose ring is a list of `capacity` slots");
  recorder_ = std::move(recorder);
  what_ = std::move(what);
  done_word_ = std::move(done_word);
  name_last_seq_ = py::str("last_seq");
}

// Recorder.done, in C++ (record_to). A record that cannot be written is skipped: the call itself is done.
void FastAllReduce::note(const py::object& dtype, int64_t count) {
  if (!ring_ || PyList_GET_SIZE(ring_.ptr()) != capacity_) return;
  PyObject* seq = PyIter_Next(counter_.ptr());
  if (seq == nullptr) {
    PyErr_Clear();
    return;
  }
  const int64_t n = PyLong_AsLongLong(seq);
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  PyObject* t = PyFloat_FromDouble(now);   // time.time()'s clock, as the recorder's
  PyObject* c = PyLong_FromLongLong(count);
  PyObject* rec = (t != nullptr && c != nullptr && n > 0)
                      ? PyTuple_Pack(9, seq, what_.ptr(), dtype.ptr(), c, t, t, t, done_word_.ptr(), Py_None)
                      : nullptr;
  if (rec != nullptr) {
    PyList_SetItem(ring_.ptr(), static_cast<Py_ssize_t>(n % capacity_), rec);   // steals rec
    if (PyObject_SetAttr(recorder_.ptr(), name_last_seq_.ptr(), seq) != 0) PyErr_Clear();
  } else {
    PyErr_Clear();
  }
  Py_XDECREF(t);
  Py_XDECREF(c);
  Py_DECREF(seq);
}

FastAllReduce::FastAllReduce(cpu::ShmChannel* channel, ShmExec* exec, py::object prepare)
    : channel_(channel), exec_(exec), prepare_(std::move(prepare)), name_version_(py::str("_version")),
      name_data_ptr_(py::str("data_ptr")) {}

FastAllReduce::FastAllReduce(cpu::HostLanes* lanes, ShmExec* exec, py::object prepare)
    : lanes_(lanes), exec_(exec), prepare_(std::move(prepare)), name_version_(py::str("_version")),
      name_data_ptr_(py::str("data_ptr")) {}

// The round itself, as the general path's job makes it for the same call (the same primitive, count, type
// and signature), so that ranks taking either way meet. The channel's holds the GIL unless it has to wait
// (a peer-ready round costs no hand-over); the lanes' always wait on the wire for a round trip or more, so
// they let the GIL go for the whole call.
void FastAllReduce::all_reduce(uintptr_t data, int64_t count, int type, double div, uint64_t word, double timeout_s,
                               bool* nonfinite) {
  cpu::ShmCallTag tag;
  tag.word = word;
  tag.count = count;
  if (lanes_ != nullptr) {
    py::gil_scoped_release nogil;
    lanes_->all_reduce_sum(data, count, type, timeout_s, tag, div);
    return;
  }
  ReleaseGilWhenBlocking gil;
  channel_->all_reduce_sum(data, count, type, timeout_s, 1.0, div, tag, nonfinite);
}

const FastAllReduce::Entry* FastAllReduce::lookup(PyObject* t) {
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    if (referent(it->weak.ptr()) != t) continue;
    int64_t version = 0, data = 0;
    if (int_of(PyObject_GetAttr(t, name_version_.ptr()), &version) && version == it->version &&
        int_of(PyObject_CallMethodNoArgs(t, name_data_ptr_.ptr()), &data) &&
        static_cast<uintptr_t>(data) == it->data) {
      return &*it;
    }
    entries_.erase(std::next(it).base());   // stale: resized, set_ to other memory, changed in place
    return nullptr;
  }
  return nullptr;
}

bool FastAllReduce::run(py::handle tensors, double timeout_s, int64_t* count, double ready_wait_s, bool* nonfinite) {
  if (!enabled_ || !PyList_CheckExact(tensors.ptr()) || PyList_GET_SIZE(tensors.ptr()) != 1) return false;
  PyObject* t = PyList_GET_ITEM(tensors.ptr(), 0);
  Entry scratch;
  const Entry* e = lookup(t);
  if (e == nullptr) {
    py::object got = prepare_(py::handle(t));   // the general path's checks: they raise for bad input
    if (got.is_none()) return false;
    auto fields = got.cast<py::tuple>();
    scratch = Entry{py::none(),           0, fields[0].cast<uintptr_t>(), fields[1].cast<int64_t>(),
                    fields[2].cast<int>(), fields[3].cast<double>(), fields[4].cast<uint64_t>(),
                    py::reinterpret_borrow<py::object>(t).attr("dtype")};
    PyObject* weak = PyWeakref_NewRef(t, nullptr);
    if (weak != nullptr && int_of(PyObject_GetAttr(t, name_version_.ptr()), &scratch.version)) {
      scratch.weak = py::reinterpret_steal<py::object>(weak);
      if (entries_.size() >= 64) entries_.erase(entries_.begin());   // the oldest
      entries_.push_back(scratch);
      e = &entries_.back();
    } else {   // not weakly referable, or an inference tensor (no version): run it, never cache it
      Py_XDECREF(weak);
      PyErr_Clear();
      e = &scratch;
    }
  }
  if (ready_wait_s >= 0 || nonfinite != nullptr) {   // asynchronous or noting: here only on a channel
    const int64_t bytes = e->count * static_cast<int64_t>(cpu::type_size(static_cast<cpu::ShmType>(e->type)));
    if (lanes_ != nullptr || (ready_wait_s >= 0 && bytes > kAsyncInlineBytes)) return false;   // (and small)
  }
  // Nothing may be queued on the channel or running: the general path then runs this call in order.
  // The rule of Runner.acquire_idle (ncclavg/transport/runner.py), here in C++: the runner's order lock
  // when it is free and nothing is outstanding (and, asynchronous, when the peers are in the call).
  if (!exec_->try_lock()) return false;
  if (exec_->outstanding() != 0 || (ready_wait_s >= 0 && !channel_->peers_ready(ready_wait_s))) {
    exec_->release();
    return false;
  }
  // read now: `e` may not outlive a wait without the GIL
  const int64_t n = e->count;
  py::object dtype = ring_ ? e->dtype : py::object();
  try {
    if (count != nullptr) *count = n;
    all_reduce(e->data, n, e->type, e->div, e->tag, timeout_s, nonfinite);
  } catch (...) {
    exec_->release();
    throw;
  }
  exec_->release();
  if (dtype) note(dtype, n);
  return true;
}

}  // namespace py_glue
}  // namespace ncclavg
