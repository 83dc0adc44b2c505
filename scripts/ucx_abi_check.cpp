// The ABI check of csrc/transport/ucx_api.h (the UCP declarations ncclavg writes by hand, so that no ucp.h
// is needed to build) against one real ucp.h. Built and run by scripts/check_ucx_abi.py, once per header;
// not part of the package.
//
// Both headers declare the same C names, so ours is included inside a namespace of its own (`ours`) and
// UCX's at global scope. Every check below compares one thing ncclavg relies on:
//   - each enumerator ncclavg names has UCX's value, and each enum UCX's underlying type (size and sign);
//   - ucp_tag_t, ucp_datatype_t and ucs_status_ptr_t are UCX's types;
//   - each struct: every field ncclavg declares at UCX's offset with UCX's type, and the struct no larger
//     than UCX's (the same size where UCX strides an array of it or embeds it before other fields);
//   - every entry point of Api has exactly the type of the UCX function bind_api() (ucx_api.cpp) resolves
//     it from, with UCX's types mapped to ours (To<> below), and no member of Api goes unchecked;
//   - the header's UCP API is one ncclavg accepts (major kApiMajor, minor at least kApiMinor);
//   - at run time: ptr_is_err() and ptr_status() against UCS_PTR_IS_ERR and UCS_PTR_STATUS.
// A mismatch is a compile error naming the declaration (static_assert), or exit status 1 at run time.
// It prints the header's UCP API version and how many checks held. Nothing here calls UCX: no libucp is
// linked.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include <sys/socket.h>

namespace ours {
#include "ucx_api.h"  // the standard headers it includes are already in: their guards make them no-ops
}  // namespace ours

#include <ucp/api/ucp.h>

namespace {

using OurApi = ours::ncclavg::ucx::Api;

// UCX's type -> the type ucx_api.h must use in its place.
template <class T> struct To { using type = T; };  // int, size_t, uint64_t, char, void, arrays of them, ...
template <class T> struct To<T*> { using type = typename To<T>::type*; };
template <class T> struct To<const T> { using type = const typename To<T>::type; };
template <class R, class... A> struct To<R (*)(A...)> {
  using type = typename To<R>::type (*)(typename To<A>::type...);
};
// the handles: pointers to structs that neither side defines
template <> struct To<::ucp_context> { using type = ours::ucp_context; };
template <> struct To<::ucp_config> { using type = ours::ucp_config; };
template <> struct To<::ucp_worker> { using type = ours::ucp_worker; };
template <> struct To<::ucp_ep> { using type = ours::ucp_ep; };
template <> struct To<::ucp_address> { using type = ours::ucp_address; };
template <> struct To<::ucp_conn_request> { using type = ours::ucp_conn_request; };
// the enums and structs that both declare
template <> struct To<::ucs_status_t> { using type = ours::ucs_status_t; };
template <> struct To<::ucs_thread_mode_t> { using type = ours::ucs_thread_mode_t; };
template <> struct To<::ucp_err_handling_mode_t> { using type = ours::ucp_err_handling_mode_t; };
template <> struct To<::ucp_tag_recv_info_t> { using type = ours::ucp_tag_recv_info_t; };
template <> struct To<::ucp_dt_iov_t> { using type = ours::ucp_dt_iov_t; };
template <> struct To<::ucp_params_t> { using type = ours::ucp_params_t; };
template <> struct To<::ucp_worker_params_t> { using type = ours::ucp_worker_params_t; };
template <> struct To<::ucp_err_handler_t> { using type = ours::ucp_err_handler_t; };
template <> struct To<::ucp_ep_params_t> { using type = ours::ucp_ep_params_t; };
template <> struct To<::ucp_request_param_t> { using type = ours::ucp_request_param_t; };
template <> struct To<::ucs_cpu_set_t> { using type = ours::ucs_cpu_set_t; };
template <class T> using To_t = typename To<T>::type;

constexpr int kFirst = __COUNTER__;  // every CHECK below takes one number: the count of static checks

#define CHECK(cond, what) \
  static_assert((cond) && __COUNTER__ >= 0 /* counted */, "ucx_api.h does not match this ucp.h: " what)

#define CHECK_ENUM(name) \
  CHECK(static_cast<long long>(ours::name) == static_cast<long long>(::name), #name " has another value")
// An enum's underlying type: its size and sign (ucs_status_t is packed: one signed byte).
#define CHECK_ENUM_TYPE(name)                                                                      \
  CHECK((std::is_same<std::underlying_type_t<ours::name>, std::underlying_type_t<::name>>::value), \
        #name " has another size or sign")
#define CHECK_TYPE(name) CHECK((std::is_same<ours::name, To_t<::name>>::value), #name " is another type")
#define CHECK_FIELD(type, field)                                                                            \
  CHECK(offsetof(ours::type, field) == offsetof(::type, field), #type "::" #field " is at another offset"); \
  CHECK((std::is_same<decltype(ours::type::field), To_t<decltype(::type::field)>>::value),                  \
        #type "::" #field " has another type")
// A struct UCX reads in arrays, or embeds before fields of its own: UCX's size exactly.
#define CHECK_SAME_SIZE(type)                                               \
  CHECK(sizeof(ours::type) == sizeof(::type), "sizeof(" #type ") differs"); \
  CHECK(alignof(ours::type) == alignof(::type), #type " has another alignment")
// A parameter struct: UCX reads only the fields its field_mask (op_attr_mask) names, so ours may end
// before UCX's last field (UCX appends fields in new releases) but must not run past UCX's end.
#define CHECK_PREFIX(type)                                                                         \
  CHECK(sizeof(ours::type) <= sizeof(::type), "sizeof(" #type ") is more than this UCX's struct"); \
  CHECK(alignof(ours::type) == alignof(::type), #type " has another alignment")
// One per member of Api, with the function bind_api() resolves it from; counted apart too, so that a
// member added without its check fails below.
#define CHECK_FN(member, function)                                                            \
  static_assert(std::is_same<decltype(OurApi::member), To_t<decltype(&::function)>>::value && \
                    __COUNTER__ >= 0,                                                         \
                "ucx_api.h does not match this ucp.h: Api::" #member " has another type than " #function)

}  // namespace

// ---- version -----------------------------------------------------------------------------------
// load() refuses a libucp whose major differs or whose minor is below kApiMinor: a header outside that
// range is not one ncclavg claims to match.
CHECK(UCP_API_MAJOR == ours::ncclavg::ucx::kApiMajor, "UCP_API_MAJOR is not kApiMajor");
CHECK(UCP_API_MINOR >= ours::ncclavg::ucx::kApiMinor, "UCP_API_MINOR is below kApiMinor");

// ---- enums and scalar types --------------------------------------------------------------------
CHECK_ENUM_TYPE(ucs_status_t);
CHECK_ENUM(UCS_OK);
CHECK_ENUM(UCS_INPROGRESS);
CHECK_ENUM(UCS_ERR_NO_MESSAGE);
CHECK_ENUM(UCS_ERR_UNREACHABLE);
CHECK_ENUM(UCS_ERR_MESSAGE_TRUNCATED);
CHECK_ENUM(UCS_ERR_BUSY);
CHECK_ENUM(UCS_ERR_CANCELED);
CHECK_ENUM(UCS_ERR_TIMED_OUT);
CHECK_ENUM(UCS_ERR_CONNECTION_RESET);
CHECK_ENUM(UCS_ERR_ENDPOINT_TIMEOUT);
CHECK_ENUM(UCS_ERR_LAST);
CHECK_TYPE(ucs_status_ptr_t);
CHECK_ENUM_TYPE(ucs_thread_mode_t);
CHECK_ENUM(UCS_THREAD_MODE_SINGLE);
CHECK_ENUM(UCS_THREAD_MODE_SERIALIZED);
CHECK_ENUM(UCS_THREAD_MODE_MULTI);
CHECK_TYPE(ucp_tag_t);
CHECK_TYPE(ucp_datatype_t);
CHECK_ENUM(UCP_PARAM_FIELD_FEATURES);
CHECK_ENUM(UCP_PARAM_FIELD_NAME);
CHECK_ENUM(UCP_FEATURE_TAG);
CHECK_ENUM(UCP_FEATURE_WAKEUP);
CHECK_ENUM(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
CHECK_ENUM_TYPE(ucp_err_handling_mode_t);
CHECK_ENUM(UCP_ERR_HANDLING_MODE_NONE);
CHECK_ENUM(UCP_ERR_HANDLING_MODE_PEER);
CHECK_ENUM(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
CHECK_ENUM(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
CHECK_ENUM(UCP_EP_PARAM_FIELD_ERR_HANDLER);
CHECK_ENUM(UCP_OP_ATTR_FIELD_CALLBACK);
CHECK_ENUM(UCP_OP_ATTR_FIELD_USER_DATA);
CHECK_ENUM(UCP_OP_ATTR_FIELD_DATATYPE);
CHECK_ENUM(UCP_OP_ATTR_FIELD_FLAGS);
CHECK_ENUM(UCP_DATATYPE_IOV);
CHECK_ENUM(UCP_EP_CLOSE_FLAG_FORCE);

// ---- structs -----------------------------------------------------------------------------------
CHECK_SAME_SIZE(ucp_tag_recv_info_t);  // UCX fills it for the receive callback
CHECK_FIELD(ucp_tag_recv_info_t, sender_tag);
CHECK_FIELD(ucp_tag_recv_info_t, length);
CHECK_SAME_SIZE(ucp_dt_iov_t);  // an array of them is a message of datatype UCP_DATATYPE_IOV
CHECK_FIELD(ucp_dt_iov_t, buffer);
CHECK_FIELD(ucp_dt_iov_t, length);
CHECK_PREFIX(ucp_params_t);
CHECK_FIELD(ucp_params_t, field_mask);
CHECK_FIELD(ucp_params_t, features);
CHECK_FIELD(ucp_params_t, request_size);
CHECK_FIELD(ucp_params_t, request_init);
CHECK_FIELD(ucp_params_t, request_cleanup);
CHECK_FIELD(ucp_params_t, tag_sender_mask);
CHECK_FIELD(ucp_params_t, mt_workers_shared);
CHECK_FIELD(ucp_params_t, estimated_num_eps);
CHECK_FIELD(ucp_params_t, estimated_num_ppn);
CHECK_FIELD(ucp_params_t, name);
CHECK_SAME_SIZE(ucs_cpu_set_t);  // inside ucp_worker_params_t, before fields of UCX's
CHECK_FIELD(ucs_cpu_set_t, ucs_bits);
CHECK_PREFIX(ucp_worker_params_t);
CHECK_FIELD(ucp_worker_params_t, field_mask);
CHECK_FIELD(ucp_worker_params_t, thread_mode);
CHECK_FIELD(ucp_worker_params_t, cpu_mask);
CHECK_FIELD(ucp_worker_params_t, events);
CHECK_FIELD(ucp_worker_params_t, user_data);
CHECK_FIELD(ucp_worker_params_t, event_fd);
CHECK_SAME_SIZE(ucp_err_handler_t);  // inside ucp_ep_params_t, before fields of UCX's
CHECK_FIELD(ucp_err_handler_t, cb);
CHECK_FIELD(ucp_err_handler_t, arg);
CHECK_PREFIX(ucp_ep_params_t);
CHECK_FIELD(ucp_ep_params_t, field_mask);
CHECK_FIELD(ucp_ep_params_t, address);
CHECK_FIELD(ucp_ep_params_t, err_mode);
CHECK_FIELD(ucp_ep_params_t, err_handler);
CHECK_PREFIX(ucp_request_param_t);
CHECK_FIELD(ucp_request_param_t, op_attr_mask);
CHECK_FIELD(ucp_request_param_t, flags);
CHECK_FIELD(ucp_request_param_t, request);
// cb is an unnamed union on both sides (UCX's has more members, all callbacks): its place and size, and
// the type of each member ncclavg sets
CHECK(offsetof(ours::ucp_request_param_t, cb) == offsetof(::ucp_request_param_t, cb),
      "ucp_request_param_t::cb is at another offset");
CHECK(sizeof(ours::ucp_request_param_t::cb) == sizeof(::ucp_request_param_t::cb),
      "ucp_request_param_t::cb has another size");
#define CHECK_CALLBACK(member)                                                   \
  CHECK((std::is_same<decltype(ours::ucp_request_param_t::cb.member),            \
                      To_t<decltype(::ucp_request_param_t::cb.member)>>::value), \
        "ucp_request_param_t::cb." #member " has another type")
CHECK_CALLBACK(send);
CHECK_CALLBACK(recv);
CHECK_FIELD(ucp_request_param_t, datatype);
CHECK_FIELD(ucp_request_param_t, user_data);

// ---- entry points (the names bind_api() resolves) ----------------------------------------------
namespace {
constexpr int kFunctionsBefore = __COUNTER__;
}
CHECK_FN(config_read, ucp_config_read);
CHECK_FN(config_release, ucp_config_release);
CHECK_FN(config_modify, ucp_config_modify);
CHECK_FN(get_version, ucp_get_version);
CHECK_FN(get_version_string, ucp_get_version_string);
CHECK_FN(init_version, ucp_init_version);
CHECK_FN(cleanup, ucp_cleanup);
CHECK_FN(worker_create, ucp_worker_create);
CHECK_FN(worker_destroy, ucp_worker_destroy);
CHECK_FN(worker_get_address, ucp_worker_get_address);
CHECK_FN(worker_release_address, ucp_worker_release_address);
CHECK_FN(worker_progress, ucp_worker_progress);
CHECK_FN(worker_get_efd, ucp_worker_get_efd);
CHECK_FN(worker_arm, ucp_worker_arm);
CHECK_FN(worker_signal, ucp_worker_signal);
CHECK_FN(ep_create, ucp_ep_create);
CHECK_FN(ep_close_nbx, ucp_ep_close_nbx);
CHECK_FN(tag_send_nbx, ucp_tag_send_nbx);
CHECK_FN(tag_recv_nbx, ucp_tag_recv_nbx);
CHECK_FN(request_check_status, ucp_request_check_status);
CHECK_FN(request_cancel, ucp_request_cancel);
CHECK_FN(request_free, ucp_request_free);
CHECK_FN(status_string, ucs_status_string);
namespace {
constexpr int kFunctions = __COUNTER__ - kFunctionsBefore - 1;
constexpr int kStatic = __COUNTER__ - kFirst - 3;  // less kFunctionsBefore's, kFunctions' and this line's
}  // namespace
static_assert(sizeof(OurApi) == kFunctions * sizeof(void (*)()),
              "ucx_api.h: Api has a member that ucx_abi_check.cpp does not check (add a CHECK_FN)");

int main() {
  int failed = 0, runtime = 0;
  auto expect = [&](bool ok, const char* what, long long status) {
    ++runtime;
    if (!ok) {
      std::fprintf(stderr, "ucx_api.h does not match this ucp.h: %s (status %lld)\n", what, status);
      ++failed;
    }
  };
  // ptr_is_err() and ptr_status() stand for UCS_PTR_IS_ERR and UCS_PTR_STATUS: the same answer for what
  // a UCP call returns (NULL, each status ncclavg names as a pointer, a request). host_lanes.cpp asks
  // ptr_status() only of an error, so it is compared there alone (for a request UCX's says INPROGRESS).
  const ::ucs_status_t statuses[] = {UCS_OK, UCS_INPROGRESS, UCS_ERR_NO_MESSAGE, UCS_ERR_UNREACHABLE,
                                     UCS_ERR_MESSAGE_TRUNCATED, UCS_ERR_BUSY, UCS_ERR_CANCELED,
                                     UCS_ERR_TIMED_OUT, UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT,
                                     UCS_ERR_LAST};
  for (::ucs_status_t s : statuses) {
    void* p = UCS_STATUS_PTR(s);
    const bool is_err = UCS_PTR_IS_ERR(p);
    expect(ours::ncclavg::ucx::ptr_is_err(p) == is_err, "ptr_is_err() is not UCS_PTR_IS_ERR", s);
    if (is_err) {
      expect(static_cast<long long>(ours::ncclavg::ucx::ptr_status(p)) == static_cast<long long>(UCS_PTR_STATUS(p)),
             "ptr_status() is not UCS_PTR_STATUS", s);
    }
  }
  int request = 0;
  expect(ours::ncclavg::ucx::ptr_is_err(&request) == UCS_PTR_IS_ERR(&request),
         "ptr_is_err() is not UCS_PTR_IS_ERR for a request", 0);
  std::printf("ucp.h %d.%d: %d static checks (%d entry points), %d run-time checks, %d failed\n", UCP_API_MAJOR,
              UCP_API_MINOR, kStatic, kFunctions, runtime, failed);
  return failed ? 1 : 0;
}
