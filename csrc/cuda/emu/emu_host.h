// The emulated CUDA runtime for the host code (NcclComm and the stand-in NCCL): streams, events,
// capture, memory and contexts. What a test controls and reads back. See docs/cuda_emulation.md,
// "The host logic on the CPU".
//
// Note [Emulated streams]
// A stream is a FIFO queue served by its own OS thread, so work enqueued on it runs after everything
// enqueued before it and concurrently with the host and with other streams, as on a GPU. An event is a
// marker: cudaEventRecord enqueues "complete generation g", cudaEventQuery compares the last recorded
// generation with the last completed one, cudaStreamWaitEvent enqueues "block this queue until
// generation g completed". Kernel launches (when launches_async() is on) and cudaLaunchHostFunc
// enqueue their body. "Device memory" is host memory from cudaMalloc, registered with the device that
// was current, so cudaPointerGetAttributes answers as the driver does. The legacy default stream (0)
// is one more queue per device; its implicit synchronisation with other blocking streams is NOT
// emulated (the code under test uses non-blocking streams only).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace ncclavg_emu {

// Kernel launches enqueue on their stream (true) or run before the launch returns (false, the kernel
// harness's default: it checks results right after each launch).
void set_launches_async(bool on);
bool launches_async();

// Devices cudaGetDeviceCount reports (default 4; also NCCLAVG_EMU_DEVICES at start-up). 0 makes
// cudaGetDeviceCount fail with cudaErrorNoDevice, as on a machine without a GPU.
void set_device_count(int n);
int device_count();

// Primary contexts: created the first time a thread of the process makes the device current (an
// explicit cudaSetDevice, or a call that needs a context on a thread that chose none, which binds
// device 0 as the real runtime does). `contexts_created(d)` is 0 or 1; `context_binds(d)` counts the
// threads that made d current.
int contexts_created(int device);
int context_binds(int device);

// A sticky error on `device` (e.g. cudaErrorIllegalAddress after a faulting kernel): from now on every
// call that touches that device's context returns it, as a broken context does.
void inject_sticky_error(int device, cudaError_t e);
// The n-th (1-based) call of the runtime function `name` from now on fails with `e` (once).
void inject_call_error(const std::string& name, int nth, cudaError_t e);
// For the runtime functions: the injected error for this call of `name`, or cudaSuccess.
cudaError_t injected_error(const char* name);
cudaError_t sticky_error_of(int device);

// The calling thread's current device, binding device 0's context first when it chose none.
int ensure_context();
// Whether the calling thread chose a device (or had one bound implicitly).
bool has_context();

// Captures: CUDA forbids "potentially unsafe" calls (cudaEventQuery, cudaStreamSynchronize, cudaMalloc,
// ...) while a capture that this thread's capture mode respects is in progress, and invalidates that
// capture. True (and the capture invalidated) when the calling thread may not make such a call now.
bool unsafe_call_prohibited();

// Enqueues body(ctx) on `stream` (a kernel launch or host function), then release(ctx) once it ran or
// was dropped. A capturing stream records it instead (it never runs). Returns the error the runtime
// gives for the stream handle, or cudaSuccess.
cudaError_t enqueue(cudaStream_t stream, void (*body)(void*), void* ctx, void (*release)(void*));

// Blocks until every stream has drained (bounded by `timeout_s`); false on timeout. Tests call it
// before checking that nothing is left running.
bool drain_all_streams(double timeout_s);

}  // namespace ncclavg_emu
