// Emulated streams, events, host functions and stream capture. See Note [Emulated streams] in
// emu_host.h. Every handle the runtime gives out is checked against a registry, so a use after destroy
// is cudaErrorInvalidResourceHandle here instead of undefined behaviour.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "emu_host.h"

namespace ncclavg_emu {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Work {
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  void (*release)(void*) = nullptr;
  std::function<void()> fn;  // the runtime's own items (event completion, waits)
};

struct Stream {
  int device = 0;
  int priority = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<Work> q;
  bool busy = false;
  bool stop = false;
  int capture = 0;  // id of the capture this stream belongs to; 0: none
};

struct Event {
  int device = 0;
  std::mutex m;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the last eager record
  uint64_t completed = 0;  // generation the stream reached
  int capture = 0;         // recorded inside a capture (a graph node, never completes eagerly)
};

struct Capture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id owner;
  bool invalidated = false;
};

std::mutex g_mu;  // the registries and the capture table
std::map<void*, std::shared_ptr<Stream>> g_streams;
std::map<void*, std::shared_ptr<Event>> g_events;
std::map<int, Capture> g_captures;
int g_next_capture = 1;
std::shared_ptr<Stream>* g_legacy = nullptr;  // one per device, created on first use, never freed
std::atomic<bool> g_async{false};
thread_local cudaStreamCaptureMode tl_mode = cudaStreamCaptureModeGlobal;

void serve(std::shared_ptr<Stream> s) {
  std::unique_lock<std::mutex> lock(s->m);
  while (true) {
    s->cv.wait(lock, [&] { return s->stop || !s->q.empty(); });
    if (s->q.empty()) return;  // destroyed and drained
    Work w = std::move(s->q.front());
    s->q.pop_front();
    s->busy = true;
    lock.unlock();
    if (w.body) w.body(w.ctx);
    if (w.fn) w.fn();
    if (w.release) w.release(w.ctx);
    lock.lock();
    s->busy = false;
    s->cv.notify_all();
  }
}

std::shared_ptr<Stream> make_stream(int device, int priority) {
  auto s = std::make_shared<Stream>();
  s->device = device;
  s->priority = priority;
  std::thread(serve, s).detach();  // ends when the stream is destroyed and drained
  return s;
}

// The stream behind a handle (0 / cudaStreamLegacy / cudaStreamPerThread: the current device's legacy
// stream), or null for a handle that is not live. Caller holds g_mu.
std::shared_ptr<Stream> stream_of_locked(cudaStream_t h) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(h);
  if (v == 0 || v == 1 || v == 2) {
    const int d = ensure_context();
    if (!g_legacy) g_legacy = new std::shared_ptr<Stream>[64];
    if (!g_legacy[d]) g_legacy[d] = make_stream(d, 0);
    return g_legacy[d];
  }
  auto it = g_streams.find(h);
  return it == g_streams.end() ? nullptr : it->second;
}

std::shared_ptr<Event> event_of_locked(cudaEvent_t h) {
  auto it = g_events.find(h);
  return it == g_events.end() ? nullptr : it->second;
}

void push(const std::shared_ptr<Stream>& s, Work w) {
  std::lock_guard<std::mutex> lock(s->m);
  s->q.push_back(std::move(w));
  s->cv.notify_all();
}

void release_work(Work& w) {
  if (w.release) w.release(w.ctx);
}

}  // namespace

void set_launches_async(bool on) { g_async.store(on); }
bool launches_async() { return g_async.load(); }

bool unsafe_call_prohibited() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (tl_mode == cudaStreamCaptureModeRelaxed) return false;
  const auto me = std::this_thread::get_id();
  bool prohibited = false;
  for (auto& [id, c] : g_captures) {
    const bool mine = c.owner == me && c.mode != cudaStreamCaptureModeRelaxed;
    const bool global_elsewhere =
        tl_mode == cudaStreamCaptureModeGlobal && c.owner != me && c.mode == cudaStreamCaptureModeGlobal;
    if (mine || global_elsewhere) {
      c.invalidated = true;  // as the driver does: the capture that forbade the call is broken
      prohibited = true;
    }
  }
  return prohibited;
}

cudaError_t enqueue(cudaStream_t stream, void (*body)(void*), void* ctx, void (*release)(void*)) {
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s = stream_of_locked(stream);
    if (!s) {
      if (release) release(ctx);
      return cudaErrorInvalidResourceHandle;
    }
    if (const cudaError_t e = sticky_error_of(s->device)) {
      if (release) release(ctx);
      return e;
    }
    if (s->capture) {  // recorded into the graph: it does not run now
      if (release) release(ctx);
      return cudaSuccess;
    }
  }
  Work w;
  w.body = body;
  w.ctx = ctx;
  w.release = release;
  push(s, std::move(w));
  return cudaSuccess;
}

bool drain_all_streams(double timeout_s) {
  std::vector<std::shared_ptr<Stream>> all;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [h, s] : g_streams) all.push_back(s);
    if (g_legacy)
      for (int d = 0; d < 64; ++d)
        if (g_legacy[d]) all.push_back(g_legacy[d]);
  }
  const double end = now_s() + timeout_s;
  for (auto& s : all) {
    std::unique_lock<std::mutex> lock(s->m);
    while (!s->q.empty() || s->busy) {
      if (now_s() >= end) return false;
      s->cv.wait_for(lock, std::chrono::milliseconds(5));
    }
  }
  return true;
}

}  // namespace ncclavg_emu

using namespace ncclavg_emu;

extern "C" {

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  // What an H100/H200 reports: 0 is the default (least), -5 the greatest priority.
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* out, unsigned int flags, int priority) {
  if (!out) return cudaErrorInvalidValue;
  if (const cudaError_t e = injected_error("cudaStreamCreateWithPriority")) return e;
  const int d = ensure_context();
  if (const cudaError_t e = sticky_error_of(d)) return e;
  auto s = make_stream(d, std::clamp(priority, -5, 0));
  void* h = new char;  // a unique address as the handle
  std::lock_guard<std::mutex> lock(g_mu);
  g_streams[h] = s;
  *out = static_cast<cudaStream_t>(h);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* out, unsigned int flags) {
  return cudaStreamCreateWithPriority(out, flags, 0);
}

cudaError_t cudaStreamGetPriority(cudaStream_t h, int* priority) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_of_locked(h);
  if (!s) return cudaErrorInvalidResourceHandle;
  *priority = s->priority;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t h) {
  ensure_context();
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_streams.find(h);
    if (it == g_streams.end()) return cudaErrorInvalidResourceHandle;
    s = it->second;
    g_streams.erase(it);
    delete static_cast<char*>(static_cast<void*>(h));
  }
  // Returns at once; the queue's thread finishes what is enqueued, then ends (as cudaStreamDestroy).
  std::lock_guard<std::mutex> lock(s->m);
  s->stop = true;
  s->cv.notify_all();
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  if (!fn) return cudaErrorInvalidValue;
  ensure_context();
  return enqueue(stream, reinterpret_cast<void (*)(void*)>(fn), data, nullptr);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* out, unsigned int flags) {
  if (!out) return cudaErrorInvalidValue;
  if (const cudaError_t e = injected_error("cudaEventCreateWithFlags")) return e;
  const int d = ensure_context();
  if (const cudaError_t e = sticky_error_of(d)) return e;
  auto ev = std::make_shared<Event>();
  ev->device = d;
  void* h = new char;
  std::lock_guard<std::mutex> lock(g_mu);
  g_events[h] = ev;
  *out = static_cast<cudaEvent_t>(h);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* out) { return cudaEventCreateWithFlags(out, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t h) {
  ensure_context();
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_events.find(h);
  if (it == g_events.end()) return cudaErrorInvalidResourceHandle;
  g_events.erase(it);  // items still queued keep the event alive: released once it completes
  delete static_cast<char*>(static_cast<void*>(h));
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t h, cudaStream_t stream) {
  ensure_context();
  if (const cudaError_t e = injected_error("cudaEventRecord")) return e;
  std::shared_ptr<Stream> s;
  std::shared_ptr<Event> ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s = stream_of_locked(stream);
    ev = event_of_locked(h);
    if (!s || !ev) return cudaErrorInvalidResourceHandle;
    if (const cudaError_t e = sticky_error_of(s->device)) return e;
    if (s->capture) {  // a node of the graph being captured
      std::lock_guard<std::mutex> el(ev->m);
      ev->capture = s->capture;
      return cudaSuccess;
    }
  }
  uint64_t g;
  {
    std::lock_guard<std::mutex> el(ev->m);
    ev->capture = 0;
    g = ++ev->recorded;
  }
  Work w;
  w.fn = [ev, g] {
    std::lock_guard<std::mutex> el(ev->m);
    ev->completed = std::max(ev->completed, g);
    ev->cv.notify_all();
  };
  push(s, std::move(w));
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t h) {
  ensure_context();
  if (unsafe_call_prohibited()) return cudaErrorStreamCaptureUnsupported;
  std::shared_ptr<Event> ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ev = event_of_locked(h);
  }
  if (!ev) return cudaErrorInvalidResourceHandle;
  if (const cudaError_t e = sticky_error_of(ev->device)) return e;
  if (const cudaError_t e = injected_error("cudaEventQuery")) return e;
  std::lock_guard<std::mutex> el(ev->m);
  return ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t h) {
  ensure_context();
  if (unsafe_call_prohibited()) return cudaErrorStreamCaptureUnsupported;
  std::shared_ptr<Event> ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ev = event_of_locked(h);
  }
  if (!ev) return cudaErrorInvalidResourceHandle;
  std::unique_lock<std::mutex> el(ev->m);
  const uint64_t g = ev->recorded;
  ev->cv.wait(el, [&] { return ev->completed >= g; });
  return sticky_error_of(ev->device);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t h, unsigned int) {
  ensure_context();
  std::shared_ptr<Stream> s;
  std::shared_ptr<Event> ev;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s = stream_of_locked(stream);
    ev = event_of_locked(h);
    if (!s || !ev) return cudaErrorInvalidResourceHandle;
    if (const cudaError_t e = sticky_error_of(s->device)) return e;
    std::lock_guard<std::mutex> el(ev->m);
    if (ev->capture) {  // waiting on a captured event pulls the stream into that capture (a fork)
      s->capture = ev->capture;
      return cudaSuccess;
    }
    if (s->capture) return cudaSuccess;  // an eager event in a capture: an edge into the graph
  }
  uint64_t g;
  {
    std::lock_guard<std::mutex> el(ev->m);
    g = ev->recorded;
  }
  Work w;
  w.fn = [ev, g] {  // the queue stops here until the event's stream got there
    std::unique_lock<std::mutex> el(ev->m);
    ev->cv.wait(el, [&] { return ev->completed >= g; });
  };
  push(s, std::move(w));
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  ensure_context();
  if (unsafe_call_prohibited()) return cudaErrorStreamCaptureUnsupported;
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s = stream_of_locked(stream);
  }
  if (!s) return cudaErrorInvalidResourceHandle;
  std::unique_lock<std::mutex> lock(s->m);
  s->cv.wait(lock, [&] { return s->q.empty() && !s->busy; });
  return sticky_error_of(s->device);
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  ensure_context();
  if (unsafe_call_prohibited()) return cudaErrorStreamCaptureUnsupported;
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    s = stream_of_locked(stream);
  }
  if (!s) return cudaErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(s->m);
  return s->q.empty() && !s->busy ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  ensure_context();
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_of_locked(stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (reinterpret_cast<uintptr_t>(stream) <= 2) return cudaErrorStreamCaptureUnsupported;  // legacy stream
  if (s->capture) return cudaErrorIllegalState;
  const int id = g_next_capture++;
  g_captures[id] = Capture{mode, std::this_thread::get_id(), false};
  s->capture = id;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_of_locked(stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (!s->capture) return cudaErrorIllegalState;
  const int id = s->capture;
  const bool invalidated = g_captures[id].invalidated;
  g_captures.erase(id);
  for (auto& [h, other] : g_streams)
    if (other->capture == id) other->capture = 0;
  s->capture = 0;
  if (graph) *graph = invalidated ? nullptr : reinterpret_cast<cudaGraph_t>(static_cast<uintptr_t>(0x6a0000 + id));
  return invalidated ? cudaErrorStreamCaptureInvalidated : cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto s = stream_of_locked(stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (!s->capture) {
    *status = cudaStreamCaptureStatusNone;
  } else {
    *status = g_captures[s->capture].invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive;
  }
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (!mode) return cudaErrorInvalidValue;
  std::swap(*mode, tl_mode);
  return cudaSuccess;
}

}  // extern "C"
