// The channel's collectives, each a sequence of rounds: see Note [Shared-memory channel] in
// shm_channel.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/check.h"
#include "shm_internal.h"
#include "../cpu/pack.h"
#include "../cpu/simd.h"

namespace ncclavg {
namespace cpu {
using namespace shm_detail;

namespace {
constexpr int64_t kDirectBytes = 32 << 10;   // below: every rank sums the whole chunk

// copy_bytes of n elements; bad != nullptr: through the core's checked copy (the same bits, and *bad |=
// whether one of them is an inf/NaN), so that everything a rank writes into its output is checked.
void copy_elems(ShmType t, unsigned char* dst, const unsigned char* src, int64_t n, bool* bad) {
  const int64_t es = static_cast<int64_t>(type_size(t));
  if (bad == nullptr || n <= 0) {
    copy_bytes(dst, src, n * es);
    return;
  }
  bool seen = false;
  if (t == ShmType::kFloat64) {
    copy_bytes(dst, src, n * es);
    const auto* d = reinterpret_cast<const double*>(dst);
    for (int64_t i = 0; i < n; ++i) seen |= !std::isfinite(d[i]);
  } else {
    const DType dt = static_cast<DType>(t);
    pack_kernels().convert(src, dt, dst, dt, n, 1.0f, 1.0f, &seen);
  }
  *bad |= seen;
}

// A call's description: its name, validated element type and timeout, and its signature (Note [Call
// signatures] in shm_calls.cpp): `root` is the wire root of a broadcast, -1 for the other ops (whose
// root field then holds the user's root).
template <class Call>
Call make_call(const char* op, int op_id, int type, int root, int64_t count, double mul, double div,
               double timeout_s, const ShmCallTag& tag) {
  const ShmType t = checked_type(type);
  NCCLAVG_CHECK_ARG(!std::isnan(timeout_s) && timeout_s > 0, "timeout_s", "must be > 0, got ", timeout_s);
  NCCLAVG_CHECK_ARG(std::isfinite(mul) && std::isfinite(div) && div != 0, "mul/div",
                    "must be finite with div != 0, got ", mul, " / ", div);
  check_call_tag(tag, "tag");
  Call c{op, t, count, mul, div, tag, timeout_s, {}, {}};
  const uint64_t root_field = static_cast<uint64_t>(op_id == kBroadcast ? root + 1 : tag.root() + 1);
  c.sig[0] = static_cast<uint64_t>(op_id) | static_cast<uint64_t>(type) << 4 | root_field << kSigRootShift |
             (tag.word & 0xffffff) << kSigCollectiveShift;
  c.sig[1] = count_word(count, tag.count, mul, div);
  return c;
}

// Elements per rank's slice of an all-reduce chunk of n: a multiple of 32 (64-byte aligned slices).
int64_t slice_of(int64_t n, int nranks) { return ((n + nranks - 1) / nranks + 31) / 32 * 32; }
}  // namespace

// out (and out2 unless null) = (srcs[0] + ... + srcs[nsrc-1]) * mul / div over n elements. bad != nullptr:
// *bad |= whether a written value is an inf/NaN (Note [Finiteness from the pass that writes] in
// csrc/common/finite_math.h), noted in the same pass.
void shm_detail::sum_into(ShmType t, unsigned char* out, unsigned char* out2, const unsigned char* const* srcs, int nsrc,
              int64_t n, double mul, double div, bool* bad) {
  if (n <= 0) return;
  if (t == ShmType::kFloat64) {
    auto* o = reinterpret_cast<double*>(out);
    auto* o2 = reinterpret_cast<double*>(out2);
    bool seen = false;
    for (int64_t i = 0; i < n; ++i) {
      double acc = reinterpret_cast<const double*>(srcs[0])[i];
      for (int r = 1; r < nsrc; ++r) acc += reinterpret_cast<const double*>(srcs[r])[i];
      if (mul != 1.0) acc *= mul;
      if (div != 1.0) acc /= div;
      o[i] = acc;
      if (o2 != nullptr) o2[i] = acc;
      seen |= !std::isfinite(acc);
    }
    if (bad != nullptr) *bad |= seen;
    return;
  }
  bool seen = false;
  kernels().sum(out, out2, reinterpret_cast<const void* const*>(srcs), nsrc, static_cast<DType>(t),
                static_cast<float>(mul), static_cast<float>(div), 0, n, bad != nullptr ? &seen : nullptr);
  if (bad != nullptr) *bad |= seen;
}


void ShmChannel::all_reduce_sum(uintptr_t data, int64_t count, int type, double timeout_s, double mul, double div,
                                ShmCallTag tag, bool* nonfinite) {
  Call call = make_call<Call>("all_reduce_sum", kAllReduce, type, -1, count, mul, div, timeout_s, tag);
  check_span(data, count, "data");
  begin(call);
  const int64_t es = static_cast<int64_t>(type_size(call.type));
  const int64_t chunk = slot_bytes_ / es;
  auto* base = reinterpret_cast<unsigned char*>(data);
  ShmSources srcs(nranks_);
  if (nonfinite != nullptr) *nonfinite = false;
  int64_t off = 0;
  do {
    const int64_t n = std::min(chunk, count - off);
    unsigned char* mine = base + off * es;
    uint64_t seq;
    if (n * es <= kDirectBytes || nranks_ == 1) {
      seq = post_round(call, [&](unsigned char* s) { copy_bytes(s, mine, n * es); });
      for (int r = 0; r < nranks_; ++r) srcs[r] = r == rank_ ? mine : slot(seq, r);
      sum_into(call.type, mine, nullptr, srcs.data(), nranks_, n, mul, div, nonfinite);
    } else {
      const int64_t per = slice_of(n, nranks_);
      const int64_t lo = std::min(n, rank_ * per), hi = std::min(n, lo + per);
      seq = post_round(call, [&](unsigned char* s) {   // every slice but this rank's own
        copy_bytes(s, mine, lo * es);
        copy_bytes(s + hi * es, mine + hi * es, (n - hi) * es);
      });
      for (int r = 0; r < nranks_; ++r) srcs[r] = (r == rank_ ? mine : slot(seq, r)) + lo * es;
      sum_into(call.type, mine + lo * es, slot(seq, rank_) + lo * es, srcs.data(), nranks_, hi - lo, mul, div,
               nonfinite);
      publish(kReduced, seq);
      for (int i = 1; i < nranks_; ++i) {   // each slice as soon as its owner has summed it
        const int r = (rank_ + i) % nranks_;
        const int64_t rlo = std::min(n, r * per), rhi = std::min(n, rlo + per);
        if (rhi <= rlo) continue;
        wait_for(kReduced, seq, r, call, seq);
        copy_elems(call.type, mine + rlo * es, slot(seq, r) + rlo * es, rhi - rlo, nonfinite);
      }
    }
    publish(kConsumed, seq);
    off += n;
  } while (off < count);
}

void ShmChannel::reduce_scatter_sum(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s,
                                    double mul, double div, ShmCallTag tag, bool* nonfinite) {
  Call call = make_call<Call>("reduce_scatter_sum", kReduceScatter, type, -1, count, mul, div, timeout_s, tag);
  check_span(in, count, "in");
  check_span(out, count, "out");
  begin(call);
  const int64_t es = static_cast<int64_t>(type_size(call.type));
  // a round carries `piece` elements for every destination rank
  const int64_t fit = slot_bytes_ / es / nranks_;
  const int64_t piece = fit >= 32 ? fit / 32 * 32 : fit;
  const auto* src = reinterpret_cast<const unsigned char*>(in);
  auto* dst = reinterpret_cast<unsigned char*>(out);
  ShmSources srcs(nranks_);
  if (nonfinite != nullptr) *nonfinite = false;
  int64_t off = 0;
  do {
    const int64_t m = std::min(piece, count - off);
    const uint64_t seq = post_round(call, [&](unsigned char* s) {
      for (int d = 0; d < nranks_; ++d) {
        if (d != rank_) copy_bytes(s + d * piece * es, src + (d * count + off) * es, m * es);
      }
    });
    for (int r = 0; r < nranks_; ++r) {
      srcs[r] = r == rank_ ? src + (rank_ * count + off) * es : slot(seq, r) + rank_ * piece * es;
    }
    sum_into(call.type, dst + off * es, nullptr, srcs.data(), nranks_, m, mul, div, nonfinite);
    publish(kConsumed, seq);
    off += m;
  } while (off < count);
}

void ShmChannel::all_gather(uintptr_t in, uintptr_t out, int64_t count, int type, double timeout_s, ShmCallTag tag) {
  Call call = make_call<Call>("all_gather", kAllGather, type, -1, count, 1.0, 1.0, timeout_s, tag);
  check_span(in, count, "in");
  check_span(out, count, "out");
  begin(call);
  const int64_t es = static_cast<int64_t>(type_size(call.type));
  const int64_t chunk = slot_bytes_ / es;
  const auto* src = reinterpret_cast<const unsigned char*>(in);
  auto* dst = reinterpret_cast<unsigned char*>(out);
  int64_t off = 0;
  do {
    const int64_t n = std::min(chunk, count - off);
    const uint64_t seq = post_round(call, [&](unsigned char* s) { copy_bytes(s, src + off * es, n * es); });
    for (int r = 0; r < nranks_; ++r) {
      unsigned char* to = dst + (r * count + off) * es;
      const unsigned char* from = r == rank_ ? src + off * es : slot(seq, r);
      if (to != from && n > 0) std::memmove(to, from, static_cast<size_t>(n * es));   // in may be out's own block
    }
    publish(kConsumed, seq);
    off += n;
  } while (off < count);
}

void ShmChannel::broadcast(uintptr_t data, int64_t count, int type, int root, double timeout_s, ShmCallTag tag) {
  NCCLAVG_CHECK_ARG(root >= 0 && root < nranks_, "root", "must be in [0, ", nranks_, "), got ", root);
  Call call = make_call<Call>("broadcast", kBroadcast, type, root, count, 1.0, 1.0, timeout_s, tag);
  check_span(data, count, "data");
  begin(call);
  const int64_t es = static_cast<int64_t>(type_size(call.type));
  const int64_t chunk = slot_bytes_ / es;
  auto* base = reinterpret_cast<unsigned char*>(data);
  int64_t off = 0;
  do {
    const int64_t n = std::min(chunk, count - off);
    // every rank posts (the root its data, the others only their call), so every rank checks the root
    const uint64_t seq = post_round(call, [&](unsigned char* s) {
      if (rank_ == root) copy_bytes(s, base + off * es, n * es);
    });
    if (rank_ != root) copy_bytes(base + off * es, slot(seq, root), n * es);
    publish(kConsumed, seq);
    off += n;
  } while (off < count);
}

void ShmChannel::barrier(double timeout_s, ShmCallTag tag) {
  Call call = make_call<Call>("barrier", kBarrier, 0, -1, 0, 1.0, 1.0, timeout_s, tag);
  begin(call);
  const uint64_t seq = post_round(call, [](unsigned char*) {});
  publish(kConsumed, seq);
}

}  // namespace cpu
}  // namespace ncclavg
