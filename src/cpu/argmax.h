#pragma once
// The greedy choice over a row of logits, vectorised: an AVX2 pass for the largest value, then a second for its first
// index. About 8x faster than std::max_element (one compare-and-branch per value), which a decode step runs over
// every row of a 248320-token vocabulary.
#include <cstdint>

namespace vavilov::cpu {

// std::max_element's index over x[0, n) (n ≥ 1), bit for bit: the lowest index among equal maxima (+0 and −0
// compare equal), NaN never chosen unless it is x[0] — max_element keeps its first element while nothing compares
// greater than it, and nothing compares greater than NaN. So: 0 when x[0] is NaN, else the first index of the
// largest non-NaN value (all −inf: 0). The GPU's argmax kernel (cuda/argmax.cuh) follows the same rule.
int32_t argmax(const float* x, int64_t n);

}  // namespace vavilov::cpu
