// A 64-bit digest of a replica's bytes, the same on every process that holds the same bytes, for the
// check that data-parallel replicas are still identical (ncclavg/transport/replicas.py).
//
// Note [Replica digest]
// The digest of one buffer is the sum, modulo 2^64, of splitmix64(word_i + (i + 1) * kGolden) over its
// 8-byte words (the last one zero-padded), then mixed once with the byte count. A sum is the same in any
// order, so the threads' slices add up to the same digest whatever the machine's thread count, and the
// pass reads each byte once; splitmix64 is a bijection of 64-bit values with full avalanche, and the
// position enters before it, so one changed word changes its term and so the sum, always (the other
// terms are unchanged and the map is one-to-one), and two swapped words change both terms. What can
// escape is a change of several words whose term changes cancel modulo 2^64: for changes not chosen to
// do so, a chance of about 2^-64. The digest reads bits, not values: -0.0 and 0.0, or two NaN payloads,
// are different replicas, which is what "identical" means for bytes that the next step computes from.
// Several buffers combine in order (digest_many): the same buffers in another order are another digest.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>


namespace ncclavg {
namespace cpu {

uint64_t digest_bytes(const void* data, int64_t nbytes);
// The digests of each span (address, bytes) of host memory and, last, their combination in order.
std::vector<uint64_t> digest_spans(const std::vector<std::pair<uintptr_t, int64_t>>& spans);

}  // namespace cpu
}  // namespace ncclavg
