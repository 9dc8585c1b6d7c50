// The sparse-attention layer's launches before the attention itself (cuda/attention.cuh), against the spec's math on
// the host in double precision:
// - attention_inputs' pooled block keys (the mean of a block's `ratio` raw index keys, zero-centred RMSNorm, RoPE at
//   the block's first position) for the blocks a pass completes, some of whose positions precede the pass (read from
//   the cache) and some in it (read from the pass's own projections); blocks the pass does not complete stay
//   untouched, and the raw index keys reach the cache;
// - qsa_select: each row keeps its top keep_blocks blocks by the indexer's score (Σ_h relu(q_h·k_b)/√d), ties to the
//   lower block index (the CPU's partial_sort); integer-valued inputs make every score exact in fp32, so the
//   comparison is exact (and scores tie often); decode and verify passes (≤ 4 rows) rank by comparisons, longer ones
//   by a radix select; a launch bound that leaves no row more than keep_blocks blocks launches nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/attention.cuh"
#include "device_matrices.h"

namespace vavilov {
namespace {

// A small shape: 4 heads over 2 kv heads of 32, 2 index heads of 16, blocks of 4, 3 blocks kept.
constexpr cuda::AttentionShape kShape{4, 2, 32, 2, 16, 4, 3};
constexpr int kRotaryDim = 8;
constexpr float kEps = 1e-6f;

std::vector<double> inv_freq_table() {
  std::vector<double> f(kRotaryDim / 2);
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(10000.0, -2.0 * double(i) / kRotaryDim);
  return f;
}

// The pooled key of block b from the raw index keys of every position (row p at p·dim), in double.
std::vector<double> pooled_block_key(const std::vector<float>& raw, const std::vector<float>& weight, int64_t b) {
  const int dim = kShape.index_dim, ratio = kShape.ratio;
  std::vector<double> pooled(static_cast<size_t>(dim), 0.0);
  for (int i = 0; i < ratio; ++i)
    for (int d = 0; d < dim; ++d) pooled[size_t(d)] += raw[size_t(b * ratio + i) * dim + size_t(d)] / double(ratio);
  double squares = 0.0;
  for (double v : pooled) squares += v * v;
  const double scale = 1.0 / std::sqrt(squares / dim + kEps);
  std::vector<double> normed(static_cast<size_t>(dim));
  for (int d = 0; d < dim; ++d) normed[size_t(d)] = pooled[size_t(d)] * scale * (1.0 + weight[size_t(d)]);
  const auto freq = inv_freq_table();
  const int half = kRotaryDim / 2;
  std::vector<double> out = normed;
  for (int i = 0; i < half; ++i) {
    const double angle = freq[size_t(i)] * double(b * ratio), c = std::cos(angle), s = std::sin(angle);
    out[size_t(i)] = normed[size_t(i)] * c - normed[size_t(i + half)] * s;
    out[size_t(i + half)] = normed[size_t(i + half)] * c + normed[size_t(i)] * s;
  }
  return out;
}

// A pass of `rows` rows from position `first`: block keys of the blocks it completes against the reference.
void expect_pooled_block_keys(int64_t first, int rows) {
  const auto& s = kShape;
  const int dim = s.index_dim, hd = s.head_dim, capacity = 64;
  std::mt19937 rng(uint32_t(first * 7 + rows));
  const int64_t positions = first + rows;
  // Raw index keys of every position: earlier ones in the cache, the pass's in its projections.
  const std::vector<float> raw = test::normal_values(rng, size_t(positions) * dim, 1.0f);
  std::vector<float> cached(size_t(capacity) * dim, 0.0f), projections;
  std::copy(raw.begin(), raw.begin() + first * dim, cached.begin());
  for (int r = 0; r < rows; ++r) {  // [rows, (index_heads + 1)·dim]: the index queries, then the index key
    const auto queries = test::normal_values(rng, size_t(s.index_heads) * dim, 1.0f);
    projections.insert(projections.end(), queries.begin(), queries.end());
    projections.insert(projections.end(), raw.begin() + (first + r) * dim, raw.begin() + (first + r + 1) * dim);
  }
  const auto weight = test::normal_values(rng, size_t(dim), 0.5f);
  const auto head_norm = test::normal_values(rng, size_t(hd), 0.5f);
  const auto freq = inv_freq_table();

  test::DeviceMemory memory;
  const int blocks = capacity / s.ratio + 1;
  const float kUntouched = 12345.0f;
  cuda::AttentionCaches caches{memory.zeros<float>(size_t(capacity) * s.kv_heads * hd),
                               memory.zeros<float>(size_t(capacity) * s.kv_heads * hd), memory.copy(cached),
                               memory.copy(std::vector<float>(size_t(blocks) * dim, kUntouched))};
  const cuda::AttentionInputs in{memory.copy(test::normal_values(rng, size_t(rows) * s.heads * 2 * hd, 1.0f)),
                                 memory.copy(test::normal_values(rng, size_t(rows) * s.kv_heads * hd, 1.0f)),
                                 memory.copy(test::normal_values(rng, size_t(rows) * s.kv_heads * hd, 1.0f)),
                                 memory.copy(projections),
                                 memory.copy(head_norm),
                                 memory.copy(head_norm),
                                 memory.copy(weight),
                                 memory.copy(weight),
                                 memory.copy(std::vector<float>(freq.begin(), freq.end())),
                                 kRotaryDim,
                                 kEps};
  float* queries = memory.zeros<float>(size_t(rows) * s.heads * hd);
  float* index_queries = memory.zeros<float>(size_t(rows) * s.index_heads * dim);
  cuda::attention_inputs(s, in, rows, memory.copy(std::vector<int64_t>{first}), queries, index_queries, caches,
                         nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const auto got = test::download(caches.block_keys, size_t(blocks) * dim);
  int completed = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = (b + 1) * s.ratio;  // the block is complete once its last position is in
    const bool by_pass = end > first && end <= first + rows;
    if (!by_pass) {
      for (int d = 0; d < dim; ++d)
        ASSERT_EQ(got[size_t(b) * dim + size_t(d)], kUntouched) << "block " << b << " is not completed by the pass";
      continue;
    }
    ++completed;
    const auto want = pooled_block_key(raw, weight, b);
    for (int d = 0; d < dim; ++d) {
      // fp32 mean, sum of squares over 16 values and rotation: a few ulps of the normed values (|·| ≲ 4).
      EXPECT_NEAR(got[size_t(b) * dim + size_t(d)], want[size_t(d)], 2e-5 * (1.0 + std::abs(want[size_t(d)])))
          << "block " << b << " dim " << d << " (pass of " << rows << " rows from " << first << ")";
    }
  }
  EXPECT_EQ(completed, int((first + rows) / s.ratio - first / s.ratio));
  const auto index_keys = test::download(caches.index_keys, size_t(positions) * dim);
  EXPECT_TRUE(std::equal(raw.begin(), raw.end(), index_keys.begin())) << "raw index keys in the cache";
}

TEST(CudaAttentionInputs, DecodeRowCompletingABlockPoolsCachedKeys) {
  expect_pooled_block_keys(11, 1);  // position 11 completes block 2 (8–11): three keys from the cache
  expect_pooled_block_keys(12, 1);  // completes nothing
}

TEST(CudaAttentionInputs, VerifyRowsCompletingBlocksAcrossThePass) {
  expect_pooled_block_keys(6, 4);   // 6–9 complete block 1 (4–7: two cached keys, two of the pass)
  expect_pooled_block_keys(13, 3);  // 13–15 complete block 3 (12–15: one cached key)
}

TEST(CudaAttentionInputs, PrefillPassCompletingManyBlocks) {
  expect_pooled_block_keys(0, 37);  // blocks 0–8 from the pass alone
  expect_pooled_block_keys(2, 50);  // blocks 0–12, the first with two cached keys
}

// qsa_select of `rows` rows from `first` under launch bound `launch_tokens` (scratch for max_tokens), keeping
// `keep_blocks`; scores exact (integer inputs).
void expect_selection(int64_t first, int rows, int launch_tokens, int max_tokens = 64, int keep_blocks = 3) {
  cuda::AttentionShape s = kShape;
  s.keep_blocks = keep_blocks;
  const int dim = s.index_dim;
  const int stride = cuda::AttentionBounds{0, max_tokens}.stride_blocks(s.ratio);
  std::mt19937 rng(uint32_t(first + 100 * rows));
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<float> queries(size_t(rows) * s.index_heads * dim), keys(size_t(stride) * dim);
  for (float& v : queries) v = float(small(rng));
  for (float& v : keys) v = float(small(rng));
  for (int d = 0; d < dim; ++d) keys[size_t(dim) + size_t(d)] = keys[size_t(d)];  // blocks 0 and 1 tie
  for (int d = 0; d < dim; ++d) keys[size_t(5 * dim) + size_t(d)] = keys[size_t(3 * dim) + size_t(d)];  // 3 and 5

  test::DeviceMemory memory;
  const uint8_t kUnwritten = 7;
  uint8_t* selected = memory.copy(std::vector<uint8_t>(size_t(rows) * stride, kUnwritten));
  cuda::qsa_select(s, memory.copy(queries), memory.copy(keys), rows, memory.copy(std::vector<int64_t>{first}),
                   cuda::AttentionBounds{launch_tokens, max_tokens}, memory.zeros<float>(size_t(rows) * stride),
                   selected, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = test::download(selected, size_t(rows) * stride);

  if (launch_tokens / s.ratio <= s.keep_blocks) {  // nothing to select: nothing launched, nothing written
    EXPECT_TRUE(std::all_of(got.begin(), got.end(), [&](uint8_t v) { return v == kUnwritten; }));
    return;
  }
  for (int r = 0; r < rows; ++r) {
    const int blocks = int((first + r + 1) / s.ratio);
    std::vector<double> score(size_t(blocks), 0.0);
    for (int b = 0; b < blocks; ++b)
      for (int h = 0; h < s.index_heads; ++h) {
        double dot = 0.0;
        for (int d = 0; d < dim; ++d)
          dot += double(queries[(size_t(r) * s.index_heads + h) * dim + d]) * keys[size_t(b) * dim + d];
        score[size_t(b)] += std::max(0.0, dot);
      }
    std::vector<int> order(static_cast<size_t>(blocks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return score[size_t(a)] > score[size_t(b)]; });
    std::vector<uint8_t> want(size_t(blocks), 0);
    for (int i = 0; i < std::min(blocks, s.keep_blocks); ++i) want[size_t(order[size_t(i)])] = 1;
    for (int b = 0; b < blocks; ++b)
      EXPECT_EQ(int(got[size_t(r) * stride + size_t(b)]), int(want[size_t(b)]))
          << "row " << r << " (position " << first + r << ") block " << b << " score " << score[size_t(b)];
  }
}

TEST(CudaAttentionInputs, SelectionKeepsTopBlocksTiesToLowerIndex) {
  expect_selection(23, 1, 64);  // 6 blocks, 3 kept
  expect_selection(30, 4, 64);  // rows of 7 and 8 blocks
  expect_selection(9, 3, 64);   // rows of 2 and 3 blocks: every block kept
}

TEST(CudaAttentionInputs, SelectionAtLongContextRanksEveryBlock) {
  expect_selection(2399, 2, 4096, 4096, 3);    // 600 blocks: 19 tiles of scores over 8 warps, 3 kept
  expect_selection(2399, 4, 4096, 4096, 250);  // 250 of 600–601 kept, many tied scores
  expect_selection(1000, 1, 1024, 1024, 249);  // 250 blocks, 249 kept
}

// Passes of more than 4 rows select by a radix select over the scores' bits (one block a row): a 64-row pass at 9000
// positions (2250 blocks, 512 kept: small-integer scores, so the threshold falls inside a run of equal scores), 9 rows
// keeping 250 and 5 keeping 1 of 600, and a pass whose first rows keep every block and whose last ones rank.
TEST(CudaAttentionInputs, SelectionOfPrefillPassesByRadixSelect) {
  expect_selection(8999, 64, 9088, 9088, 512);
  expect_selection(2399, 9, 4096, 4096, 250);
  expect_selection(2399, 5, 4096, 4096, 1);
  expect_selection(8, 8, 64);  // rows of 2–4 blocks, 3 kept
}

TEST(CudaAttentionInputs, SelectionLaunchesNothingWhileEveryBlockIsKept) {
  expect_selection(5, 4, 12);  // 3 blocks at most under the bound
  expect_selection(0, 1, 15);
}

}  // namespace
}  // namespace vavilov
