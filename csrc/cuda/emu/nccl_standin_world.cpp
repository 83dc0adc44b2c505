// The stand-in NCCL's rendezvous and data exchange: See Note [Stand-in rendezvous] in nccl_standin.h.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "nccl_standin.h"

namespace ncclemu {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_s(double s) {
  if (s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

size_t dtype_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

bool dtype_known(ncclDataType_t t) { return static_cast<int>(t) >= 0 && static_cast<int>(t) <= 9; }

namespace {

std::string base_dir() {
  for (const char* v : {"NCCLEMU_DIR", "TMPDIR"}) {
    const char* d = std::getenv(v);
    if (d && d[0]) return d;
  }
  return "/tmp";
}

std::string data_path(const ncclComm* c, uint64_t seq, int rank) {
  return c->dir + "/c" + std::to_string(seq) + "-r" + std::to_string(rank);
}

bool write_all(const std::string& path, const void* p, size_t n) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return false;
  const char* b = static_cast<const char*>(p);
  size_t done = 0;
  while (done < n) {
    const ssize_t w = write(fd, b + done, n - done);
    if (w <= 0) break;
    done += static_cast<size_t>(w);
  }
  close(fd);
  return done == n;
}

bool read_all(const std::string& path, void* p, size_t n) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  char* b = static_cast<char*>(p);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = read(fd, b + done, n - done);
    if (r <= 0) break;
    done += static_cast<size_t>(r);
  }
  close(fd);
  return done == n;
}

// Polls until pred() or the communicator is aborted; false when aborted.
template <typename Pred>
bool wait_until(ncclComm* c, Pred pred) {
  while (!pred()) {
    if (c->abort.load()) return false;
    sleep_s(200e-6);
  }
  return true;
}

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float load(const void* p, size_t i, ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return static_cast<const float*>(p)[i];
    case ncclFloat16: return static_cast<float>(static_cast<const _Float16*>(p)[i]);
    case ncclBfloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return 0;
  }
}

void store(void* p, size_t i, ncclDataType_t t, float v) {
  switch (t) {
    case ncclFloat32: static_cast<float*>(p)[i] = v; break;
    case ncclFloat16: static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v); break;
    case ncclBfloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: break;
  }
}

// x * scalar rounded to the element type (NCCL multiplies in the element type), widened again.
float premultiplied(float x, float scalar, ncclDataType_t t) {
  if (scalar == 1.0f) return x;
  float tmp[1];
  uint16_t h[1];
  switch (t) {
    case ncclFloat16: static_cast<_Float16*>(static_cast<void*>(h))[0] = static_cast<_Float16>(x * scalar); return load(h, 0, t);
    case ncclBfloat16: h[0] = float_to_bf16(x * scalar); return load(h, 0, t);
    default: tmp[0] = x * scalar; return tmp[0];
  }
}

}  // namespace

std::string id_dir(const ncclUniqueId& id) {
  static const char* hex = "0123456789abcdef";
  std::string name = "ncclemu-";
  for (int i = 8; i < 24; ++i) {  // the random bytes after the 8-byte magic
    const unsigned char b = static_cast<unsigned char>(id.internal[i]);
    name += hex[b >> 4];
    name += hex[b & 15];
  }
  return base_dir() + "/" + name;
}

ncclResult_t open_control(ncclComm* c) {
  mkdir(c->dir.c_str(), 0700);  // EEXIST when another rank was first
  const std::string path = c->dir + "/ctl";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) return ncclSystemError;
  if (ftruncate(fd, sizeof(Control)) != 0) {  // every rank sets the same size: the content stays
    close(fd);
    return ncclSystemError;
  }
  void* m = mmap(nullptr, sizeof(Control), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return ncclSystemError;
  c->ctl = static_cast<Control*>(m);
  return ncclSuccess;
}

ncclResult_t join(ncclComm* c) {
  Control* k = c->ctl;
  int expected = 0;
  if (!k->nranks.compare_exchange_strong(expected, c->nranks) && expected != c->nranks) {
    std::fprintf(stderr, "ncclemu: rank %d joined with nranks %d, the communicator has %d\n", c->rank, c->nranks,
                 expected);
    return ncclInvalidUsage;
  }
  k->key[c->rank].store(c->key + 1);
  int zero = 0;
  if (!k->joined[c->rank].compare_exchange_strong(zero, 1)) {
    std::fprintf(stderr, "ncclemu: rank %d joined twice\n", c->rank);
    return ncclInvalidUsage;
  }
  sleep_s(c->faults.init_delay_s);
  const bool never = c->faults.init_hang_rank == c->rank;
  wait_until(c, [&] {
    if (never) return false;
    for (int r = 0; r < c->nranks; ++r)
      if (!k->joined[r].load()) return false;
    return true;
  });
  return ncclSuccess;
}

int rank_by_key(ncclComm* c) {
  int below = 0;
  for (int r = 0; r < c->nranks; ++r) {
    const int kr = c->ctl->key[r].load() - 1;
    if (kr < c->key || (kr == c->key && r < c->rank)) ++below;
  }
  return below;
}

void close_rank(ncclComm* c) {
  if (c->ctl) c->ctl->closed[c->rank].store(1);
}

void wait_peers_closed(ncclComm* c, double limit_s) {
  const double end = now_s() + limit_s;
  while (now_s() < end) {
    bool all = true;
    for (int r = 0; r < c->nranks; ++r)
      if (r != c->rank && !c->ctl->closed[r].load()) all = false;
    if (all) return;
    sleep_s(1e-3);
  }
}

void run_collective(Collective* x) {
  ncclComm* c = x->comm;
  const Faults& f = c->faults;
  if (f.hang_rank == c->rank && f.hang_at == x->seq) {
    // A frozen peer: its collective never progresses, its abort flag is never looked at.
    while (true) sleep_s(0.05);
  }
  sleep_s(f.slow_s);
  const size_t es = dtype_size(x->dtype);
  const int n = c->nranks, me = c->rank;
  const size_t in_elems = x->kind == Kind::kReduceScatter ? x->count * n : x->count;
  const size_t out_elems = x->kind == Kind::kAllGather ? x->count * n : x->count;
  const std::string mine = data_path(c, x->seq, me);
  Control* k = c->ctl;
  if (!c->abort.load()) {
    if (!write_all(mine, x->send, in_elems * es)) {
      std::fprintf(stderr, "ncclemu: cannot write %s: %s\n", mine.c_str(), std::strerror(errno));
      c->state.store(ncclSystemError);
    }
    k->posted[me].store(x->seq);
  }
  const bool all_posted = wait_until(c, [&] {
    for (int r = 0; r < n; ++r)
      if (k->posted[r].load() < x->seq) return false;
    return true;
  });
  if (all_posted) {
    std::vector<std::vector<char>> in(n, std::vector<char>(in_elems * es));
    for (int r = 0; r < n; ++r) read_all(data_path(c, x->seq, r), in[r].data(), in[r].size());
    std::vector<char> out(out_elems * es);
    switch (x->kind) {
      case Kind::kAllReduce:
      case Kind::kReduceScatter: {
        const size_t off = x->kind == Kind::kReduceScatter ? static_cast<size_t>(me) * x->count : 0;
        for (size_t i = 0; i < x->count; ++i) {
          float acc = 0;  // accumulated in fp32, rounded once to the element type
          for (int r = 0; r < n; ++r) acc += premultiplied(load(in[r].data(), off + i, x->dtype), x->scalar, x->dtype);
          store(out.data(), i, x->dtype, acc);
        }
        break;
      }
      case Kind::kAllGather:
        for (int r = 0; r < n; ++r) std::memcpy(out.data() + r * x->count * es, in[r].data(), x->count * es);
        break;
      case Kind::kBroadcast:
        std::memcpy(out.data(), in[x->root].data(), x->count * es);
        break;
    }
    std::memcpy(x->recv, out.data(), out.size());  // "device" memory is host memory here
    k->read[me].store(x->seq);
    wait_until(c, [&] {
      for (int r = 0; r < n; ++r)
        if (k->read[r].load() < x->seq) return false;
      return true;
    });
  }
  unlink(mine.c_str());
  c->completed.fetch_add(1);
  delete x;
}

}  // namespace ncclemu
