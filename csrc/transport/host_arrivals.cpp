// The calls' arrival times between hosts on one clock (Note [Arrival times between hosts] in
// host_arrivals.h).
#include "host_arrivals.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "../common/check.h"

namespace ncclavg {
namespace cpu {

namespace {
constexpr int64_t kUnknown = LaneHello::kUnknown;

int world_of(const std::vector<std::vector<int>>& hosts) {
  int n = 0;
  for (const auto& h : hosts) n += static_cast<int>(h.size());
  return n;
}

// NCCLAVG_TEST_CLOCK_SKEW_MS (for tests only): how far this process's clock between hosts is moved, so that
// pretend hosts of one machine stand for hosts whose clocks differ (every process of one pretend host gives
// the same); 0 when unset.
int64_t skew_from_env() {
  const char* s = std::getenv("NCCLAVG_TEST_CLOCK_SKEW_MS");
  if (s == nullptr || *s == '\0') return 0;
  char* end = nullptr;
  const double ms = std::strtod(s, &end);
  NCCLAVG_CHECK_ARG(end != s && *end == '\0' && std::isfinite(ms) && std::fabs(ms) < 1e9,
                    "NCCLAVG_TEST_CLOCK_SKEW_MS", "must be a number of milliseconds, got '", s, "'");
  return static_cast<int64_t>(ms * 1e6);
}
}  // namespace

HostArrival HostArrival::of(const std::vector<int>& ranks, const int64_t* stamps) {
  HostArrival a;
  size_t first = 0, last = 0;
  for (size_t i = 1; i < ranks.size(); ++i) {
    if (stamps[i] < stamps[first]) first = i;
    if (stamps[i] > stamps[last]) last = i;
  }
  a.first_ns = stamps[first];
  a.last_ns = stamps[last];
  a.first_rank = ranks[first];
  a.last_rank = ranks[last];
  for (size_t i = 0; i < ranks.size(); ++i) a.late_sum_ns += stamps[i] - a.first_ns;
  return a;
}

HostArrivals::HostArrivals(const std::vector<std::vector<int>>& hosts, int host)
    : hosts_(hosts), host_(host), skew_ns_(skew_from_env()), heard_(hosts.size()), heard_from_(hosts.size(), -1),
      log_(world_of(hosts)) {
  for (const auto& h : hosts_) labels_.insert(labels_.end(), h.begin(), h.end());
  std::sort(labels_.begin(), labels_.end());
  column_.assign(static_cast<size_t>(labels_.back()) + 1, -1);
  for (size_t i = 0; i < labels_.size(); ++i) column_[labels_[i]] = static_cast<int>(i);
  peers_.resize(column_.size());
  stamps_.resize(labels_.size());
}

int64_t HostArrivals::now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
             .count() +
         skew_ns_;
}

void HostArrivals::begin_one_call() {
  if (call_depth_++ == 0) {
    call_logged_ = false;
    scope_started_ns_ = now() - skew_ns_;
  }
}

void HostArrivals::end_one_call() {
  if (call_depth_ > 0) --call_depth_;
}

void HostArrivals::begin_call() {
  std::fill(heard_.begin(), heard_.end(), HostArrival{});
  std::fill(heard_from_.begin(), heard_from_.end(), -1);
}

void HostArrivals::set_own(const int64_t* stamps) {
  HostArrival a = HostArrival::of(hosts_[host_], stamps);
  a.first_ns += skew_ns_;
  a.last_ns += skew_ns_;
  heard_[host_] = a;
}

LaneHello HostArrivals::hello_to(int peer) const {
  const HostArrival& a = heard_[host_];
  LaneHello h{};
  {
    std::lock_guard<std::mutex> lock(delays_mu_);
    h.min_delay_ns = peers_[peer].d_in;
  }
  h.first_ns = a.first_ns;
  h.last_ns = a.last_ns;
  h.late_sum_ns = a.late_sum_ns;
  h.first_rank = a.first_rank;
  h.last_rank = a.last_rank;
  h.sent_ns = now();   // last: as close to the send as this can be
  return h;
}

void HostArrivals::heard(int peer, int host, const LaneHello& h, int64_t received_ns) {
  Peer& p = peers_[peer];
  if (p.delays.empty()) p.delays.assign(kWindow, kUnknown);
  p.delays[static_cast<size_t>(p.next++ % kWindow)] = received_ns - h.sent_ns;
  int64_t least = kUnknown;
  for (int64_t d : p.delays)
    if (d != kUnknown && (least == kUnknown || d < least)) least = d;
  {
    std::lock_guard<std::mutex> lock(delays_mu_);
    p.d_in = least;
    if (h.min_delay_ns != kUnknown) p.d_out = h.min_delay_ns;
  }
  if (heard_from_[host] < 0 && h.first_ns != kUnknown) {
    heard_from_[host] = peer;
    HostArrival& a = heard_[host];
    a.first_ns = h.first_ns;
    a.last_ns = h.last_ns;
    a.late_sum_ns = h.late_sum_ns;
    a.first_rank = h.first_rank;
    a.last_rank = h.last_rank;
  }
}

int64_t HostArrivals::offset_of(int peer) const {
  std::lock_guard<std::mutex> lock(delays_mu_);
  const Peer& p = peers_[peer];
  if (p.d_in == kUnknown || p.d_out == kUnknown) return kUnknown;
  return (p.d_in - p.d_out) / 2;
}

void HostArrivals::end_call(const int64_t* own_stamps) {
  if (call_depth_ > 0 && call_logged_) return;   // not its user call's first
  for (size_t g = 0; g < hosts_.size(); ++g) {
    if (!heard_[g].known()) return;
    if (static_cast<int>(g) != host_ && offset_of(heard_from_[g]) == kUnknown) return;
  }
  call_logged_ = true;
  for (size_t g = 0; g < hosts_.size(); ++g) {
    const std::vector<int>& ranks = hosts_[g];
    if (static_cast<int>(g) == host_) {   // exact
      for (size_t i = 0; i < ranks.size(); ++i) stamps_[column_[ranks[i]]] = own_stamps[i] + skew_ns_;
      continue;
    }
    const HostArrival& a = heard_[g];
    const int64_t shift = offset_of(heard_from_[g]);
    // the ranks between the first and the last: their mean (Note [Arrival times between hosts])
    const int64_t middle = ranks.size() > 2 ? (a.late_sum_ns - (a.last_ns - a.first_ns)) /
                                                  static_cast<int64_t>(ranks.size() - 2)
                                            : 0;
    for (int r : ranks) {
      const int64_t at = r == a.last_rank ? a.last_ns : r == a.first_rank ? a.first_ns : a.first_ns + middle;
      stamps_[column_[r]] = shift + at;
    }
  }
  log_.add(stamps_.data());
}

}  // namespace cpu
}  // namespace ncclavg
