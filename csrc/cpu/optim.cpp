// Dispatcher of the fused CPU optimizers: validation, per-step scalars, chunking and OpenMP. The ISA
// kernels (optim_impl.h) work on one slice of one segment; see Note [OpenMP outside the ISA kernels].
#include "optim.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "../common/check.h"
#include "optim_kernels.h"
#include "parallel.h"

namespace ncclavg {
namespace cpu {

const OptimKernelTable& optim_kernels() {
  switch (current_simd_level()) {
#if defined(__x86_64__)
    case SimdLevel::kAvx512: return kAvx512OptimKernels;
    case SimdLevel::kAvx2: return kAvx2OptimKernels;
#elif defined(__aarch64__)
    case SimdLevel::kSve: return kSveOptimKernels;
    case SimdLevel::kNeon: return kNeonOptimKernels;
#endif
    default: return kScalarOptimKernels;
  }
}

namespace {

// Slices are this many elements at most (a multiple of 64, see Note [Norm reduction independent of
// the SIMD level]): small enough to balance threads over tensors of any size, large enough that the
// per-slice call costs nothing next to ~1 MiB of traffic.
constexpr int64_t kChunk = 1 << 15;
constexpr size_t kMaxTowers = 4096;

std::string idx(const char* name, size_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }
std::string idx2(const char* name, size_t t, size_t s) {
  return std::string(name) + "[" + std::to_string(t) + "][" + std::to_string(s) + "]";
}

void check_finite_arg(double x, const char* name) {
  NCCLAVG_CHECK_ARG(std::isfinite(x), name, "must be finite, got ", x);
}

// ---- validation of the buffers of one step

struct Region {
  uintptr_t begin, end;
  std::string name;
  bool written;
};

// Written buffers may not overlap anything; read-only gradients may overlap each other (the same
// tensor fed as two towers is a legitimate, if odd, input).
void check_no_aliasing(std::vector<Region> regions) {
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  const Region* far_all = nullptr;      // the region reaching furthest so far
  const Region* far_written = nullptr;  // the written region reaching furthest so far
  for (const Region& r : regions) {
    if (r.written && far_all && r.begin < far_all->end) {
      NCCLAVG_CHECK_ARG(false, r.name.c_str(), "shares memory with ", far_all->name,
                        "; every written buffer must be distinct");
    }
    if (!r.written && far_written && r.begin < far_written->end) {
      NCCLAVG_CHECK_ARG(false, r.name.c_str(), "shares memory with ", far_written->name,
                        ", which the step writes");
    }
    if (!far_all || r.end > far_all->end) far_all = &r;
    if (r.written && (!far_written || r.end > far_written->end)) far_written = &r;
  }
}

void add_region(std::vector<Region>& regions, const Buffer& b, std::string name, bool written) {
  if (b.numel > 0) regions.push_back({b.ptr, b.ptr + b.nbytes(), std::move(name), written});
}

void check_host_f32(const Buffer& b, const std::string& name, int64_t numel) {
  validate_buffer(b, name);
  NCCLAVG_CHECK_ARG(b.on_cpu(), name, "must be in host memory, got ", b.describe());
  NCCLAVG_CHECK_ARG(b.dtype == DType::kFloat32, name, "must be float32 (fp32 master storage), got ",
                    dtype_name(b.dtype));
  NCCLAVG_CHECK_ARG(!b.readonly, name, "is read-only; the step writes it");
  NCCLAVG_CHECK_ARG(b.numel == numel, name, "has ", b.numel, " elements, expected ", numel);
}

void check_state_list(const std::vector<Buffer>& bufs, const char* name, const std::vector<Buffer>& params,
                      std::vector<Region>& regions) {
  NCCLAVG_CHECK_ARG(bufs.size() == params.size(), name, "has ", bufs.size(), " buffers but params has ",
                    params.size());
  for (size_t s = 0; s < bufs.size(); ++s) {
    check_host_f32(bufs[s], idx(name, s), params[s].numel);
    add_region(regions, bufs[s], idx(name, s), true);
  }
}

// The gradients of a step: grads[tower][segment], flattened to per-segment GradSlices.
struct GradTable {
  size_t nseg = 0;
  int ntowers = 0;
  std::vector<const void*> ptrs;  // [segment][tower]
  std::vector<DType> dtype;       // per segment
  std::vector<int64_t> numel;     // per segment

  GradSlice slice(size_t s) const { return GradSlice{ptrs.data() + s * ntowers, ntowers, dtype[s]}; }
};

// `numels` gives the expected size of each segment (from params); nullptr: taken from grads[0].
GradTable make_grad_table(const std::vector<std::vector<Buffer>>& grads, const std::vector<int64_t>* numels,
                          std::vector<Region>* regions) {
  NCCLAVG_CHECK_ARG(!grads.empty(), "grads", "needs at least one tower (grads[tower][segment])");
  NCCLAVG_CHECK_ARG(grads.size() <= kMaxTowers, "grads", "at most ", kMaxTowers, " towers, got ", grads.size());
  GradTable t;
  t.ntowers = static_cast<int>(grads.size());
  t.nseg = numels ? numels->size() : grads[0].size();
  t.ptrs.resize(t.nseg * t.ntowers);
  t.dtype.resize(t.nseg);
  t.numel.resize(t.nseg);
  for (size_t k = 0; k < grads.size(); ++k) {
    NCCLAVG_CHECK_ARG(grads[k].size() == t.nseg, idx("grads", k).c_str(), "has ", grads[k].size(),
                      " buffers, expected one per segment (", t.nseg, ")");
  }
  for (size_t s = 0; s < t.nseg; ++s) {
    const int64_t want = numels ? (*numels)[s] : grads[0][s].numel;
    for (size_t k = 0; k < grads.size(); ++k) {
      const Buffer& b = grads[k][s];
      const std::string name = idx2("grads", k, s);
      validate_buffer(b, name);
      NCCLAVG_CHECK_ARG(b.on_cpu(), name, "must be in host memory, got ", b.describe());
      NCCLAVG_CHECK_ARG(b.numel == want, name, "has ", b.numel, " elements, expected ", want,
                        numels ? " (the numel of params[" + std::to_string(s) + "])" : std::string());
      NCCLAVG_CHECK_ARG(b.dtype == grads[0][s].dtype, name, "dtype ", dtype_name(b.dtype),
                        " differs from grads[0][", s, "] dtype ", dtype_name(grads[0][s].dtype),
                        "; the towers of one tensor share a dtype");
      t.ptrs[s * t.ntowers + k] = reinterpret_cast<const void*>(b.ptr);
      if (regions) add_region(*regions, b, name, false);
    }
    t.dtype[s] = grads[0][s].dtype;
    t.numel[s] = want;
  }
  return t;
}

std::vector<int64_t> check_params(const std::vector<Buffer>& params, std::vector<Region>& regions) {
  std::vector<int64_t> numels(params.size());
  for (size_t s = 0; s < params.size(); ++s) {
    validate_buffer(params[s], idx("params", s));
    check_host_f32(params[s], idx("params", s), params[s].numel);
    add_region(regions, params[s], idx("params", s), true);
    numels[s] = params[s].numel;
  }
  return numels;
}

void check_out(const std::vector<Buffer>& out, const std::vector<Buffer>& params, std::vector<Region>& regions) {
  if (out.empty()) return;
  NCCLAVG_CHECK_ARG(out.size() == params.size(), "out", "has ", out.size(),
                    " buffers; pass none or one per params entry (", params.size(), ")");
  for (size_t s = 0; s < out.size(); ++s) {
    const std::string name = idx("out", s);
    validate_buffer(out[s], name);
    NCCLAVG_CHECK_ARG(out[s].on_cpu(), name, "must be in host memory, got ", out[s].describe());
    NCCLAVG_CHECK_ARG(!out[s].readonly, name, "is read-only; the step writes the new params into it");
    NCCLAVG_CHECK_ARG(out[s].numel == params[s].numel, name, "has ", out[s].numel, " elements, expected ",
                      params[s].numel, " (the numel of params[", s, "])");
    add_region(regions, out[s], name, true);
  }
}

void check_grad_options(const GradOptions& go) {
  NCCLAVG_CHECK_ARG(std::isfinite(go.grad_scale) && go.grad_scale > 0, "grad_scale",
                    "must be a finite loss scale > 0, got ", go.grad_scale);
  NCCLAVG_CHECK_ARG(std::isfinite(1.0 / go.grad_scale) && static_cast<float>(1.0 / go.grad_scale) > 0.0f,
                    "grad_scale", "1/grad_scale is not a normal float32, got grad_scale=", go.grad_scale);
  if (go.max_grad_norm) {
    NCCLAVG_CHECK_ARG(std::isfinite(*go.max_grad_norm) && *go.max_grad_norm > 0, "max_grad_norm",
                      "must be finite and > 0, got ", *go.max_grad_norm);
  }
  NCCLAVG_CHECK_ARG(std::isfinite(go.clip_coef) && go.clip_coef >= 0, "clip_coef",
                    "must be finite and >= 0, got ", go.clip_coef);
  if (go.sumsq_start) {
    NCCLAVG_CHECK_ARG(std::isfinite(*go.sumsq_start) && *go.sumsq_start >= 0, "sumsq_start",
                      "must be finite and >= 0, got ", *go.sumsq_start);
    NCCLAVG_CHECK_ARG(!go.max_grad_norm, "sumsq_start",
                      "is for steps without max_grad_norm (that norm is computed before the update)");
  }
}

// ---- chunked parallel loops

struct Chunk {
  size_t seg;
  int64_t begin, end;
};

std::vector<Chunk> make_chunks(const std::vector<int64_t>& numels, int64_t* total) {
  std::vector<Chunk> chunks;
  *total = 0;
  for (size_t s = 0; s < numels.size(); ++s) {
    for (int64_t b = 0; b < numels[s]; b += kChunk) chunks.push_back({s, b, std::min(numels[s], b + kChunk)});
    *total += numels[s];
  }
  return chunks;
}

// Calls fn(k) for every chunk; each thread takes a contiguous run of chunks holding ~total/threads
// elements (contiguous runs keep the hardware prefetchers on long streams).
template <class Fn>
void for_each_chunk(const std::vector<Chunk>& chunks, int64_t total, Fn&& fn) {
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  if (nchunks == 0) return;
  if (total < kParallelMinElements || nchunks == 1 || omp_get_max_threads() == 1) {
    for (int64_t k = 0; k < nchunks; ++k) fn(k);
    return;
  }
  std::vector<int64_t> start(nchunks + 1, 0);
  for (int64_t k = 0; k < nchunks; ++k) start[k + 1] = start[k] + (chunks[k].end - chunks[k].begin);
#pragma omp parallel
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t t = omp_get_thread_num();
    const int64_t lo_elem = total * t / nt;
    const int64_t hi_elem = total * (t + 1) / nt;
    // Chunk k belongs to the thread whose element range holds its first element.
    const int64_t lo = std::lower_bound(start.begin(), start.end() - 1, lo_elem) - start.begin();
    const int64_t hi = std::lower_bound(start.begin(), start.end() - 1, hi_elem) - start.begin();
    for (int64_t k = lo; k < (t == nt - 1 ? nchunks : hi); ++k) fn(k);
  }
}

GradStats stats_of(const GradTable& g, float inv_scale, std::optional<double> max_grad_norm) {
  const OptimKernelTable& kt = optim_kernels();
  int64_t total = 0;
  const std::vector<Chunk> chunks = make_chunks(g.numel, &total);
  std::vector<double> partial(chunks.size(), 0.0);
  const om::GradCoef gc{inv_scale, 1.0f};
  for_each_chunk(chunks, total, [&](int64_t k) {
    const Chunk& c = chunks[k];
    partial[k] = kt.grad_sumsq(g.slice(c.seg), gc, c.begin, c.end);
  });
  GradStats st;
  for (double p : partial) st.sumsq += p;  // slice order: independent of the thread count
  st.norm = std::sqrt(st.sumsq);
  st.finite = std::isfinite(st.sumsq);
  if (max_grad_norm && st.finite) {
    // torch.nn.utils.clip_grad_norm_ in float32: clamp(max_norm / (total_norm + 1e-6), max=1).
    const float coef = static_cast<float>(*max_grad_norm) / (static_cast<float>(st.norm) + static_cast<float>(1e-6));
    st.clip_coef = std::min(coef, 1.0f);
  }
  return st;
}

float inv_scale_of(const GradOptions& go, bool maximize) {
  // GradScaler.unscale_: inv_scale = float(1 / scale); maximize negates (exactly) the gradient.
  const float inv = static_cast<float>(1.0 / go.grad_scale);
  return maximize ? -inv : inv;
}

// Note [The inf/NaN check as a scan]
// skip_nonfinite must know that every gradient is finite before the first write (Note [Two passes, no
// partial updates]), so the gradients are read twice. That first read used to be grad_sumsq: the tower
// mean in float64, the squares, the sums -- about as much work per element as the update itself on
// AVX2, for an answer the bits give directly. With |1/grad_scale| <= 1 the averaged, unscaled
// gradients are all finite iff no tower holds an inf/NaN pattern: a mean of finite values is finite
// and no larger than the largest of them, a product by at most 1 cannot overflow, and a float64 sum
// of float32 squares cannot either. So the first pass is an OR-reduction over the bit patterns
// (all_finite), which runs at the speed of a plain read (torch.sum's). (Visiting each thread's chunks
// last to first, so that the update would start on gradients still in cache, made the scan ~15% slower:
// the prefetchers lose the stream at every chunk boundary.) The norm that the check used to report is
// accumulated by the update pass itself (GradOptions::sumsq_start: the same accumulators in the same
// order, hence the same bits), and a step the scan rejects runs grad_sumsq to report the inf/NaN norm
// it reported before. Loss scales below 1 (an unscale that can overflow) keep the full first pass.
// When the pass that wrote the gradients noted that they are all finite (GradOptions::grads_finite, Note
// [Finiteness from the pass that writes] in common/finite_math.h), that answer stands for the scan and
// the gradients are read once, by the update.
bool scan_finite(const GradTable& g) {
  const OptimKernelTable& kt = optim_kernels();
  int64_t total = 0;
  const std::vector<Chunk> chunks = make_chunks(g.numel, &total);
  std::vector<char> ok(chunks.size(), 1);
  for_each_chunk(chunks, total, [&](int64_t k) {
    ok[k] = kt.all_finite(g.slice(chunks[k].seg), chunks[k].begin, chunks[k].end);
  });
  return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
}

// The scan's answer, or the answer of the pass that wrote the gradients when it said "finite": the same
// argument (|1/grad_scale| <= 1: finite tower values give a finite unscaled mean) with the bits already
// tested. A "not finite" from that pass runs the scan, which then decides on the gradients given here.
bool finite_by_scan(const GradTable& g, const GradOptions& go, bool* answered) {
  *answered = std::fabs(inv_scale_of(go, false)) <= 1.0f;
  if (*answered && go.grads_finite.value_or(false)) return true;
  return *answered && scan_finite(g);
}

// First pass when asked for; returns false when the step must be skipped. *fuse_norm: the update pass
// must accumulate the norm (the check ran as a scan, or the caller asked for it with sumsq_start).
bool decide(const GradTable& g, const GradOptions& go, StepResult& r, bool* fuse_norm) {
  r.clip_coef = go.clip_coef;
  *fuse_norm = go.sumsq_start.has_value();
  if (!go.check_finite && !go.max_grad_norm) return true;
  if (!go.max_grad_norm) {  // See Note [The inf/NaN check as a scan].
    bool answered = false;
    if (finite_by_scan(g, go, &answered)) {
      *fuse_norm = true;
      return true;
    }
  }
  const GradStats st = stats_of(g, inv_scale_of(go, false), go.max_grad_norm);
  r.stats_computed = true;
  r.sumsq = st.sumsq;
  r.grad_norm = st.norm;
  if (!st.finite) {  // see Note [Two passes, no partial updates]
    r.skipped = true;
    return false;
  }
  if (go.max_grad_norm) r.clip_coef = static_cast<float>(go.clip_coef * st.clip_coef);
  return true;
}

// The norm accumulated by the update: the chunks' sums in chunk order after sumsq_start (0 when the
// check asked for it), as stats_of adds them.
void finish_norm(const GradOptions& go, const std::vector<double>& partial, StepResult& r) {
  double sumsq = go.sumsq_start.value_or(0.0);
  for (double p : partial) sumsq += p;
  r.stats_computed = true;
  r.sumsq = sumsq;
  r.grad_norm = std::sqrt(sumsq);
}

void copy_out_unchanged(const std::vector<Buffer>& params, const std::vector<Buffer>& out) {
  if (!out.empty()) cast_copy(params, out);
}

// ---- per-step scalars (see Note [Optimizer arithmetic follows torch])

om::AdamCoef adam_coef(const AdamHyper& h, double step) {
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bc1;
  om::AdamCoef c{};
  c.decoupled = h.decoupled && h.weight_decay != 0.0;
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.l2_on = !h.decoupled && h.weight_decay != 0.0;
  c.l2 = static_cast<float>(h.weight_decay);
  c.w1 = static_cast<float>(1.0 - h.beta1);
  c.w1_small = std::fabs(c.w1) < 0.5f;
  c.w1_comp = 1.0f - c.w1;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  c.amsgrad = h.amsgrad;
  return c;
}

void check_adam_hyper(const AdamHyper& h) {
  check_finite_arg(h.lr, "lr");
  NCCLAVG_CHECK_ARG(h.lr >= 0, "lr", "must be >= 0, got ", h.lr);
  NCCLAVG_CHECK_ARG(h.beta1 >= 0 && h.beta1 < 1, "betas", "betas[0] must be in [0, 1), got ", h.beta1);
  NCCLAVG_CHECK_ARG(h.beta2 >= 0 && h.beta2 < 1, "betas", "betas[1] must be in [0, 1), got ", h.beta2);
  check_finite_arg(h.eps, "eps");
  NCCLAVG_CHECK_ARG(h.eps > 0, "eps", "must be > 0, got ", h.eps);
  check_finite_arg(h.weight_decay, "weight_decay");
  NCCLAVG_CHECK_ARG(h.weight_decay >= 0, "weight_decay", "must be >= 0, got ", h.weight_decay);
}

void check_sgd_hyper(const SgdHyper& h) {
  check_finite_arg(h.lr, "lr");
  NCCLAVG_CHECK_ARG(h.lr >= 0, "lr", "must be >= 0, got ", h.lr);
  check_finite_arg(h.momentum, "momentum");
  NCCLAVG_CHECK_ARG(h.momentum >= 0, "momentum", "must be >= 0, got ", h.momentum);
  check_finite_arg(h.dampening, "dampening");
  check_finite_arg(h.weight_decay, "weight_decay");
  NCCLAVG_CHECK_ARG(h.weight_decay >= 0, "weight_decay", "must be >= 0, got ", h.weight_decay);
  NCCLAVG_CHECK_ARG(!h.nesterov || (h.momentum > 0 && h.dampening == 0), "nesterov",
                    "Nesterov momentum needs momentum > 0 and dampening == 0, got momentum=", h.momentum,
                    ", dampening=", h.dampening);
}

}  // namespace

GradStats grad_stats(const std::vector<std::vector<Buffer>>& grads, double grad_scale,
                     std::optional<double> max_grad_norm) {
  GradOptions go;
  go.grad_scale = grad_scale;
  go.max_grad_norm = max_grad_norm;
  check_grad_options(go);
  const GradTable g = make_grad_table(grads, nullptr, nullptr);
  return stats_of(g, inv_scale_of(go, false), max_grad_norm);
}

bool grads_finite(const std::vector<std::vector<Buffer>>& grads, double grad_scale) {
  GradOptions go;
  go.grad_scale = grad_scale;
  check_grad_options(go);
  const GradTable g = make_grad_table(grads, nullptr, nullptr);
  bool answered = false;
  const bool finite = finite_by_scan(g, go, &answered);
  return answered ? finite : stats_of(g, inv_scale_of(go, false), std::nullopt).finite;
}

StepResult adam_step(const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
                     const std::vector<Buffer>& exp_avg, const std::vector<Buffer>& exp_avg_sq,
                     const std::vector<Buffer>& max_exp_avg_sq, const std::vector<double>& steps_arg,
                     const std::vector<Buffer>& out, const AdamHyper& hp, const GradOptions& go,
                     const std::vector<Buffer>& step_tensors) {
  check_adam_hyper(hp);
  check_grad_options(go);
  std::vector<Region> regions;
  const std::vector<int64_t> numels = check_params(params, regions);
  const GradTable g = make_grad_table(grads, &numels, &regions);
  check_state_list(exp_avg, "exp_avg", params, regions);
  check_state_list(exp_avg_sq, "exp_avg_sq", params, regions);
  if (hp.amsgrad) {
    check_state_list(max_exp_avg_sq, "max_exp_avg_sq", params, regions);
  } else {
    NCCLAVG_CHECK_ARG(max_exp_avg_sq.empty(), "max_exp_avg_sq", "must be empty unless amsgrad=True");
  }
  // See Note [Step counters as tensors].
  std::vector<double> steps = steps_arg;
  std::vector<float> new_counts;
  if (!step_tensors.empty()) {
    NCCLAVG_CHECK_ARG(steps_arg.empty(), "steps", "pass either steps or step_tensors, not both");
    NCCLAVG_CHECK_ARG(step_tensors.size() == params.size(), "step_tensors", "has ", step_tensors.size(),
                      " entries but params has ", params.size());
    for (size_t s = 0; s < step_tensors.size(); ++s) {
      const Buffer& b = step_tensors[s];
      const std::string name = idx("step_tensors", s);
      check_host_f32(b, name, 1);
      add_region(regions, b, name, true);
      const float next = *reinterpret_cast<const float*>(b.ptr) + 1.0f;  // torch: step_t += 1 (float32)
      new_counts.push_back(next);
      steps.push_back(static_cast<double>(next));
    }
  }
  NCCLAVG_CHECK_ARG(steps.size() == params.size(), "steps", "has ", steps.size(), " entries but params has ",
                    params.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    NCCLAVG_CHECK_ARG(std::isfinite(steps[s]) && steps[s] >= 1, idx("steps", s).c_str(),
                      "must be a step number >= 1 (the count after this step), got ", steps[s]);
  }
  check_out(out, params, regions);
  check_no_aliasing(std::move(regions));

  StepResult r;
  bool fuse_norm = false;
  if (!decide(g, go, r, &fuse_norm)) {
    copy_out_unchanged(params, out);
    return r;
  }
  std::vector<om::AdamCoef> coef(params.size());
  for (size_t s = 0; s < params.size(); ++s) coef[s] = adam_coef(hp, steps[s]);
  const om::GradCoef gc{inv_scale_of(go, hp.maximize), static_cast<float>(r.clip_coef)};
  const OptimKernelTable& kt = optim_kernels();
  int64_t total = 0;
  const std::vector<Chunk> chunks = make_chunks(numels, &total);
  std::vector<double> partial(fuse_norm ? chunks.size() : 0);
  for_each_chunk(chunks, total, [&](int64_t k) {
    const Chunk& c = chunks[k];
    const size_t s = c.seg;
    const AdamSlice slice{reinterpret_cast<float*>(params[s].ptr), reinterpret_cast<float*>(exp_avg[s].ptr),
                          reinterpret_cast<float*>(exp_avg_sq[s].ptr),
                          hp.amsgrad ? reinterpret_cast<float*>(max_exp_avg_sq[s].ptr) : nullptr};
    const OutSlice o{out.empty() ? nullptr : reinterpret_cast<void*>(out[s].ptr),
                     out.empty() ? DType::kFloat32 : out[s].dtype};
    kt.adam(slice, g.slice(s), o, coef[s], gc, c.begin, c.end, fuse_norm ? &partial[k] : nullptr);
  });
  if (fuse_norm) finish_norm(go, partial, r);
  for (size_t s = 0; s < new_counts.size(); ++s) *reinterpret_cast<float*>(step_tensors[s].ptr) = new_counts[s];
  return r;
}

StepResult sgd_step(const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
                    const std::vector<Buffer>& momentum_buffers, const std::vector<bool>& first,
                    const std::vector<Buffer>& out, const SgdHyper& hp, const GradOptions& go) {
  check_sgd_hyper(hp);
  check_grad_options(go);
  std::vector<Region> regions;
  const std::vector<int64_t> numels = check_params(params, regions);
  const GradTable g = make_grad_table(grads, &numels, &regions);
  const bool momentum_on = hp.momentum != 0.0;
  if (momentum_on) {
    check_state_list(momentum_buffers, "momentum_buffers", params, regions);
    NCCLAVG_CHECK_ARG(first.size() == params.size(), "first", "has ", first.size(),
                      " entries but params has ", params.size());
  } else {
    NCCLAVG_CHECK_ARG(momentum_buffers.empty(), "momentum_buffers", "must be empty when momentum == 0");
  }
  check_out(out, params, regions);
  check_no_aliasing(std::move(regions));

  StepResult r;
  bool fuse_norm = false;
  if (!decide(g, go, r, &fuse_norm)) {
    copy_out_unchanged(params, out);
    return r;
  }
  om::SgdCoef base{};
  base.neg_lr = static_cast<float>(-hp.lr);
  base.wd_on = hp.weight_decay != 0.0;
  base.wd = static_cast<float>(hp.weight_decay);
  base.momentum_on = momentum_on;
  base.momentum = static_cast<float>(hp.momentum);
  base.damp_comp = static_cast<float>(1.0 - hp.dampening);
  base.nesterov = hp.nesterov;
  const om::GradCoef gc{inv_scale_of(go, hp.maximize), static_cast<float>(r.clip_coef)};
  const OptimKernelTable& kt = optim_kernels();
  int64_t total = 0;
  const std::vector<Chunk> chunks = make_chunks(numels, &total);
  std::vector<double> partial(fuse_norm ? chunks.size() : 0);
  for_each_chunk(chunks, total, [&](int64_t k) {
    const Chunk& c = chunks[k];
    const size_t s = c.seg;
    om::SgdCoef coef = base;
    coef.first = momentum_on && first[s];
    const SgdSlice slice{reinterpret_cast<float*>(params[s].ptr),
                         momentum_on ? reinterpret_cast<float*>(momentum_buffers[s].ptr) : nullptr};
    const OutSlice o{out.empty() ? nullptr : reinterpret_cast<void*>(out[s].ptr),
                     out.empty() ? DType::kFloat32 : out[s].dtype};
    kt.sgd(slice, g.slice(s), o, coef, gc, c.begin, c.end, fuse_norm ? &partial[k] : nullptr);
  });
  if (fuse_norm) finish_norm(go, partial, r);
  return r;
}

void cast_copy(const std::vector<Buffer>& srcs, const std::vector<Buffer>& dsts) {
  NCCLAVG_CHECK_ARG(srcs.size() == dsts.size(), "dsts", "has ", dsts.size(), " buffers but srcs has ",
                    srcs.size());
  std::vector<Region> regions;
  std::vector<int64_t> numels(srcs.size());
  for (size_t s = 0; s < srcs.size(); ++s) {
    const std::string sn = idx("srcs", s), dn = idx("dsts", s);
    validate_buffer(srcs[s], sn);
    validate_buffer(dsts[s], dn);
    NCCLAVG_CHECK_ARG(srcs[s].on_cpu(), sn, "must be in host memory, got ", srcs[s].describe());
    NCCLAVG_CHECK_ARG(dsts[s].on_cpu(), dn, "must be in host memory, got ", dsts[s].describe());
    NCCLAVG_CHECK_ARG(srcs[s].dtype == DType::kFloat32, sn, "must be float32, got ", dtype_name(srcs[s].dtype));
    NCCLAVG_CHECK_ARG(!dsts[s].readonly, dn, "is read-only");
    NCCLAVG_CHECK_ARG(dsts[s].numel == srcs[s].numel, dn, "has ", dsts[s].numel, " elements, expected ",
                      srcs[s].numel);
    add_region(regions, srcs[s], sn, false);
    add_region(regions, dsts[s], dn, true);
    numels[s] = srcs[s].numel;
  }
  check_no_aliasing(std::move(regions));
  const OptimKernelTable& kt = optim_kernels();
  int64_t total = 0;
  const std::vector<Chunk> chunks = make_chunks(numels, &total);
  for_each_chunk(chunks, total, [&](int64_t k) {
    const Chunk& c = chunks[k];
    kt.cast(reinterpret_cast<const float*>(srcs[c.seg].ptr), reinterpret_cast<void*>(dsts[c.seg].ptr),
            dsts[c.seg].dtype, c.begin, c.end);
  });
}

}  // namespace cpu
}  // namespace ncclavg
