// Fused CPU optimizers over flat fp32 tensors ("segments"): AdamW/Adam and SGD (momentum, dampening,
// Nesterov). One call updates many segments; gradients come as one buffer per segment or as N tower
// buffers averaged on the fly (float32/bfloat16/float16); loss-scale unscaling, inf/NaN skip, global
// grad-norm clipping and a copy-out of the new params (float32/bfloat16/float16) are fused in.
//
// Note [Two passes, no partial updates]
// Whether a step is skipped (a non-finite gradient) and the clip factor both depend on every gradient
// of the step, so they are decided by a first, read-only pass over all segments before any parameter
// or state is written: grad_sumsq for the clip factor, or only a scan of the raw bits for inf/NaN (see
// Note [The inf/NaN check as a scan] in optim.cpp), or no pass at all when the pass that wrote the
// gradients already said they are finite (GradOptions::grads_finite). When neither is asked for, the
// step is a single pass. A skipped step writes nothing: params, moments, momentum buffers and step counts stay as they
// were (the copy-out, when given, still receives the current params so that it always mirrors them).
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "../common/buffer.h"

namespace ncclavg {
namespace cpu {

struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled = true;  // AdamW (decay the params) vs Adam (L2 term added to the gradient)
  bool amsgrad = false;
  bool maximize = false;
};

struct SgdHyper {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// What happens to the gradients before the update. See Note [Two passes, no partial updates].
struct GradOptions {
  double grad_scale = 1.0;               // loss scale: grads are multiplied by float(1/grad_scale)
  bool check_finite = false;             // skip the whole step when any gradient is inf/NaN
  std::optional<double> max_grad_norm;   // clip the global L2 norm (torch.nn.utils.clip_grad_norm_)
  double clip_coef = 1.0;                // a factor decided by the caller (steps split over calls)
  // Also sum the squares of the (unclipped) gradients during the update, continuing from this value:
  // the sums of calls made one after another in grad_stats' segment order equal grad_stats' sumsq bit
  // for bit. Not with max_grad_norm (that norm is known before the update).
  std::optional<double> sumsq_start;
  // What the pass that wrote the gradients noted about them (Note [Finiteness from the pass that writes]
  // in common/finite_math.h): true lets check_finite skip its scan, as a scan that passed would (the
  // grads must be exactly what that pass wrote); false or none: the first pass runs as without it.
  std::optional<bool> grads_finite;
};

struct GradStats {
  double sumsq = 0.0;      // sum of squares of the unscaled (averaged) gradients, in double
  double norm = 0.0;       // sqrt(sumsq)
  bool finite = true;
  double clip_coef = 1.0;  // min(1, max_norm / (norm + 1e-6)) in float, as torch computes it
};

struct StepResult {
  bool skipped = false;
  bool stats_computed = false;  // grad_norm (and sumsq) are valid: computed before or during the update
  double sumsq = 0.0;
  double grad_norm = 0.0;
  double clip_coef = 1.0;
};

// The first pass alone: norm and finiteness of the averaged, unscaled gradients of all segments
// (grads[tower][segment]); clip_coef for max_grad_norm when given.
GradStats grad_stats(const std::vector<std::vector<Buffer>>& grads, double grad_scale,
                     std::optional<double> max_grad_norm);

// Whether the averaged, unscaled gradients are all finite: grad_stats(...).finite, most often from a
// scan of the raw bits alone (see Note [The inf/NaN check as a scan] in optim.cpp).
bool grads_finite(const std::vector<std::vector<Buffer>>& grads, double grad_scale);

// Note [Step counters as tensors]
// torch keeps Adam's step count per tensor as a float32 scalar tensor and increments it before the
// update. Callers either pass the step numbers this update makes (`steps`, >= 1), or the counters
// themselves (`step_tensors`: float32 buffers of one element): then the core reads each, adds 1 in
// float32 as torch does, uses that, and writes it back only when the step is not skipped. The second
// form saves the Python optimizers two tensor ops per parameter per step.
//
// params[s], exp_avg[s], exp_avg_sq[s] (, max_exp_avg_sq[s] with amsgrad): float32, same numel;
// grads[t][s]: numel of params[s]; out: empty or one buffer per segment.
StepResult adam_step(const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
                     const std::vector<Buffer>& exp_avg, const std::vector<Buffer>& exp_avg_sq,
                     const std::vector<Buffer>& max_exp_avg_sq, const std::vector<double>& steps,
                     const std::vector<Buffer>& out, const AdamHyper& hp, const GradOptions& go,
                     const std::vector<Buffer>& step_tensors = {});

// momentum_buffers: empty when momentum == 0, else one per segment; first[s]: segment s has no momentum
// buffer yet (torch's `buf is None`): it becomes the gradient.
StepResult sgd_step(const std::vector<Buffer>& params, const std::vector<std::vector<Buffer>>& grads,
                    const std::vector<Buffer>& momentum_buffers, const std::vector<bool>& first,
                    const std::vector<Buffer>& out, const SgdHyper& hp, const GradOptions& go);

// dsts[s] = srcs[s] (float32) rounded to dsts[s]'s dtype, round to nearest even.
void cast_copy(const std::vector<Buffer>& srcs, const std::vector<Buffer>& dsts);

}  // namespace cpu
}  // namespace ncclavg
