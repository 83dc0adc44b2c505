// The element types that cross the boundary. Values are part of the Python contract (buffers.py).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ncclavg {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline size_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

inline bool dtype_valid(int code) { return code >= 0 && code <= 2; }

}  // namespace ncclavg
