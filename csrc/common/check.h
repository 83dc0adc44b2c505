// One throwing check macro per failure domain. Every message names the argument or the library call,
// and carries file:line so a bug report points at the exact check.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ncclavg {

// Bad value of a user argument -> Python ValueError (pybind11 maps std::invalid_argument to it).
struct ArgError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Wrong kind of user argument (dtype, device kind) -> Python TypeError (registered in bindings.cpp).
struct TypeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A CUDA runtime call failed -> ncclavg.CudaError.
struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// An NCCL call failed, or NCCL could not be loaded -> ncclavg.NcclError.
struct NcclError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wait exceeded its deadline -> ncclavg.CommTimeoutError.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename E, typename... Parts>
[[noreturn]] inline void fail(const char* file, int line, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  os << " [" << file << ":" << line << "]";
  throw E(os.str());
}
}  // namespace detail

}  // namespace ncclavg

// NCCLAVG_CHECK_ARG(cond, "buffers", "all buffers must have the same dtype, got ", a, " and ", b)
#define NCCLAVG_CHECK_ARG(cond, argname, ...)                                                         \
  do {                                                                                                \
    if (!(cond)) ::ncclavg::detail::fail<::ncclavg::ArgError>(__FILE__, __LINE__, "argument '",     \
                                                               argname, "': ", __VA_ARGS__);         \
  } while (0)

#define NCCLAVG_CHECK_TYPE(cond, argname, ...)                                                        \
  do {                                                                                                \
    if (!(cond)) ::ncclavg::detail::fail<::ncclavg::TypeError>(__FILE__, __LINE__, "argument '",    \
                                                                argname, "': ", __VA_ARGS__);        \
  } while (0)

// Internal invariant that user input cannot break; still throws rather than aborting the process.
#define NCCLAVG_CHECK_INTERNAL(cond, ...)                                                             \
  do {                                                                                                \
    if (!(cond)) ::ncclavg::detail::fail<std::runtime_error>(__FILE__, __LINE__,                      \
                                                              "internal error: ", __VA_ARGS__);       \
  } while (0)
