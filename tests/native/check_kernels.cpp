// The average, sum and pack families at the level in use, against the scalar level (bit for bit, with
// the same inf/NaN answer) and against a float64 reference.
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/pack.h"
#include "cpu/simd.h"
#include "harness.h"

namespace harness {

using namespace ncclavg::cpu;

namespace {

// Binary exponent range of the inputs: for float16 small enough that the sums of up to 5 stay finite,
// otherwise a wide span (the fp32 sums then round at many scales).
int hi_exp(DType t) { return t == DType::kFloat16 ? 12 : 20; }
int lo_exp(DType t) { return t == DType::kFloat16 ? -14 : -20; }

bool same_bytes(const Buf& a, const Buf& b, int64_t n) {
  return std::memcmp(a.data(), b.data(), static_cast<size_t>(n) * ncclavg::dtype_size(a.t)) == 0;
}

int64_t first_difference(const Buf& a, const Buf& b, int64_t n) {
  const size_t w = ncclavg::dtype_size(a.t);
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a.bytes.data() + i * w, b.bytes.data() + i * w, w) != 0) return i;
  }
  return -1;
}

// A reference value that says "any answer": the fp32 accumulation itself overflows (the kernels then
// write inf by design) or the exact value sits at the edge of the storage type's range.
constexpr double kAnything = 1e300;

// The written values are within `tol(i)` of the float64 reference, and the inf/NaN answer is whether
// one of them is an inf/NaN. A value the reference puts at or beyond the storage type's range may
// round to inf (the flag must then say so); an inf/NaN elsewhere is a failure.
template <class Ref, class Tol>
void against_reference(const char* what, const Buf& out, int64_t begin, int64_t end, bool flag, Ref ref, Tol tol) {
  bool any = false;
  for (int64_t i = begin; i < end; ++i) {
    const double r = ref(i), y = out.at(i);
    const bool bad = stored_nonfinite(out.t, out.data(), i);
    any = any || bad;
    if (r == kAnything) continue;
    if (!std::isfinite(r) || std::fabs(r) > max_finite(out.t) * (1 - unit_roundoff(out.t))) {
      check(bad || std::fabs(y - r) <= tol(i), "%s %s: element %lld: %.9g for out-of-range reference %.9g", what,
            ncclavg::dtype_name(out.t), static_cast<long long>(i), y, r);
      continue;
    }
    check(!bad && std::fabs(y - r) <= tol(i), "%s %s: element %lld is %.9g, reference %.9g (tolerance %.3g)", what,
          ncclavg::dtype_name(out.t), static_cast<long long>(i), y, r, tol(i));
  }
  check(flag == any, "%s %s: inf/NaN answer %d, written values say %d", what, ncclavg::dtype_name(out.t), flag, any);
}

// Where an input is an inf or a NaN: -1 none, else planted at element `at` of buffer 0 (kind 0-2), or a
// finite overflow (two large values whose sum leaves the range).
struct Special {
  int kind;  // -1 none, 0 +inf, 1 -inf, 2 NaN, 3 overflow
  int64_t at;
};

std::vector<Special> specials(int64_t n) {
  if (n == 0) return {{-1, 0}};
  return {{-1, 0}, {0, n - 1}, {1, n / 2}, {2, 0}, {3, n - 1}};
}

void plant_special(std::vector<Buf>& bufs, const Special& s) {
  if (s.kind < 0) return;
  if (s.kind < 3) {
    plant(bufs[0], s.at, s.kind);
    return;
  }
  for (Buf& b : bufs) {  // each at 3/4 of the largest finite: a sum of two overflows
    const double big = max_finite(b.t) * 0.75;
    if (b.t == DType::kFloat32) static_cast<float*>(b.data())[s.at] = static_cast<float>(big);
    else if (b.t == DType::kBFloat16) static_cast<uint16_t*>(b.data())[s.at] = 0x7f40;  // 0.75 * 2^128
    else static_cast<uint16_t*>(b.data())[s.at] = 0x79ff;                               // 49120
  }
}

void check_average(const KernelTable& k, const KernelTable& ref, DType t, int n, int64_t size, Rng& rng) {
  const int64_t begin = size > 5 ? 3 : 0;  // a slice not at a vector boundary
  for (const Special& sp : specials(size)) {
    for (int checked = 0; checked < 2; ++checked) {
      std::vector<Buf> a, b;
      for (int q = 0; q < n; ++q) {
        a.emplace_back(t, size);
        fill(a.back(), size, rng, lo_exp(t), hi_exp(t));
      }
      if (sp.kind == 3 && n < 2) continue;
      plant_special(a, sp);
      b = a;
      const std::vector<Buf> in = a;
      std::vector<void*> pa, pb;
      for (int q = 0; q < n; ++q) {
        pa.push_back(a[q].data());
        pb.push_back(b[q].data());
      }
      bool fa = false, fb = false;
      k.average(pa.data(), n, t, begin, size, checked ? &fa : nullptr);
      ref.average(pb.data(), n, t, begin, size, checked ? &fb : nullptr);
      ++tally().cases;
      for (int q = 0; q < n; ++q) {
        const int64_t d = first_difference(a[q], b[q], size);
        check(d < 0, "average %s n=%d size=%lld: buffer %d differs from the scalar level at %lld",
              ncclavg::dtype_name(t), n, static_cast<long long>(size), q, static_cast<long long>(d));
      }
      check(fa == fb, "average %s n=%d size=%lld: inf/NaN answer %d, scalar level %d", ncclavg::dtype_name(t), n,
            static_cast<long long>(size), fa, fb);
      if (begin > 0) check(same_bytes(a[0], in[0], begin), "average wrote before its slice");
      if (!checked) continue;
      // float64 reference: the exact sum S of n values; the fp32 sum's n-1 roundings err by at most
      // (n-1)*u*sum|x| (first order), the division and the storage rounding by (u + u_s)*|mean| more;
      // 1.01 covers the second-order terms ((n*u)^2 << 0.01), one subnormal step the rounding floor.
      const double us = unit_roundoff(t);
      auto refv = [&](int64_t i) {
        double s = 0, sa = 0;
        for (int q = 0; q < n; ++q) {
          s += in[q].at(i);
          sa += std::fabs(in[q].at(i));
        }
        return sa >= 0.99 * max_finite(DType::kFloat32) ? kAnything : s / n;
      };
      auto tol = [&](int64_t i) {
        double sa = 0;
        for (int q = 0; q < n; ++q) sa += std::fabs(in[q].at(i));
        return 1.01 * ((n - 1) * kU32 * sa / n + (kU32 + us) * std::fabs(refv(i))) + subnormal_step(t);
      };
      against_reference("average", a[0], begin, size, fa, refv, tol);
    }
  }
}

void check_sum(const KernelTable& k, const KernelTable& ref, DType t, int n, int64_t size, Rng& rng) {
  const float muls[][2] = {{1.0f, 1.0f}, {0.5f, 1.0f}, {1.0f, 3.0f}, {0.1f, 3.0f}};
  for (const auto& md : muls) {
    for (const Special& sp : specials(size)) {
      for (int two = 0; two < 2; ++two) {
        std::vector<Buf> srcs;
        for (int q = 0; q < n; ++q) {
          srcs.emplace_back(t, size);
          fill(srcs.back(), size, rng, lo_exp(t), hi_exp(t));
        }
        if (sp.kind == 3 && n < 2) continue;
        plant_special(srcs, sp);
        std::vector<const void*> ps;
        for (const Buf& s : srcs) ps.push_back(s.data());
        Buf oa(t, size), ob(t, size), oa2(t, size), ob2(t, size);
        bool fa = false, fb = false;
        k.sum(oa.data(), two ? oa2.data() : nullptr, ps.data(), n, t, md[0], md[1], 0, size, &fa);
        ref.sum(ob.data(), two ? ob2.data() : nullptr, ps.data(), n, t, md[0], md[1], 0, size, &fb);
        ++tally().cases;
        check(same_bytes(oa, ob, size) && same_bytes(oa2, ob2, size) && fa == fb,
              "sum %s n=%d size=%lld mul=%g div=%g: differs from the scalar level (first at %lld, flags %d/%d)",
              ncclavg::dtype_name(t), n, static_cast<long long>(size), md[0], md[1],
              static_cast<long long>(first_difference(oa, ob, size)), fa, fb);
        if (two) check(same_bytes(oa, oa2, size), "sum: out2 differs from out");
        // Reference S*mul/div: the fp32 sum errs by (n-1)*u*sum|x| (scaled by |mul/div|), the rounding
        // to storage before the scale, the product, the quotient and the final rounding by
        // (2*u_s + 2*u)*|ref|; 1.01 and the subnormal floors as in the average.
        const double us = unit_roundoff(t), f = static_cast<double>(md[0]) / md[1];
        // The sum is rounded to storage before the scale: beyond the storage range it is inf whatever
        // the scale, at its edge either.
        auto refv = [&](int64_t i) {
          double s = 0, sa = 0;
          for (int q = 0; q < n; ++q) {
            s += srcs[q].at(i);
            sa += std::fabs(srcs[q].at(i));
          }
          if (sa >= 0.99 * max_finite(DType::kFloat32)) return kAnything;
          if (md[0] == 1.0f && md[1] == 1.0f) return s;
          if (std::fabs(s) >= 1.01 * max_finite(t)) return s > 0 ? HUGE_VAL : -HUGE_VAL;
          return std::fabs(s) >= 0.99 * max_finite(t) ? kAnything : s * f;
        };
        auto tol = [&](int64_t i) {
          double sa = 0;
          for (int q = 0; q < n; ++q) sa += std::fabs(srcs[q].at(i));
          return 1.01 * ((n - 1) * kU32 * sa * f + (2 * us + 2 * kU32) * std::fabs(refv(i))) +
                 2 * subnormal_step(t);
        };
        against_reference("sum", oa, 0, size, fa, refv, tol);
      }
    }
  }
}

void check_convert(const PackKernelTable& k, const PackKernelTable& ref, DType s, DType d, int64_t size, Rng& rng) {
  const float muls[][2] = {{1.0f, 1.0f}, {0.5f, 1.0f}, {1.0f, 3.0f}, {1024.0f, 7.0f}};
  for (const auto& md : muls) {
    for (const Special& sp : specials(size)) {
      if (sp.kind == 3) continue;
      for (int checked = 0; checked < 2; ++checked) {
        std::vector<Buf> src{Buf(s, size)};
        fill(src[0], size, rng, s == DType::kFloat16 ? -14 : -30, s == DType::kFloat16 ? 15 : 30);
        plant_special(src, sp);
        Buf oa(d, size), ob(d, size);
        bool fa = false, fb = false;
        k.convert(src[0].data(), s, oa.data(), d, size, md[0], md[1], checked ? &fa : nullptr);
        ref.convert(src[0].data(), s, ob.data(), d, size, md[0], md[1], checked ? &fb : nullptr);
        ++tally().cases;
        check(same_bytes(oa, ob, size) && fa == fb,
              "pack %s->%s size=%lld mul=%g div=%g: differs from the scalar level (first at %lld, flags %d/%d)",
              ncclavg::dtype_name(s), ncclavg::dtype_name(d), static_cast<long long>(size), md[0], md[1],
              static_cast<long long>(first_difference(oa, ob, size)), fa, fb);
        if (!checked) continue;
        // Reference x*mul/div: product, quotient (u each) and the rounding to d (u_d), first order;
        // 1.01 and a subnormal floor (the fp32 intermediate's and d's) as above.
        const double f = static_cast<double>(md[0]) / md[1];
        auto refv = [&](int64_t i) { return src[0].at(i) * f; };
        auto tol = [&](int64_t i) {
          return 1.01 * (2 * kU32 + unit_roundoff(d)) * std::fabs(refv(i)) + subnormal_step(d) +
                 std::ldexp(1.0, -149) * (1 + f);
        };
        against_reference("pack", oa, 0, size, fa, refv, tol);
      }
    }
  }
}

}  // namespace

void check_average_and_sum(bool quick) {
  const KernelTable& k = kernels();
  Rng rng(1);
  for (DType t : kDtypes) {
    for (int n : {1, 2, 3, 5}) {
      for (int64_t size : sizes(quick)) {
        check_average(k, kScalarKernels, t, n, size, rng);
        check_sum(k, kScalarKernels, t, n, size, rng);
      }
    }
  }
}

void check_pack(bool quick) {
  const PackKernelTable& k = pack_kernels();
  Rng rng(2);
  for (DType s : kDtypes) {
    for (DType d : kDtypes) {
      for (int64_t size : sizes(quick)) check_convert(k, kScalarPackKernels, s, d, size, rng);
    }
  }
}

}  // namespace harness
