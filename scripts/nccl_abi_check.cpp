// The ABI check of csrc/cuda/nccl_api.h (the NCCL declarations ncclavg writes by hand, so that no nccl.h
// is needed to build) against one real nccl.h. Built and run by scripts/check_nccl_abi.py, once per
// header; not part of the package.
//
// Both headers declare the same C names, so ours is included inside a namespace of its own (`ours`) and
// NCCL's at global scope. Every check below compares one thing ncclavg relies on:
//   - each enumerator ncclavg names has NCCL's value, and each enum NCCL's size;
//   - ncclUniqueId's size; ncclConfig_t: each field ncclavg sets at NCCL's offset with NCCL's type;
//   - every entry point of Api has exactly the type of NCCL's function, with NCCL's types mapped to ours
//     (To<> below: ncclComm* -> ours::ncclComm*, cudaStream_t -> void*, the enums and structs), and no
//     member of Api goes unchecked;
//   - at run time: default_config() against NCCL_CONFIG_INITIALIZER (magic, every "undefined" value).
// A mismatch is a compile error naming the declaration (static_assert), or exit status 1 at run time.
// It prints the header's version and how many checks held.
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace ours {
#include "nccl_api.h"  // the standard headers it includes are already in: their guards make them no-ops
}  // namespace ours

#include <nccl.h>

namespace {

using OurApi = ours::ncclavg::nccl::Api;

// NCCL's type -> the type nccl_api.h must use in its place.
template <class T> struct To { using type = T; };  // int, size_t, char, void, ...
template <class T> struct To<T*> { using type = typename To<T>::type*; };
template <class T> struct To<const T> { using type = const typename To<T>::type; };
template <class R, class... A> struct To<R (*)(A...)> {
  using type = typename To<R>::type (*)(typename To<A>::type...);
};
template <> struct To<cudaStream_t> { using type = void*; };  // ncclavg passes streams as void*
template <> struct To<::ncclComm> { using type = ours::ncclComm; };
template <> struct To<::ncclUniqueId> { using type = ours::ncclUniqueId; };
template <> struct To<::ncclConfig_t> { using type = ours::ncclConfig_t; };
template <> struct To<::ncclResult_t> { using type = ours::ncclResult_t; };
template <> struct To<::ncclRedOp_t> { using type = ours::ncclRedOp_t; };
template <> struct To<::ncclDataType_t> { using type = ours::ncclDataType_t; };
template <> struct To<::ncclScalarResidence_t> { using type = ours::ncclScalarResidence_t; };
template <class T> using To_t = typename To<T>::type;

constexpr int kFirst = __COUNTER__;  // every CHECK below takes one number: the count of static checks

#define CHECK(cond, what) \
  static_assert((cond) && __COUNTER__ >= 0 /* counted */, "nccl_api.h does not match this nccl.h: " what)

#define CHECK_ENUM(name) \
  CHECK(static_cast<long long>(ours::name) == static_cast<long long>(::name), #name " has another value")
#define CHECK_SIZE(type) CHECK(sizeof(ours::type) == sizeof(::type), "sizeof(" #type ") differs")
#define CHECK_FIELD(field)                                                                                \
  CHECK(offsetof(ours::ncclConfig_t, field) == offsetof(::ncclConfig_t, field),                           \
        "ncclConfig_t::" #field " is at another offset");                                                 \
  CHECK((std::is_same<decltype(ours::ncclConfig_t::field), To_t<decltype(::ncclConfig_t::field)>>::value), \
        "ncclConfig_t::" #field " has another type")
// One per member of Api; counted apart too, so that a member added without its check fails below.
#define CHECK_FN(member)                                                                                    \
  static_assert(std::is_same<decltype(OurApi::member), To_t<decltype(&::nccl##member)>>::value &&          \
                    __COUNTER__ >= 0,                                                                       \
                "nccl_api.h does not match this nccl.h: Api::" #member " has another type than nccl" #member)

}  // namespace

// ---- enums -------------------------------------------------------------------------------------
CHECK_SIZE(ncclResult_t);
CHECK_ENUM(ncclSuccess);
CHECK_ENUM(ncclUnhandledCudaError);
CHECK_ENUM(ncclSystemError);
CHECK_ENUM(ncclInternalError);
CHECK_ENUM(ncclInvalidArgument);
CHECK_ENUM(ncclInvalidUsage);
CHECK_ENUM(ncclRemoteError);
CHECK_ENUM(ncclInProgress);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
CHECK_ENUM(ncclTimeout);
#else
// not in this NCCL: the value ncclavg gives it must not be another result of this release
CHECK(static_cast<int>(ours::ncclTimeout) == static_cast<int>(::ncclNumResults), "ncclTimeout collides");
#endif
CHECK_SIZE(ncclRedOp_t);
CHECK_ENUM(ncclSum);
CHECK_ENUM(ncclProd);
CHECK_ENUM(ncclMax);
CHECK_ENUM(ncclMin);
CHECK_ENUM(ncclAvg);
CHECK_SIZE(ncclDataType_t);
CHECK_ENUM(ncclInt8);
CHECK_ENUM(ncclUint8);
CHECK_ENUM(ncclInt32);
CHECK_ENUM(ncclUint32);
CHECK_ENUM(ncclInt64);
CHECK_ENUM(ncclUint64);
CHECK_ENUM(ncclFloat16);
CHECK_ENUM(ncclFloat32);
CHECK_ENUM(ncclFloat64);
CHECK_ENUM(ncclBfloat16);
CHECK_SIZE(ncclScalarResidence_t);
CHECK_ENUM(ncclScalarDevice);
CHECK_ENUM(ncclScalarHostImmediate);

// ---- structs -----------------------------------------------------------------------------------
CHECK_SIZE(ncclUniqueId);
CHECK(sizeof(ours::ncclUniqueId::internal) == NCCL_UNIQUE_ID_BYTES, "ncclUniqueId::internal has another size");
CHECK(alignof(ours::ncclUniqueId) == alignof(::ncclUniqueId), "ncclUniqueId has another alignment");
CHECK(alignof(ours::ncclConfig_t) == alignof(::ncclConfig_t), "ncclConfig_t has another alignment");
CHECK(offsetof(ours::ncclConfig_t, splitShare) + sizeof(int) <= sizeof(::ncclConfig_t),
      "ncclConfig_t: the size ncclavg passes is more than this NCCL's struct");
CHECK_FIELD(size);
CHECK_FIELD(magic);
CHECK_FIELD(version);
CHECK_FIELD(blocking);
CHECK_FIELD(cgaClusterSize);
CHECK_FIELD(minCTAs);
CHECK_FIELD(maxCTAs);
CHECK_FIELD(netName);
CHECK_FIELD(splitShare);
CHECK(ours::ncclavg::nccl::version_code(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH) == NCCL_VERSION_CODE,
      "version_code() is not NCCL_VERSION()");

// ---- entry points ------------------------------------------------------------------------------
namespace {
constexpr int kFunctionsBefore = __COUNTER__;
}
CHECK_FN(GetVersion);
CHECK_FN(GetErrorString);
CHECK_FN(GetLastError);
CHECK_FN(GetUniqueId);
CHECK_FN(CommInitAll);
CHECK_FN(CommInitRank);
CHECK_FN(CommInitRankConfig);
CHECK_FN(CommSplit);
CHECK_FN(CommDestroy);
CHECK_FN(CommAbort);
CHECK_FN(CommGetAsyncError);
CHECK_FN(CommCount);
CHECK_FN(CommCuDevice);
CHECK_FN(CommUserRank);
CHECK_FN(AllReduce);
CHECK_FN(ReduceScatter);
CHECK_FN(AllGather);
CHECK_FN(Broadcast);
CHECK_FN(GroupStart);
CHECK_FN(GroupEnd);
CHECK_FN(RedOpCreatePreMulSum);
CHECK_FN(RedOpDestroy);
namespace {
constexpr int kFunctions = __COUNTER__ - kFunctionsBefore - 1;
constexpr int kStatic = __COUNTER__ - kFirst - 3;  // less kFunctionsBefore's, kFunctions' and this line's
}  // namespace
static_assert(sizeof(OurApi) == kFunctions * sizeof(void (*)()),
              "nccl_api.h: Api has a member that nccl_abi_check.cpp does not check (add a CHECK_FN)");

int main() {
  int failed = 0, runtime = 0;
  auto expect = [&](bool ok, const char* what) {
    ++runtime;
    if (!ok) {
      std::fprintf(stderr, "nccl_api.h does not match this nccl.h: %s\n", what);
      ++failed;
    }
  };
  // default_config() must say what NCCL_CONFIG_INITIALIZER says for every field ncclavg sends.
  const ::ncclConfig_t ref = NCCL_CONFIG_INITIALIZER;
  const ours::ncclConfig_t mine = ours::ncclavg::nccl::default_config();
  expect(mine.magic == ref.magic, "default_config().magic is not NCCL_CONFIG_INITIALIZER's");
  expect(mine.blocking == ref.blocking, "default_config().blocking is not NCCL_CONFIG_UNDEF_INT");
  expect(mine.cgaClusterSize == ref.cgaClusterSize, "default_config().cgaClusterSize is not NCCL_CONFIG_UNDEF_INT");
  expect(mine.minCTAs == ref.minCTAs, "default_config().minCTAs is not NCCL_CONFIG_UNDEF_INT");
  expect(mine.maxCTAs == ref.maxCTAs, "default_config().maxCTAs is not NCCL_CONFIG_UNDEF_INT");
  expect(mine.netName == ref.netName, "default_config().netName is not NCCL_CONFIG_UNDEF_PTR");
  expect(mine.splitShare == ref.splitShare, "default_config().splitShare is not NCCL_CONFIG_UNDEF_INT");
  expect(mine.size == offsetof(ours::ncclConfig_t, splitShare) + sizeof(int) && mine.size <= ref.size,
         "default_config().size is not the end of splitShare, within this NCCL's struct");
  expect(mine.version >= static_cast<unsigned>(NCCL_VERSION(2, 18, 0)) && mine.version <= ref.version,
         "default_config().version is not a release between 2.18 (splitShare) and this header's");
  std::printf("nccl.h %d.%d.%d: %d static checks (%d entry points), %d run-time checks, %d failed\n", NCCL_MAJOR,
              NCCL_MINOR, NCCL_PATCH, kStatic, kFunctions, runtime, failed);
  return failed ? 1 : 0;
}
