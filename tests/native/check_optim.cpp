// The optimizer family at the level in use (Adam/AdamW in every form, SGD, the norm, the copy-out cast,
// the inf/NaN scan), against the scalar level bit for bit and against a float64 reference.
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/optim_kernels.h"
#include "harness.h"

namespace harness {

using namespace ncclavg::cpu;
namespace om = ncclavg::om;

namespace {

// optim.cpp's adam_coef: the per-step scalars in double, rounded to float once.
om::AdamCoef adam_coef(double lr, double b1, double b2, double eps, double wd, bool decoupled, bool amsgrad,
                       double step) {
  om::AdamCoef c{};
  c.decoupled = decoupled && wd != 0.0;
  c.decay = static_cast<float>(1.0 - lr * wd);
  c.l2_on = !decoupled && wd != 0.0;
  c.l2 = static_cast<float>(wd);
  c.w1 = static_cast<float>(1.0 - b1);
  c.w1_small = std::fabs(c.w1) < 0.5f;
  c.w1_comp = 1.0f - c.w1;
  c.beta2 = static_cast<float>(b2);
  c.one_minus_beta2 = static_cast<float>(1.0 - b2);
  c.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, step)));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(b1, step)));
  c.amsgrad = amsgrad;
  return c;
}

struct State {
  std::vector<float> p, m, v, vmax;
};

State random_state(int64_t n, Rng& r) {
  State s;
  Buf p(DType::kFloat32, n), m(DType::kFloat32, n), v(DType::kFloat32, n);
  fill(p, n, r, -6, 2);
  fill(m, n, r, -12, -4);
  fill(v, n, r, -24, -8);
  s.p.assign(static_cast<const float*>(p.data()), static_cast<const float*>(p.data()) + n);
  s.m.assign(static_cast<const float*>(m.data()), static_cast<const float*>(m.data()) + n);
  s.v.assign(static_cast<const float*>(v.data()), static_cast<const float*>(v.data()) + n);
  for (float& x : s.v) x = std::fabs(x);
  s.vmax = s.v;
  for (size_t i = 0; i < s.vmax.size(); i += 3) s.vmax[i] *= 2;
  return s;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}

bool same_double(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The towers' mean at i in float64 (Note [Exact tower mean]: the kernels round it to float once).
double tower_mean(const std::vector<Buf>& towers, int64_t i) {
  double s = 0;
  for (const Buf& t : towers) s += t.at(i);
  return s / static_cast<double>(towers.size());
}

struct AdamForm {
  const char* name;
  double b1, wd;
  bool decoupled, amsgrad;
  float inv_scale, clip;
};

const AdamForm kAdamForms[] = {
    {"adamw-unit", 0.9, 0.01, true, false, 1.0f, 1.0f},  {"adamw-scaled", 0.9, 0.01, true, false, 0.5f, 0.75f},
    {"adam-plain", 0.9, 0.0, false, false, 0.25f, 1.0f}, {"adam-l2", 0.9, 0.01, false, false, 1.0f, 1.0f},
    {"amsgrad", 0.9, 0.01, true, true, 1.0f, 0.5f},      {"beta1-small", 0.3, 0.01, true, false, 1.0f, 1.0f},
};

void check_adam(const OptimKernelTable& k, const OptimKernelTable& ref, DType gt, int ntow, DType ot, bool with_out,
                int64_t size, int64_t begin, const AdamForm& f, Rng& rng) {
  std::vector<Buf> towers;
  std::vector<const void*> tp;
  for (int q = 0; q < ntow; ++q) {
    towers.emplace_back(gt, size);
    fill(towers.back(), size, rng, gt == DType::kFloat16 ? -10 : -16, -2);
  }
  // The inputs above keep the tower exponents close: the SIMD levels' float32 tower mean applies (Note
  // [Float32 tower mean when it is exact]). A tiny value in one block sends it to the float64 path.
  if (size > 5 && gt != DType::kFloat32) {
    static_cast<uint16_t*>(towers[0].data())[5] = gt == DType::kFloat16 ? 0x0400 : 0x0d80;  // 2^-14, 2^-100
  }
  for (const Buf& t : towers) tp.push_back(t.data());
  const State s0 = random_state(size, rng);
  const double lr = 1e-3, b2 = 0.999, eps = 1e-8, step = 3;
  const om::AdamCoef c = adam_coef(lr, f.b1, b2, eps, f.wd, f.decoupled, f.amsgrad, step);
  const om::GradCoef gc{f.inv_scale, f.clip};
  const GradSlice g{tp.data(), ntow, gt};
  State sa = s0, sb = s0;
  Buf oa(ot, size), ob(ot, size);
  double qa = -1, qb = -2;
  for (int norm = 0; norm < 2; ++norm) {
    sa = s0;
    sb = s0;
    const AdamSlice xa{sa.p.data(), sa.m.data(), sa.v.data(), f.amsgrad ? sa.vmax.data() : nullptr};
    const AdamSlice xb{sb.p.data(), sb.m.data(), sb.v.data(), f.amsgrad ? sb.vmax.data() : nullptr};
    k.adam(xa, g, OutSlice{with_out ? oa.data() : nullptr, ot}, c, gc, begin, size, norm ? &qa : nullptr);
    ref.adam(xb, g, OutSlice{with_out ? ob.data() : nullptr, ot}, c, gc, begin, size, norm ? &qb : nullptr);
    ++tally().cases;
    check(same(sa.p, sb.p) && same(sa.m, sb.m) && same(sa.v, sb.v) && same(sa.vmax, sb.vmax),
          "adam %s grads %s x%d size=%lld begin=%lld: state differs from the scalar level", f.name,
          ncclavg::dtype_name(gt), ntow, static_cast<long long>(size), static_cast<long long>(begin));
    check(!with_out || std::memcmp(oa.data(), ob.data(), size * ncclavg::dtype_size(ot)) == 0,
          "adam %s: copy-out (%s) differs from the scalar level", f.name, ncclavg::dtype_name(ot));
    if (norm) check(same_double(qa, qb), "adam %s: fused norm %.17g, scalar level %.17g", f.name, qa, qb);
  }
  // float64 reference of the parameter update, from the same float inputs and float coefficients.
  // First-order error propagation, u = 2^-24 per float operation: the gradient (mean rounded once, two
  // scale products) is off by e_g = 3u|g|, plus 2u(|g| + |wd*p|) for the L2 term (which may cancel
  // g: hence absolute errors throughout); m = m + w1*(g - m) by 3u(|m| + |g|) + e_g; v (non-negative
  // terms) by 4u*v + (1-beta2)*2|g|*e_g; denom = sqrt(v)/bc2 + eps by half v's relative error (times
  // the sqrt term's share of denom) + 3u; the step (product, quotient) by 2u more; p*decay and the
  // final sum by u(|p| + |p_new|). The tolerance is that sum with 2x margin for the second-order terms
  // (products of the first-order ones, all << 1).
  for (int64_t i = begin; i < size; ++i) {
    const double gm = tower_mean(towers, i);
    double g = gm * f.inv_scale * f.clip;
    double p = s0.p[i], m = s0.m[i], v = s0.v[i];
    if (c.decoupled) p *= static_cast<double>(c.decay);
    double eg = 3 * kU32 * std::fabs(g);
    if (c.l2_on) {
      eg += 2 * kU32 * (std::fabs(g) + std::fabs(c.l2 * p));
      g += static_cast<double>(c.l2) * p;
    }
    const double w1 = c.w1;
    m = c.w1_small ? m + w1 * (g - m) : g - (g - m) * static_cast<double>(c.w1_comp);
    v = v * static_cast<double>(c.beta2) + static_cast<double>(c.one_minus_beta2) * g * g;
    const double vd = f.amsgrad ? std::max(static_cast<double>(s0.vmax[i]), v) : v;
    const double root = std::sqrt(vd) / static_cast<double>(c.bc2_sqrt);
    const double denom = root + static_cast<double>(c.eps);
    const double upd = static_cast<double>(c.neg_step_size) * m / denom;
    const double pn = p + upd;
    const double em = 3 * kU32 * (std::fabs(s0.m[i]) + std::fabs(g)) + eg;
    const double ev = 4 * kU32 * vd + c.one_minus_beta2 * 2 * std::fabs(g) * eg;
    const double ed = (vd > 0 ? ev / (2 * vd) * root / denom : 0) + 3 * kU32;
    const double tol = 2 * (kU32 * (std::fabs(p) + std::fabs(pn)) + std::fabs(c.neg_step_size) * em / denom +
                            std::fabs(upd) * (ed + 2 * kU32));
    check(std::fabs(sb.p[i] - pn) <= tol, "adam %s grads %s x%d: param %lld is %.9g, float64 reference %.9g (tol %.3g)",
          f.name, ncclavg::dtype_name(gt), ntow, static_cast<long long>(i), sb.p[i], pn, tol);
  }
}

struct SgdForm {
  const char* name;
  double momentum, dampening, wd;
  bool nesterov, first;
};

const SgdForm kSgdForms[] = {
    {"plain", 0.0, 0.0, 0.0, false, false},    {"momentum-first", 0.9, 0.0, 0.0, false, true},
    {"momentum", 0.9, 0.1, 0.01, false, false}, {"nesterov", 0.9, 0.0, 0.01, true, false},
};

void check_sgd(const OptimKernelTable& k, const OptimKernelTable& ref, DType gt, int ntow, DType ot, bool with_out,
               int64_t size, int64_t begin, const SgdForm& f, Rng& rng) {
  std::vector<Buf> towers;
  std::vector<const void*> tp;
  for (int q = 0; q < ntow; ++q) {
    towers.emplace_back(gt, size);
    fill(towers.back(), size, rng, gt == DType::kFloat16 ? -10 : -16, -2);
  }
  for (const Buf& t : towers) tp.push_back(t.data());
  const State s0 = random_state(size, rng);
  om::SgdCoef c{};
  const double lr = 0.01;
  c.neg_lr = static_cast<float>(-lr);
  c.wd_on = f.wd != 0.0;
  c.wd = static_cast<float>(f.wd);
  c.momentum_on = f.momentum != 0.0;
  c.momentum = static_cast<float>(f.momentum);
  c.damp_comp = static_cast<float>(1.0 - f.dampening);
  c.nesterov = f.nesterov;
  c.first = f.first;
  const om::GradCoef gc{0.5f, 0.75f};
  const GradSlice g{tp.data(), ntow, gt};
  State sa = s0, sb = s0;
  Buf oa(ot, size), ob(ot, size);
  double qa = -1, qb = -2;
  const SgdSlice xa{sa.p.data(), c.momentum_on ? sa.m.data() : nullptr};
  const SgdSlice xb{sb.p.data(), c.momentum_on ? sb.m.data() : nullptr};
  k.sgd(xa, g, OutSlice{with_out ? oa.data() : nullptr, ot}, c, gc, begin, size, &qa);
  ref.sgd(xb, g, OutSlice{with_out ? ob.data() : nullptr, ot}, c, gc, begin, size, &qb);
  ++tally().cases;
  check(same(sa.p, sb.p) && same(sa.m, sb.m) && same_double(qa, qb) &&
            (!with_out || std::memcmp(oa.data(), ob.data(), size * ncclavg::dtype_size(ot)) == 0),
        "sgd %s grads %s x%d size=%lld: differs from the scalar level", f.name, ncclavg::dtype_name(gt), ntow,
        static_cast<long long>(size));
  // float64 reference. First order: g off by 3u|g| (mean, two scale products), + 2u|wd*p| with decay;
  // b = b*mu + (1-damp)*g by 3u(|b*mu| + |g|) more; Nesterov's g + mu*b by 2u(|g| + |mu*b|); the
  // product by lr and the final sum by u|lr*g'| + u(|p| + |p_new|); 2x margin for the second order.
  for (int64_t i = begin; i < size; ++i) {
    double g0 = tower_mean(towers, i) * gc.inv_scale * gc.clip;
    const double p = s0.p[i];
    double e = 3 * kU32 * std::fabs(g0);
    if (c.wd_on) {
      e += 2 * kU32 * std::fabs(g0 + c.wd * p);
      g0 += static_cast<double>(c.wd) * p;
    }
    double gu = g0;
    if (c.momentum_on) {
      double b = g0;
      if (!c.first) {
        b = s0.m[i] * static_cast<double>(c.momentum) + static_cast<double>(c.damp_comp) * g0;
        e += 3 * kU32 * (std::fabs(s0.m[i] * c.momentum) + std::fabs(g0));
      }
      gu = c.nesterov ? g0 + static_cast<double>(c.momentum) * b : b;
      if (c.nesterov) e = 2 * e + 2 * kU32 * (std::fabs(g0) + std::fabs(c.momentum * b));
    }
    const double pn = p + static_cast<double>(c.neg_lr) * gu;
    const double tol = 2 * (lr * e + kU32 * std::fabs(lr * gu) + kU32 * (std::fabs(p) + std::fabs(pn)));
    check(std::fabs(sb.p[i] - pn) <= tol, "sgd %s: param %lld is %.9g, float64 reference %.9g", f.name,
          static_cast<long long>(i), sb.p[i], pn);
  }
}

// grad_sumsq, cast and all_finite.
void check_norm_cast_scan(const OptimKernelTable& k, const OptimKernelTable& ref, DType gt, int ntow, int64_t size,
                          Rng& rng) {
  std::vector<Buf> towers;
  std::vector<const void*> tp;
  for (int q = 0; q < ntow; ++q) {
    towers.emplace_back(gt, size);
    fill(towers.back(), size, rng, gt == DType::kFloat16 ? -14 : -40, 8);
  }
  for (const Buf& t : towers) tp.push_back(t.data());
  const GradSlice g{tp.data(), ntow, gt};
  const om::GradCoef gc{0.25f, 1.0f};
  for (int64_t begin : {int64_t{0}, int64_t{16}}) {
    if (begin > size) continue;
    const double a = k.grad_sumsq(g, gc, begin, size), b = ref.grad_sumsq(g, gc, begin, size);
    ++tally().cases;
    check(same_double(a, b), "grad_sumsq %s x%d size=%lld: %.17g, scalar level %.17g", ncclavg::dtype_name(gt),
          ntow, static_cast<long long>(size), a, b);
    // Reference: each g = (mean rounded to float) * 0.25 (exact) errs by u|g|, its square in double by
    // 2u g^2 + 2^-53 g^2, the double sum by n * 2^-53 of the total: 3u + (n + 1) 2^-53, doubled.
    double r = 0;
    for (int64_t i = begin; i < size; ++i) {
      const double x = tower_mean(towers, i) * 0.25;
      r += x * x;
    }
    const double tol = 2 * (2 * kU32 + (size + 1) * std::ldexp(1.0, -53)) * r + 1e-300;
    check(std::fabs(b - r) <= tol, "grad_sumsq %s: %.17g, float64 reference %.17g", ncclavg::dtype_name(gt), b, r);
  }
  // The copy-out cast of float32 values to every type.
  Buf src(DType::kFloat32, size);
  fill(src, size, rng, -30, 30);
  for (DType d : kDtypes) {
    Buf oa(d, size), ob(d, size);
    k.cast(static_cast<const float*>(src.data()), oa.data(), d, 0, size);
    ref.cast(static_cast<const float*>(src.data()), ob.data(), d, 0, size);
    ++tally().cases;
    check(std::memcmp(oa.data(), ob.data(), size * ncclavg::dtype_size(d)) == 0, "cast to %s size=%lld differs",
          ncclavg::dtype_name(d), static_cast<long long>(size));
    for (int64_t i = 0; i < size; ++i) {
      const double x = src.at(i), y = ob.at(i);
      const bool over = std::fabs(x) > max_finite(d);
      check(over ? stored_nonfinite(d, ob.data(), i) || std::fabs(y) == max_finite(d)
                 : std::fabs(y - x) <= unit_roundoff(d) * std::fabs(x) + subnormal_step(d) / 2,
            "cast to %s: element %lld is %.9g for %.9g", ncclavg::dtype_name(d), static_cast<long long>(i), y, x);
    }
  }
  // The scan: clean towers, then an inf/NaN planted at the first, a middle and the last element.
  for (int kind = -1; kind < 3; ++kind) {
    for (int64_t at : {int64_t{0}, size / 2, size - 1}) {
      if (size == 0 && kind >= 0) continue;
      std::vector<Buf> t2 = towers;
      if (kind >= 0) plant(t2[static_cast<size_t>(ntow - 1)], at, kind);
      std::vector<const void*> p2;
      for (const Buf& t : t2) p2.push_back(t.data());
      const GradSlice g2{p2.data(), ntow, gt};
      const bool fa = k.all_finite(g2, 0, size), fb = ref.all_finite(g2, 0, size);
      ++tally().cases;
      check(fa == fb && fb == (kind < 0), "all_finite %s x%d size=%lld planted %d at %lld: %d, scalar level %d",
            ncclavg::dtype_name(gt), ntow, static_cast<long long>(size), kind, static_cast<long long>(at), fa, fb);
    }
  }
}

}  // namespace

void check_optim(bool quick) {
  const OptimKernelTable& k = optim_kernels();
  const OptimKernelTable& ref = kScalarOptimKernels;
  Rng rng(3);
  for (DType gt : kDtypes) {
    for (int ntow : {1, 2, 3, 4}) {
      for (int64_t size : sizes(quick)) {
        if (size > 5000) continue;  // the optimizer's blocks are 16 wide: the small sizes reach every tail
        for (const AdamForm& f : kAdamForms) {
          for (int o = 0; o < 4; ++o) {
            const DType ot = o == 0 ? DType::kFloat32 : kDtypes[o - 1];
            check_adam(k, ref, gt, ntow, ot, o != 0, size, 0, f, rng);
          }
          if (size > 32) check_adam(k, ref, gt, ntow, DType::kBFloat16, true, size, 32, f, rng);
        }
        for (const SgdForm& f : kSgdForms) {
          for (int o = 0; o < 2; ++o) check_sgd(k, ref, gt, ntow, DType::kBFloat16, o != 0, size, 0, f, rng);
        }
        check_norm_cast_scan(k, ref, gt, ntow, size, rng);
      }
    }
  }
}

}  // namespace harness
