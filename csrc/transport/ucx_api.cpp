// Loading libucp at run time: see Note [Finding UCX].
#include "ucx_api.h"

#include <dlfcn.h>
#include <link.h>

#include <mutex>
#include <stdexcept>

namespace ncclavg {
namespace ucx {

// Note [Finding UCX]
// The core never links UCX: the lanes between hosts are one transport of several, and gloo serves when
// UCX is absent. Python (ncclavg/transport/ucx.py) gives the candidates in order, first hit wins: the
// file NCCLAVG_UCX_LIBRARY names (a system UCX with RDMA transports), the libucx wheel's libucp (its
// libucs, libuct and libucm beside it, found through libucp's own run path), then libucp.so.0 on the
// system loader path. Every failed attempt is recorded, so the error says what was tried. libucs is
// reached through libucp's handle (dlsym follows a library's dependencies), so one handle serves both.

namespace {

std::once_flag g_once;
LoadInfo g_info;
Api g_api{};

template <typename F>
void resolve(void* h, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(h, name));
  if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
}

std::string bind_api(void* h, Api& a) {
  std::string missing;
  resolve(h, "ucp_config_read", a.config_read, missing);
  resolve(h, "ucp_config_release", a.config_release, missing);
  resolve(h, "ucp_config_modify", a.config_modify, missing);
  resolve(h, "ucp_get_version", a.get_version, missing);
  resolve(h, "ucp_get_version_string", a.get_version_string, missing);
  resolve(h, "ucp_init_version", a.init_version, missing);
  resolve(h, "ucp_cleanup", a.cleanup, missing);
  resolve(h, "ucp_worker_create", a.worker_create, missing);
  resolve(h, "ucp_worker_destroy", a.worker_destroy, missing);
  resolve(h, "ucp_worker_get_address", a.worker_get_address, missing);
  resolve(h, "ucp_worker_release_address", a.worker_release_address, missing);
  resolve(h, "ucp_worker_progress", a.worker_progress, missing);
  resolve(h, "ucp_worker_get_efd", a.worker_get_efd, missing);
  resolve(h, "ucp_worker_arm", a.worker_arm, missing);
  resolve(h, "ucp_worker_signal", a.worker_signal, missing);
  resolve(h, "ucp_ep_create", a.ep_create, missing);
  resolve(h, "ucp_ep_close_nbx", a.ep_close_nbx, missing);
  resolve(h, "ucp_tag_send_nbx", a.tag_send_nbx, missing);
  resolve(h, "ucp_tag_recv_nbx", a.tag_recv_nbx, missing);
  resolve(h, "ucp_request_check_status", a.request_check_status, missing);
  resolve(h, "ucp_request_cancel", a.request_cancel, missing);
  resolve(h, "ucp_request_free", a.request_free, missing);
  resolve(h, "ucs_status_string", a.status_string, missing);
  return missing;
}

std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 && lm != nullptr && lm->l_name != nullptr && lm->l_name[0] != 0)
    return lm->l_name;
  return fallback;
}

void try_load(const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& c : candidates) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e != nullptr ? e : "not loadable");
      continue;
    }
    Api a{};
    const std::string missing = bind_api(h, a);
    if (!missing.empty()) {
      tried += "\n  " + c + ": lacks " + missing;
      dlclose(h);
      continue;
    }
    unsigned major = 0, minor = 0, release = 0;
    a.get_version(&major, &minor, &release);
    if (major != kApiMajor || minor < kApiMinor) {
      tried += "\n  " + c + ": UCX " + std::to_string(major) + "." + std::to_string(minor) + " is older than " +
               std::to_string(kApiMajor) + "." + std::to_string(kApiMinor);
      dlclose(h);
      continue;
    }
    g_api = a;
    g_info.loaded = true;
    g_info.path = loaded_path(h, c);
    g_info.version = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
    return;   // kept open for the life of the process
  }
  g_info.error = "UCX (libucp) was not found. Install it with `pip install libucx-cu13` (or libucx-cu12), i.e. "
                 "`pip install ncclavg[hosts]`, or point NCCLAVG_UCX_LIBRARY at a libucp.so.0." +
                 (tried.empty() ? std::string() : "\nTried:" + tried);
}

}  // namespace

const LoadInfo& load(const std::vector<std::string>& candidates) {
  std::call_once(g_once, [&] { try_load(candidates); });
  return g_info;
}

const LoadInfo& load_info() { return g_info; }

const Api& api() {
  if (!g_info.loaded)
    throw std::runtime_error(g_info.error.empty() ? "UCX was not loaded (ncclavg.transport.ucx.load() first)"
                                                  : g_info.error);
  return g_api;
}

std::string status_text(ucs_status_t s) {
  const char* t = g_info.loaded && g_api.status_string != nullptr ? g_api.status_string(s) : nullptr;
  return std::string(t != nullptr ? t : "UCX status") + " (" + std::to_string(static_cast<int>(s)) + ")";
}

}  // namespace ucx
}  // namespace ncclavg
