#include "nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>
#include <sstream>

#include "../common/check.h"

namespace ncclavg {
namespace nccl {

// Note [Finding NCCL]
// Order, first hit wins: (1) the file named by NCCLAVG_NCCL_LIBRARY; (2) a libnccl already loaded in
// this process (torch's, so both share one NCCL); (3) the nvidia-nccl-cu13 / nvidia-nccl-cu12 wheels;
// (4) the system loader path. Every failed attempt is recorded so the final error tells the user what
// was tried, and what to install.

namespace {

std::once_flag g_once;
LoadInfo g_info;
Api g_api{};

std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0]) return lm->l_name;
  return fallback;
}

template <typename F>
bool resolve(void* h, const char* name, F& fn, bool required, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(h, name));
  if (!fn && required) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

// Fills g_api from `h`; returns an empty string on success, else the missing required symbols.
std::string bind_api(void* h) {
  std::string missing;
  Api a{};
  resolve(h, "ncclGetVersion", a.GetVersion, true, missing);
  resolve(h, "ncclGetErrorString", a.GetErrorString, true, missing);
  resolve(h, "ncclGetLastError", a.GetLastError, false, missing);
  resolve(h, "ncclGetUniqueId", a.GetUniqueId, true, missing);
  resolve(h, "ncclCommInitAll", a.CommInitAll, true, missing);
  resolve(h, "ncclCommInitRank", a.CommInitRank, true, missing);
  resolve(h, "ncclCommInitRankConfig", a.CommInitRankConfig, false, missing);
  resolve(h, "ncclCommSplit", a.CommSplit, false, missing);
  resolve(h, "ncclCommDestroy", a.CommDestroy, true, missing);
  resolve(h, "ncclCommAbort", a.CommAbort, true, missing);
  resolve(h, "ncclCommGetAsyncError", a.CommGetAsyncError, true, missing);
  resolve(h, "ncclCommCount", a.CommCount, true, missing);
  resolve(h, "ncclCommCuDevice", a.CommCuDevice, true, missing);
  resolve(h, "ncclCommUserRank", a.CommUserRank, true, missing);
  resolve(h, "ncclAllReduce", a.AllReduce, true, missing);
  resolve(h, "ncclReduceScatter", a.ReduceScatter, true, missing);
  resolve(h, "ncclAllGather", a.AllGather, true, missing);
  resolve(h, "ncclBroadcast", a.Broadcast, true, missing);
  resolve(h, "ncclGroupStart", a.GroupStart, true, missing);
  resolve(h, "ncclGroupEnd", a.GroupEnd, true, missing);
  resolve(h, "ncclRedOpCreatePreMulSum", a.RedOpCreatePreMulSum, false, missing);
  resolve(h, "ncclRedOpDestroy", a.RedOpDestroy, false, missing);
  if (missing.empty()) g_api = a;
  return missing;
}

bool try_handle(void* h, const std::string& name, const char* source, std::ostringstream& tried) {
  if (!h) {
    const char* e = dlerror();
    tried << "\n  " << source << ": " << name << ": " << (e ? e : "not found");
    return false;
  }
  std::string missing = bind_api(h);
  if (!missing.empty()) {
    tried << "\n  " << source << ": " << name << ": missing symbols " << missing;
    return false;
  }
  int v = 0;
  if (g_api.GetVersion(&v) != ncclSuccess) {
    tried << "\n  " << source << ": " << name << ": ncclGetVersion failed";
    return false;
  }
  g_info.loaded = true;
  g_info.path = loaded_path(h, name);
  g_info.source = source;
  g_info.version = v;
  return true;
}

void do_load(const std::vector<std::string>& wheel_candidates) {
  std::ostringstream tried;
  dlerror();
  if (const char* env = std::getenv("NCCLAVG_NCCL_LIBRARY"); env && env[0]) {
    // An explicit choice that fails is an error, not a reason to silently use another NCCL.
    if (!try_handle(dlopen(env, RTLD_NOW | RTLD_LOCAL), env, "NCCLAVG_NCCL_LIBRARY", tried)) {
      g_info.error = "NCCLAVG_NCCL_LIBRARY is set but could not be used:" + tried.str();
    }
    return;
  }
  for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
    void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (h && try_handle(h, name, "already loaded", tried)) return;
  }
  for (const auto& p : wheel_candidates) {
    if (try_handle(dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL), p, "wheel", tried)) return;
  }
  for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
    if (try_handle(dlopen(name, RTLD_NOW | RTLD_LOCAL), name, "system loader path", tried)) return;
  }
  g_info.error =
      "NCCL was not found. Install it with `pip install nvidia-nccl-cu13` (CUDA 13) or "
      "`pip install nvidia-nccl-cu12` (CUDA 12), i.e. `pip install ncclavg[cu13]`, or point "
      "NCCLAVG_NCCL_LIBRARY at a libnccl.so.2.\nTried:" + tried.str();
}

}  // namespace

const LoadInfo& load(const std::vector<std::string>& wheel_candidates) {
  std::call_once(g_once, [&] { do_load(wheel_candidates); });
  return g_info;
}

const LoadInfo& load_info() { return g_info; }

const Api& api() {
  if (!g_info.loaded) {
    if (g_info.error.empty()) {
      // The Python layer loads NCCL with the wheel locations it found (ncclavg._ext.require_nccl());
      // loading here would cache a result that never looked at the wheels.
      throw NcclError(
          "NCCL has not been loaded yet: call ncclavg._ext.require_nccl() first (ncclavg's Python API "
          "does this before creating a communicator)");
    }
    throw NcclError(g_info.error);
  }
  return g_api;
}

bool at_least(int code) { return g_info.loaded && g_info.version >= code; }

std::string version_string(int code) {
  std::ostringstream os;
  if (code < 10000) {  // NCCL <= 2.8 encoded versions as major*1000 + minor*100 + patch
    os << code / 1000 << "." << (code % 1000) / 100 << "." << code % 100;
  } else {
    os << code / 10000 << "." << (code % 10000) / 100 << "." << code % 100;
  }
  return os.str();
}

// Note [Several ranks on one GPU]
// NCCL refuses two ranks of one communicator on the same GPU unless it is >= 2.30 AND the process
// environment has NCCL_MULTI_RANK_GPU_ENABLE set to a non-zero integer (NCCL parses it with strtoll;
// "1" is the documented value). Both conditions are checked here, before NCCL is asked, so the error
// names the NCCL found, the one needed and the variable instead of NCCL's bare ncclInvalidUsage.
// The value is parsed strictly (the whole string must be an integer): "1abc" would enable it in NCCL,
// but it is refused here, which is the safe direction. NCCL reads the variable once per process and
// caches it, so a value set in os.environ after the first NCCL communicator of the process is seen
// here but not by NCCL; NCCL then fails the init with its own words, which the error carries.
std::string multi_rank_gpu_refusal(int version, const char* env_value) {
  std::ostringstream why;
  if (version < since::kMultiRankPerGpu) {
    why << "several NCCL ranks on one GPU need NCCL >= " << version_string(since::kMultiRankPerGpu)
        << " with " << kMultiRankGpuEnv << "=1, but "
        << (version > 0 ? "the loaded NCCL is " + version_string(version) : std::string("no NCCL is loaded"));
    return why.str();
  }
  char* end = nullptr;
  const long long value = env_value && env_value[0] ? std::strtoll(env_value, &end, 0) : 0;
  const bool parsed = env_value && env_value[0] && end && *end == '\0';
  if (!parsed || value == 0) {
    why << "several NCCL ranks on one GPU need " << kMultiRankGpuEnv << "=1 in the environment before the "
        << "first NCCL communicator of the process (NCCL " << version_string(version) << " >= "
        << version_string(since::kMultiRankPerGpu) << " is loaded; " << kMultiRankGpuEnv << " is "
        << (env_value ? "'" + std::string(env_value) + "'" : std::string("unset")) << ")";
  }
  return why.str();
}

std::string multi_rank_gpu_refusal() {
  return multi_rank_gpu_refusal(load_info().loaded ? load_info().version : 0, std::getenv(kMultiRankGpuEnv));
}

void check(ncclResult_t r, const char* what, ncclComm_t comm, const char* file, int line) {
  if (r == ncclSuccess) return;
  const Api& a = api();
  std::ostringstream os;
  os << what << " failed: " << a.GetErrorString(r) << " (ncclResult_t " << static_cast<int>(r) << ")";
  if (a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && last[0]) os << ": " << last;
  }
  os << " [" << file << ":" << line << "]";
  throw NcclError(os.str());
}

}  // namespace nccl
}  // namespace ncclavg
