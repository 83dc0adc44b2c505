// The part of UCX's UCP C API that the lanes between hosts use (host_lanes.cpp), declared here so that no
// ucp.h is needed at build time. libucp is loaded with dlopen on first use (Note [Finding UCX] in
// ucx_api.cpp), so the core imports and runs without UCX. scripts/check_ucx_abi.py checks every
// declaration below against a real ucp.h (the libucx wheel's), as scripts/check_nccl_abi.py does nccl.h.
//
// UCP's parameter structs are read only as far as their field_mask says: a struct that ends before the
// newest UCX's last field is accepted by that UCX (ucp_request_param_t grew in 1.16 and 1.18).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <sys/socket.h>

extern "C" {
typedef enum {
  UCS_OK = 0,
  UCS_INPROGRESS = 1,
  UCS_ERR_NO_MESSAGE = -1,
  UCS_ERR_UNREACHABLE = -6,
  UCS_ERR_MESSAGE_TRUNCATED = -9,
  UCS_ERR_BUSY = -15,
  UCS_ERR_CANCELED = -16,
  UCS_ERR_TIMED_OUT = -20,
  UCS_ERR_CONNECTION_RESET = -25,
  UCS_ERR_ENDPOINT_TIMEOUT = -80,
  UCS_ERR_LAST = -100
} __attribute__((packed)) ucs_status_t;  // UCS_S_PACKED, as UCX declares it: one signed byte
typedef void* ucs_status_ptr_t;
typedef enum { UCS_THREAD_MODE_SINGLE = 0, UCS_THREAD_MODE_SERIALIZED = 1, UCS_THREAD_MODE_MULTI = 2 } ucs_thread_mode_t;

typedef struct ucp_context* ucp_context_h;
typedef struct ucp_config ucp_config_t;
typedef struct ucp_worker* ucp_worker_h;
typedef struct ucp_ep* ucp_ep_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_conn_request* ucp_conn_request_h;
typedef uint64_t ucp_tag_t;
typedef uint64_t ucp_datatype_t;

typedef struct ucp_tag_recv_info {
  ucp_tag_t sender_tag;
  size_t length;
} ucp_tag_recv_info_t;
typedef struct ucp_dt_iov {
  void* buffer;
  size_t length;
} ucp_dt_iov_t;

enum { UCP_PARAM_FIELD_FEATURES = 1u << 0, UCP_PARAM_FIELD_NAME = 1u << 8 };
enum { UCP_FEATURE_TAG = 1u << 0, UCP_FEATURE_WAKEUP = 1u << 4 };
typedef void (*ucp_request_init_callback_t)(void* request);
typedef void (*ucp_request_cleanup_callback_t)(void* request);
typedef struct ucp_params {
  uint64_t field_mask;
  uint64_t features;
  size_t request_size;
  ucp_request_init_callback_t request_init;
  ucp_request_cleanup_callback_t request_cleanup;
  uint64_t tag_sender_mask;
  int mt_workers_shared;
  size_t estimated_num_eps;
  size_t estimated_num_ppn;
  const char* name;
} ucp_params_t;

enum { UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1u << 0 };
typedef struct {
  unsigned long ucs_bits[1024 / (8 * sizeof(unsigned long))];
} ucs_cpu_set_t;
typedef struct ucp_worker_params {
  uint64_t field_mask;
  ucs_thread_mode_t thread_mode;
  ucs_cpu_set_t cpu_mask;
  unsigned events;
  void* user_data;
  int event_fd;
} ucp_worker_params_t;

typedef enum { UCP_ERR_HANDLING_MODE_NONE = 0, UCP_ERR_HANDLING_MODE_PEER = 1 } ucp_err_handling_mode_t;
typedef void (*ucp_err_handler_cb_t)(void* arg, ucp_ep_h ep, ucs_status_t status);
typedef struct ucp_err_handler {
  ucp_err_handler_cb_t cb;
  void* arg;
} ucp_err_handler_t;
enum {
  UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1u << 0,
  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1u << 1,
  UCP_EP_PARAM_FIELD_ERR_HANDLER = 1u << 2,
};
typedef struct ucp_ep_params {
  uint64_t field_mask;
  const ucp_address_t* address;
  ucp_err_handling_mode_t err_mode;
  ucp_err_handler_t err_handler;
} ucp_ep_params_t;

typedef void (*ucp_send_nbx_callback_t)(void* request, ucs_status_t status, void* user_data);
typedef void (*ucp_tag_recv_nbx_callback_t)(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                                            void* user_data);
enum {
  UCP_OP_ATTR_FIELD_CALLBACK = 1u << 1,
  UCP_OP_ATTR_FIELD_USER_DATA = 1u << 2,
  UCP_OP_ATTR_FIELD_DATATYPE = 1u << 3,
  UCP_OP_ATTR_FIELD_FLAGS = 1u << 4,
};
enum { UCP_DATATYPE_IOV = 2 };
enum { UCP_EP_CLOSE_FLAG_FORCE = 1u << 0 };
typedef struct {
  uint32_t op_attr_mask;
  uint32_t flags;
  void* request;
  union {
    ucp_send_nbx_callback_t send;
    ucp_tag_recv_nbx_callback_t recv;
  } cb;
  ucp_datatype_t datatype;
  void* user_data;
} ucp_request_param_t;
}  // extern "C"

namespace ncclavg {
namespace ucx {

constexpr unsigned kApiMajor = 1, kApiMinor = 9;   // the oldest UCP whose API has everything below (ucp_*_nbx)

// The entry points, resolved from libucp (and libucs for ucs_status_string).
struct Api {
  ucs_status_t (*config_read)(const char* env_prefix, const char* filename, ucp_config_t** config_p);
  void (*config_release)(ucp_config_t* config);
  ucs_status_t (*config_modify)(ucp_config_t* config, const char* name, const char* value);
  void (*get_version)(unsigned* major, unsigned* minor, unsigned* release);
  const char* (*get_version_string)();
  ucs_status_t (*init_version)(unsigned api_major, unsigned api_minor, const ucp_params_t* params,
                               const ucp_config_t* config, ucp_context_h* context_p);
  void (*cleanup)(ucp_context_h context);
  ucs_status_t (*worker_create)(ucp_context_h context, const ucp_worker_params_t* params, ucp_worker_h* worker_p);
  void (*worker_destroy)(ucp_worker_h worker);
  ucs_status_t (*worker_get_address)(ucp_worker_h worker, ucp_address_t** address_p, size_t* length_p);
  void (*worker_release_address)(ucp_worker_h worker, ucp_address_t* address);
  unsigned (*worker_progress)(ucp_worker_h worker);
  ucs_status_t (*worker_get_efd)(ucp_worker_h worker, int* fd);
  ucs_status_t (*worker_arm)(ucp_worker_h worker);
  ucs_status_t (*worker_signal)(ucp_worker_h worker);
  ucs_status_t (*ep_create)(ucp_worker_h worker, const ucp_ep_params_t* params, ucp_ep_h* ep_p);
  ucs_status_ptr_t (*ep_close_nbx)(ucp_ep_h ep, const ucp_request_param_t* param);
  ucs_status_ptr_t (*tag_send_nbx)(ucp_ep_h ep, const void* buffer, size_t count, ucp_tag_t tag,
                                   const ucp_request_param_t* param);
  ucs_status_ptr_t (*tag_recv_nbx)(ucp_worker_h worker, void* buffer, size_t count, ucp_tag_t tag,
                                   ucp_tag_t tag_mask, const ucp_request_param_t* param);
  ucs_status_t (*request_check_status)(void* request);
  void (*request_cancel)(ucp_worker_h worker, void* request);
  void (*request_free)(void* request);
  const char* (*status_string)(ucs_status_t status);
};

// What the last load() found: where, which version, or why it failed (every attempt).
struct LoadInfo {
  bool loaded = false;
  std::string path, version, error;
};

// Loads libucp from the first of `candidates` (file paths or sonames) that has every entry point, once
// per process: later calls return the first outcome. Never throws.
const LoadInfo& load(const std::vector<std::string>& candidates);
const LoadInfo& load_info();
// The loaded API; throws std::runtime_error naming what was tried when nothing is loaded.
const Api& api();

// UCS_PTR_IS_ERR / UCS_PTR_STATUS of ucs/type/status.h.
inline bool ptr_is_err(ucs_status_ptr_t p) {
  return reinterpret_cast<uintptr_t>(p) >= static_cast<uintptr_t>(static_cast<intptr_t>(UCS_ERR_LAST));
}
inline ucs_status_t ptr_status(ucs_status_ptr_t p) {
  return static_cast<ucs_status_t>(static_cast<intptr_t>(reinterpret_cast<uintptr_t>(p)));
}
std::string status_text(ucs_status_t s);

}  // namespace ucx
}  // namespace ncclavg
