#pragma once
// Rows of logits that exercise the sampler's filters (the host's against a full sort, the device's against the host):
// spread, on a coarse grid (exact ties, crowded buckets, the cuts inside them), all equal, two thirds banned, and a
// tail whose weights underflow to 0.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace vavilov::test {

inline std::vector<std::vector<float>> sampling_rows(int64_t vocab, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<std::vector<float>> rows(5, std::vector<float>(static_cast<size_t>(vocab)));
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = normal(generator);
    rows[0][size_t(i)] = x;
    rows[1][size_t(i)] = std::round(x * 2) / 2;
    rows[2][size_t(i)] = 1.5f;
    rows[3][size_t(i)] = i % 3 ? -INFINITY : x;
    rows[4][size_t(i)] = i % 1000 ? x - 2000.0f : x;
  }
  return rows;
}

}  // namespace vavilov::test
