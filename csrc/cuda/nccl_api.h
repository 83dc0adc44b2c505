// The part of NCCL's C ABI that ncclavg uses, declared here so that no nccl.h is needed at build time.
// NCCL is loaded with dlopen on first use (see Note [Finding NCCL] in nccl_api.cpp). NCCL's C ABI is
// stable across 2.x; features that appeared later are resolved as optional and gated on the version.
//
// This file and nccl_api.cpp are plain C++ (no CUDA headers): they are compiled into every build, so
// even a CPU-only build can say which NCCL it would use.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

extern "C" {
typedef struct ncclComm* ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclTimeout = 8,  // NCCL >= 2.30
} ncclResult_t;
// Dynamically created reduction ops (PreMulSum) are further values of this enum.
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;
typedef enum {
  ncclInt8 = 0, ncclUint8 = 1, ncclInt32 = 2, ncclUint32 = 3, ncclInt64 = 4, ncclUint64 = 5,
  ncclFloat16 = 6, ncclFloat32 = 7, ncclFloat64 = 8, ncclBfloat16 = 9,
} ncclDataType_t;
typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

// ncclConfig_t as of NCCL 2.18 (splitShare arrived with ncclCommSplit). Its first fields are stable;
// NCCL copies `size` bytes and ignores the fields newer than `version`, so a newer NCCL accepts this
// older layout.
typedef struct {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
  int splitShare;
} ncclConfig_t;
}
// The size default_config() gives NCCL (44) stops before the struct's tail padding (to 48).
static_assert(offsetof(ncclConfig_t, splitShare) + sizeof(int) == 44 && sizeof(ncclConfig_t) == 48,
              "ncclConfig_t must have NCCL 2.18's x86-64 layout");

namespace ncclavg {
namespace nccl {

constexpr int version_code(int major, int minor, int patch) {
  // NCCL_VERSION() since 2.9: major*10000 + minor*100 + patch (2.8 and older: major*1000 + minor*100
  // + patch, which is always smaller, so comparisons against codes made here stay correct).
  return major * 10000 + minor * 100 + patch;
}

// The NCCL release that introduced each feature ncclavg gates on. Compare with load_info().version
// through at_least(); the optional entry points of Api are null exactly when the feature is missing.
namespace since {
constexpr int kAvg = version_code(2, 10, 0);             // ncclAvg
constexpr int kBfloat16 = version_code(2, 10, 0);        // ncclBfloat16
constexpr int kPreMulSum = version_code(2, 11, 0);       // ncclRedOpCreatePreMulSum / ncclRedOpDestroy
constexpr int kLastError = version_code(2, 13, 0);       // ncclGetLastError
constexpr int kNonBlocking = version_code(2, 14, 0);     // ncclCommInitRankConfig, config.blocking = 0
constexpr int kCommSplit = version_code(2, 18, 0);       // ncclCommSplit (a blocking child of a non-blocking comm)
constexpr int kRuntimeConnect = version_code(2, 22, 0);  // lazy connections (NCCL_RUNTIME_CONNECT, default 1)
constexpr int kMultiRankPerGpu = version_code(2, 30, 0); // several ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE)
}  // namespace since

// The variable NCCL >= 2.30 reads before it lets several ranks share one GPU (src/init.cc,
// NCCL_PARAM(MultiRankGpuEnable, "MULTI_RANK_GPU_ENABLE", 0)); documented as experimental.
constexpr const char* kMultiRankGpuEnv = "NCCL_MULTI_RANK_GPU_ENABLE";

// Why several ranks may NOT share one GPU with this NCCL and this value of NCCL_MULTI_RANK_GPU_ENABLE
// (null: unset), or "" when they may. Pure, so both the C++ check and the Python one (through the
// binding) give the same answer and tests can ask it without a GPU. `version` is a version_code.
std::string multi_rank_gpu_refusal(int version, const char* env_value);
// The same for the loaded NCCL and this process's environment.
std::string multi_rank_gpu_refusal();

// The loaded library's entry points. Optional ones are null when the loaded NCCL predates them.
struct Api {
  ncclResult_t (*GetVersion)(int*);
  const char* (*GetErrorString)(ncclResult_t);
  const char* (*GetLastError)(ncclComm_t);  // >= 2.13
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitAll)(ncclComm_t*, int, const int*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);  // >= 2.14
  ncclResult_t (*CommSplit)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);              // >= 2.18
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommCount)(const ncclComm_t, int*);
  ncclResult_t (*CommCuDevice)(const ncclComm_t, int*);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, void*);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, void*);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, void*);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  ncclResult_t (*RedOpCreatePreMulSum)(ncclRedOp_t*, void*, ncclDataType_t, ncclScalarResidence_t, ncclComm_t);  // >= 2.11
  ncclResult_t (*RedOpDestroy)(ncclRedOp_t, ncclComm_t);  // >= 2.11
};

struct LoadInfo {
  bool loaded = false;
  std::string path;     // the file that was loaded
  std::string source;   // "NCCLAVG_NCCL_LIBRARY", "already loaded", "wheel", "system loader path"
  int version = 0;      // NCCL_VERSION code
  std::string error;    // why nothing was loaded (every place tried), when !loaded
};

// NCCL_CONFIG_INITIALIZER for the layout above: every attribute "undefined" (NCCL picks its default),
// magic and version set so that NCCL accepts the struct. Zeroed first, so that no byte NCCL copies is
// left indeterminate. See Note [Non-blocking init and
// abort] in comm.cpp for why ncclavg sets blocking = 0 for the init.
inline ncclConfig_t default_config() {
  ncclConfig_t c;
  std::memset(&c, 0, sizeof(c));  // padding too: aggregate `{}` initialisation leaves it indeterminate
  const int undef = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT (INT_MIN)
  // Only the fields of this layout: sizeof() would add the 4 bytes of tail padding after splitShare,
  // which later releases read as trafficClass: 0 instead of "undefined" where NCCL does not reset it
  // by `version` (2.26.x does not).
  c.size = offsetof(ncclConfig_t, splitShare) + sizeof(c.splitShare);
  c.magic = 0xcafebeef;             // NCCL_API_MAGIC
  c.version = version_code(2, 18, 0);  // the release whose layout this struct mirrors
  c.blocking = undef;
  c.cgaClusterSize = undef;
  c.minCTAs = undef;
  c.maxCTAs = undef;
  c.netName = nullptr;  // NCCL_CONFIG_UNDEF_PTR
  c.splitShare = undef;
  return c;
}

// Loads NCCL once (thread-safe) and returns what happened. `wheel_candidates` are library paths inside
// the nvidia-nccl-cu13 / -cu12 wheels, found by the Python side; the first call's list is the one used.
const LoadInfo& load(const std::vector<std::string>& wheel_candidates);
const LoadInfo& load_info();  // what the first load() found; !loaded if load() was never called

// The API table; throws NcclError with the install hint when NCCL could not be loaded.
const Api& api();

// True when NCCL is loaded and its version is >= `code` (a version_code / since:: constant).
bool at_least(int code);

std::string version_string(int code);

}  // namespace nccl
}  // namespace ncclavg

// Throws ncclavg::NcclError with NCCL's own words: ncclGetErrorString, and ncclGetLastError when the
// loaded NCCL has it. `comm` may be null.
#define NCCLAVG_NCCL_CHECK(expr, comm) ::ncclavg::nccl::check((expr), #expr, (comm), __FILE__, __LINE__)

namespace ncclavg {
namespace nccl {
void check(ncclResult_t r, const char* what, ncclComm_t comm, const char* file, int line);
}  // namespace nccl
}  // namespace ncclavg
