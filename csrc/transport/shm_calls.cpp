// Note [Call signatures]
// The channel's own signature of a round (op, wire type, count, root, scale: Note [Shared-memory channel])
// says what bytes move, not what the user asked for. Collectives above it map onto a few channel calls:
// a barrier is a one-float all-reduce or a count-0 round, an integer all-reduce and an all-gather of the
// same bytes are both one all_gather, a scatter is a broadcast of the whole list. Two ranks that called
// different collectives could then pair silently. So every channel call can carry the user's call
// (ShmCallTag): the collective, the user's dtype, the reduction, the root and the element count. The
// round's signature holds the collective, dtype, reduction and root exactly (the root field is the
// wire root for a broadcast, whose wire root is the user's, else the user's root) and folds the user's
// count and the scale into the count word: count XOR mix(user count, scale). Two calls that differ in
// the wire count alone always differ there; calls that differ in the user count or the scale collide
// with probability 2^-64. The exact values of each round (wire count, user count, scale) are written
// to a line of their own that peers read only to describe a mismatch, so the hot line stays one cache
// line. A mismatch raises ShmMismatchError on every rank, naming both calls in the user's terms.
#include "shm_calls.h"

#include <sstream>

#include "../common/check.h"

namespace ncclavg {
namespace cpu {

const std::vector<std::string>& shm_collective_names() {
  // Index 0 is "no user call". Append only: the codes are compared between processes of one job, which
  // run one build, but keeping them stable keeps old logs readable.
  static const std::vector<std::string> names = {
      "",
      "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
      "all_gather_into_tensor_coalesced", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
      "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all", "all_to_all_single", "barrier",
      "coalesced collectives", "sparse all_reduce",
      // ncclavg's own Communicator API (ncclavg/comm/gloo.py)
      "Communicator.all_reduce_avg", "Communicator.reduce_scatter_avg", "Communicator.all_gather",
      "Communicator.reduce_scatter_processes", "Communicator.all_gather_processes",
      "Communicator.sum_over_processes", "Communicator.broadcast_tensors", "Communicator.allgather_object",
  };
  return names;
}

const std::vector<std::string>& shm_dtype_names() {
  static const std::vector<std::string> names = {
      "",        "float32", "float64",   "float16",    "bfloat16", "complex64", "complex128", "int8",
      "uint8",   "int16",   "uint16",    "int32",      "uint32",   "int64",     "uint64",     "bool",
      "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32", "bytes",
  };
  return names;
}

const std::vector<std::string>& shm_op_names() {
  // torch's ReduceOp.RedOpType value + 1
  static const std::vector<std::string> names = {"",    "SUM", "AVG", "PRODUCT", "MIN",       "MAX",
                                                 "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return names;
}

void check_call_tag(const ShmCallTag& tag, const char* argname) {
  NCCLAVG_CHECK_ARG(tag.collective() < static_cast<int>(shm_collective_names().size()) &&
                        tag.dtype() < static_cast<int>(shm_dtype_names().size()) &&
                        tag.op() < static_cast<int>(shm_op_names().size()) && (tag.word >> 44) == 0,
                    argname, "is not a call tag of this build: ", tag.word);
  NCCLAVG_CHECK_ARG(tag.count >= 0, argname, "count must be >= 0, got ", tag.count);
}

std::string describe_call(const ShmCallTag& tag) {
  std::ostringstream d;
  d << shm_collective_names()[tag.collective()];
  if (tag.op() != 0) d << "(" << shm_op_names()[tag.op()] << ")";
  if (tag.dtype() != 0) d << " of " << tag.count << " " << shm_dtype_names()[tag.dtype()];
  if (tag.root() >= 0) {
    const std::string& c = shm_collective_names()[tag.collective()];
    d << (c == "reduce" || c == "gather" ? " to root " : " from root ") << tag.root();
  }
  return d.str();
}

}  // namespace cpu
}  // namespace ncclavg
