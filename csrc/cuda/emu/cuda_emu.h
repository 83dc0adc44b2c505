// Grid emulator: lets the unmodified kernel sources of csrc/cuda compile with g++ as plain C++ and run
// on the CPU, one thread after another. build_emu.py force-includes this header (-include) into a
// copy of each .cu file whose `k<<<grid, block, smem, stream>>>(args)` launches are rewritten to
// `::ncclavg_emu::launch_kernel(k, grid, block, smem, stream)(args)`; nothing else in the copy changes.
// The CUDA headers do the rest under a host compiler: __global__/__device__/__host__ are empty and
// cuda_fp16.h / cuda_bf16.h take their host code paths.
//
// Note [Sequential threads are a legal schedule]
// CUDA guarantees nothing about the order in which the threads of a grid run, and without __shared__,
// __syncthreads, warp-level intrinsics or atomics a thread cannot wait for another one. So running the
// threads of a launch one after another, in ANY order, is a schedule the hardware could have chosen,
// and a kernel correct on the GPU gives the same result here. The converse is what the emulator is for:
// a kernel whose result depends on the order (two threads writing one element, a thread reading what
// another writes) differs between the forward, reverse and shuffled orders it is run in. A kernel that
// DOES need threads to run together would deadlock or be silently wrong here, so everything that needs
// it is poisoned below and fails to compile: extend the emulator (e.g. one OS thread per CUDA thread
// of a block, with a barrier) before using it.
#pragma once
// A kernel parameter qualifier only (read it in place, never copy it): nothing to do on the CPU. The
// CUDA headers would make it an attribute g++ warns about; defined first, it stays empty.
#undef __grid_constant__
#define __grid_constant__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

// The built-in index variables, one set per OS thread, like the runtime's per-host-thread state.
// Defined in emu_runtime.cpp; the CUDA headers declare them only for nvcc.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

// Register-allocation hints have no meaning on the CPU. (Launches with more threads than a kernel's
// __launch_bounds__ are still refused by the GPU; the launch checks here only know the 1024 limit.)
#define __launch_bounds__(...)

// See Note [Sequential threads are a legal schedule]: what needs threads running together is refused
// at compile time (a wrong pass is worse than no test).
// (_Pragma takes one string literal: the message cannot name the intrinsic, the compiler's "in
// expansion of macro" note does.)
// (_Pragma takes one plain string literal, so the message is fixed; the identifier after it names what
// was refused in the compiler's next diagnostic.)
#define NCCLAVG_EMU_REFUSE(what)                                                                              \
  _Pragma("GCC error \"needs threads that run together, the grid emulator runs them one by one: extend it first\"") \
      grid_emulator_cannot_run_##what
#undef __shared__
#define __shared__ NCCLAVG_EMU_REFUSE(__shared__)
#define __syncthreads(...) NCCLAVG_EMU_REFUSE(__syncthreads)
#define __syncthreads_count(...) NCCLAVG_EMU_REFUSE(__syncthreads_count)
#define __syncthreads_and(...) NCCLAVG_EMU_REFUSE(__syncthreads_and)
#define __syncthreads_or(...) NCCLAVG_EMU_REFUSE(__syncthreads_or)
#define __syncwarp(...) NCCLAVG_EMU_REFUSE(__syncwarp)
#define __shfl_sync(...) NCCLAVG_EMU_REFUSE(__shfl_sync)
#define __shfl_up_sync(...) NCCLAVG_EMU_REFUSE(__shfl_up_sync)
#define __shfl_down_sync(...) NCCLAVG_EMU_REFUSE(__shfl_down_sync)
#define __shfl_xor_sync(...) NCCLAVG_EMU_REFUSE(__shfl_xor_sync)
#define __ballot_sync(...) NCCLAVG_EMU_REFUSE(__ballot_sync)
#define __any_sync(...) NCCLAVG_EMU_REFUSE(__any_sync)
#define __all_sync(...) NCCLAVG_EMU_REFUSE(__all_sync)
#define __activemask(...) NCCLAVG_EMU_REFUSE(__activemask)
#define __reduce_add_sync(...) NCCLAVG_EMU_REFUSE(__reduce_add_sync)
#define __threadfence(...) NCCLAVG_EMU_REFUSE(__threadfence)
#define atomicAdd(...) NCCLAVG_EMU_REFUSE(atomicAdd)
#define atomicSub(...) NCCLAVG_EMU_REFUSE(atomicSub)
#define atomicExch(...) NCCLAVG_EMU_REFUSE(atomicExch)
#define atomicMin(...) NCCLAVG_EMU_REFUSE(atomicMin)
#define atomicMax(...) NCCLAVG_EMU_REFUSE(atomicMax)
#define atomicCAS(...) NCCLAVG_EMU_REFUSE(atomicCAS)
#define atomicAnd(...) NCCLAVG_EMU_REFUSE(atomicAnd)
#define atomicOr(...) NCCLAVG_EMU_REFUSE(atomicOr)
#define atomicInc(...) NCCLAVG_EMU_REFUSE(atomicInc)
// __ldg reads through the read-only cache, which is not coherent with writes of the same kernel: the
// emulator cannot show that hazard, so it refuses the intrinsic rather than hide it.
#define __ldg(...) NCCLAVG_EMU_REFUSE(__ldg)
#define cooperative_groups NCCLAVG_EMU_REFUSE(cooperative_groups)

namespace ncclavg_emu {

// Note [Kernel parameter limit]
// nvcc refuses a kernel whose parameters exceed 32,764 bytes, so the emulator refuses it at compile time
// too. Above 4 KiB the limit is the toolkit's, the device's and the driver's together: CUDA 12.1 or
// newer, compute capability 7.0 or newer, and a 12.1+ driver. The emulated system (set_system in
// emu_runtime.h) decides the last two, and a launch they do not allow is refused at run time, as the
// driver refuses it (the kernel does not run; the error sticks until read). Parameters are laid out
// like the members of a struct: each at a multiple of its alignment.
constexpr size_t kMaxParamBytes = 32764;
constexpr size_t kPortableParamBytes = 4096;

template <typename... P>
constexpr size_t param_bytes() {
  size_t off = 0;
  ((off = (off + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return off;
}

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t smem;
  cudaStream_t stream;
  size_t param_bytes = 0;  // the kernel's parameter block, set by Launch
};

// Checks the configuration as the runtime does; records the launch (counters, device, stream). When
// the runtime would refuse it, sets the sticky error and returns false: the kernel does not run.
bool begin_launch(const LaunchConfig& cfg);

// True when launches go to their stream's queue (emu_host.h, set_launches_async); then
// enqueue_launch puts body(ctx) there and release(ctx) after it ran (an invalid stream: the sticky error).
bool launch_enqueues();
void enqueue_launch(cudaStream_t stream, void (*body)(void*), void* ctx, void (*release)(void*));

// Runs body(ctx) once per thread of the grid, with threadIdx/blockIdx/blockDim/gridDim set, in the
// order chosen by set_order (emu_runtime.h).
void for_each_thread(const LaunchConfig& cfg, void (*body)(void*), void* ctx);

template <typename... P>
class Launch {
 public:
  Launch(void (*kernel)(P...), const LaunchConfig& cfg) : kernel_(kernel), cfg_(cfg) {}

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "wrong number of kernel arguments");
    static_assert(param_bytes<P...>() <= kMaxParamBytes,
                  "kernel parameters exceed 32,764 bytes (See Note [Kernel parameter limit])");
    static_assert((std::is_trivially_copyable<P>::value && ...),
                  "kernel parameters travel as bytes: they must be trivially copyable");
    LaunchConfig cfg = cfg_;
    cfg.param_bytes = param_bytes<P...>();
    if (!begin_launch(cfg)) return;
    // Converted to the parameter types once, on the host, as cudaLaunchKernel does; then every thread
    // gets its OWN copy (the by-value call below), so a thread that modifies a parameter changes
    // nothing another thread sees, as on the GPU.
    struct Ctx {
      void (*kernel)(P...);
      std::tuple<P...> params;
      LaunchConfig cfg;
    };
    auto run = [](void* c) {
      for_each_thread(
          static_cast<Ctx*>(c)->cfg, [](void* c2) {
            Ctx& x = *static_cast<Ctx*>(c2);
            std::apply(x.kernel, x.params);
          },
          c);
    };
    if (launch_enqueues()) {  // the host-logic harness: the kernel runs on its stream's queue
      auto* heap = new Ctx{kernel_, std::tuple<P...>(std::forward<A>(args)...), cfg};
      enqueue_launch(cfg.stream, run, heap, [](void* c) { delete static_cast<Ctx*>(c); });
      return;
    }
    Ctx ctx{kernel_, std::tuple<P...>(std::forward<A>(args)...), cfg};
    run(&ctx);
  }

 private:
  void (*kernel_)(P...);
  LaunchConfig cfg_;
};

// What `kernel<<<grid, block, smem, stream>>>` becomes (build_emu.py rewrites the launches).
template <typename... P>
Launch<P...> launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0,
                           cudaStream_t stream = nullptr) {
  return Launch<P...>(kernel, LaunchConfig{grid, block, smem, stream});
}

}  // namespace ncclavg_emu
