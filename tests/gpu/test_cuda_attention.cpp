// Gated sparse attention on the GPU (cuda/attention.cuh sparse_attention: positions split into chunks, running
// softmaxes merged across warps and chunks) against the spec's attention in double precision on the host: softmax of
// q·k/√d over the positions a row may see that its indexer chose (all while the row has at most keep_blocks complete
// blocks, else the selected ones and every position of the trailing incomplete block),
// the weighted sum of the values, times σ(gate). Shapes: Flash-Next's (24 heads over 2 kv heads of 256) at the decode
// step's short context under a captured step's wide launch bound (one chunk: a row of a 1-row pass takes one per 256
// positions of its context), 1 row at 4701 positions (19 chunks), 4 rows at 5000 positions with a random block
// selection (32 chunks: rows of several-row passes split down to a position a warp), a prefill pass of 64 rows (on the
// tensor-core kernel below), a bound of one chunk (the block writes the output without the cross-chunk merge), the tiny
// fixtures' head groups of 3 and 2 (head dims 8, 32), and sharp softmaxes (queries of deviation 3) whose running peaks
// move between a warp's batches of positions. Passes of more than 4 rows take the tensor-core kernel
// (attend_prefill.cuh): the first pass of a prompt, 32 rows at 4000 positions with a random block selection, rows on
// both sides of the indexer's limit (2051 positions), a tile of queries the pass does not fill, sharp softmaxes whose
// peaks move between position tiles, 130 rows (many query tiles, their positions split into chunks), a sparse selection
// (3 % of blocks: few gathered tiles), the tiny fixtures' head dims and groups, long prompts whose rows see 8500,
// 16384 and 32772 positions (the kernel gathers the blocks a tile's rows chose), and tiny shapes' gathers: ~2 % of
// 750 blocks chosen, 64 rows of one head a query tile, 80 heads a kv head (tiles of 64 queries across rows).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention.cuh"
#include "device_matrices.h"

namespace vavilov {
namespace {

struct Case {
  cuda::AttentionShape shape;
  int rows;
  int64_t first;             // position of row 0
  int launch_tokens;         // the pass's grid bound (≥ every row's visible positions)
  double keep;               // chance a complete block is selected (1: all)
  float query_scale = 1.0f;  // standard deviation of the queries' values (larger: sharper softmaxes)
};

struct Inputs {
  std::vector<float> queries, keys, values;
  std::vector<float> gates;  // [rows, heads, 2·head_dim]: each head's gate in its second half, as in the q projection
  std::vector<uint8_t> selected;
  int max_tokens = 0;
};

int stride_blocks(const Case& c, int max_tokens) {
  return cuda::AttentionBounds{0, max_tokens}.stride_blocks(c.shape.ratio);
}

Inputs random_inputs(const Case& c, std::mt19937& rng) {
  const auto& s = c.shape;
  Inputs in;
  in.max_tokens = c.launch_tokens;
  const size_t positions = size_t(c.first + c.rows);
  in.queries = test::normal_values(rng, size_t(c.rows) * s.heads * s.head_dim, c.query_scale);
  in.gates = test::normal_values(rng, size_t(c.rows) * s.heads * 2 * s.head_dim, 1.0f);
  in.keys = test::normal_values(rng, positions * s.kv_heads * s.head_dim, 1.0f);
  in.values = test::normal_values(rng, positions * s.kv_heads * s.head_dim, 1.0f);
  std::bernoulli_distribution chosen(c.keep);
  in.selected.resize(size_t(c.rows) * stride_blocks(c, in.max_tokens));
  for (uint8_t& b : in.selected) b = chosen(rng) ? 1 : 0;
  return in;
}

// out[r, h, d] and the tolerance of each: fp32 rounding of scores, exponentials and sums of ≤ 5000 terms, relative
// to the weighted mean of |v| that bounds the output's magnitude (the gate is < 1).
void reference(const Case& c, const Inputs& in, std::vector<double>& out, std::vector<double>& scale) {
  const auto& s = c.shape;
  const int hd = s.head_dim, group = s.heads / s.kv_heads, stride = stride_blocks(c, in.max_tokens);
  out.assign(size_t(c.rows) * s.heads * hd, 0.0);
  scale.assign(out.size(), 0.0);
  for (int r = 0; r < c.rows; ++r) {
    const int64_t visible = c.first + r + 1, complete = visible / s.ratio * s.ratio;
    for (int h = 0; h < s.heads; ++h) {
      const int kv = h / group;
      const float* q = &in.queries[(size_t(r) * s.heads + h) * hd];
      std::vector<double> scores(size_t(visible), -INFINITY);
      double peak = -INFINITY;
      for (int64_t p = 0; p < visible; ++p) {
        const bool all_chosen = complete / s.ratio <= s.keep_blocks;  // the indexer keeps every block
        if (!all_chosen && p < complete && !in.selected[size_t(r) * stride + size_t(p / s.ratio)]) continue;
        const float* k = &in.keys[(size_t(p) * s.kv_heads + kv) * hd];
        double dot = 0.0;
        for (int d = 0; d < hd; ++d) dot += double(q[d]) * k[d];
        scores[size_t(p)] = dot / std::sqrt(double(hd));
        peak = std::max(peak, scores[size_t(p)]);
      }
      double sum = 0.0;
      std::vector<double> acc(size_t(hd), 0.0), magnitude(size_t(hd), 0.0);
      for (int64_t p = 0; p < visible; ++p) {
        if (scores[size_t(p)] == -INFINITY) continue;
        const double w = std::exp(scores[size_t(p)] - peak);
        sum += w;
        const float* v = &in.values[(size_t(p) * s.kv_heads + kv) * hd];
        for (int d = 0; d < hd; ++d) acc[size_t(d)] += w * v[d], magnitude[size_t(d)] += w * std::abs(v[d]);
      }
      for (int d = 0; d < hd; ++d) {
        const size_t at = (size_t(r) * s.heads + h) * hd + d;
        const double gate = in.gates[(size_t(r) * s.heads + h) * 2 * hd + hd + d];  // after the head's query half
        out[at] = acc[size_t(d)] / sum / (1.0 + std::exp(-gate));
        scale[at] = magnitude[size_t(d)] / sum;
      }
    }
  }
}

// Runs sparse_attention `launches` times over the same inputs (the arrival counters must come back to zero) and
// returns each launch's output.
std::vector<std::vector<float>> run(const Case& c, const Inputs& in, int launches) {
  const auto& s = c.shape;
  test::DeviceMemory memory;
  const float* queries = memory.copy(in.queries);
  const float* gates = memory.copy(in.gates);
  const float* keys = memory.copy(in.keys);
  const float* values = memory.copy(in.values);
  const uint8_t* selected = memory.copy(in.selected);
  const int64_t* first = memory.copy(std::vector<int64_t>{c.first});
  const cuda::AttendScratch scratch{memory.zeros<float>(cuda::attend_value_floats(s, c.rows)),
                                    memory.zeros<float2>(cuda::attend_stat_count(s, c.rows)),
                                    memory.zeros<unsigned>(cuda::attend_arrival_count(s, c.rows))};
  float* out = memory.zeros<float>(size_t(c.rows) * s.heads * s.head_dim);
  std::vector<std::vector<float>> outputs;
  for (int i = 0; i < launches; ++i) {
    cuda::sparse_attention(s, queries, gates + s.head_dim, keys, values, selected, c.rows, first, first,
                           cuda::AttentionBounds{c.launch_tokens, in.max_tokens}, scratch, out, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    outputs.push_back(test::download(out, size_t(c.rows) * s.heads * s.head_dim));
  }
  return outputs;
}

void expect_matches_reference(const Case& c, const std::string& what) {
  std::mt19937 rng(uint32_t(c.first * 31 + c.rows));
  const Inputs in = random_inputs(c, rng);
  std::vector<double> want, scale;
  reference(c, in, want, scale);
  const auto outputs = run(c, in, 2);
  int bad = 0;
  for (size_t i = 0; i < want.size() && bad < 5; ++i) {
    const double tolerance = 2e-5 * scale[i];
    if (!(std::abs(outputs[0][i] - want[i]) <= tolerance)) {
      ++bad;
      ADD_FAILURE() << what << ": output " << i << " = " << outputs[0][i] << ", reference " << want[i] << " (±"
                    << tolerance << ")";
    }
  }
  EXPECT_EQ(outputs[0], outputs[1]) << what << ": a second launch differs (arrival counters or determinism)";
}

constexpr cuda::AttentionShape kFlashNext{24, 2, 256, 4, 128, 4, 512};

TEST(CudaAttention, DecodeRowAtShortContextUnderWideBound) {
  expect_matches_reference({kFlashNext, 1, 63, 8192, 1.0}, "1 row at 64 positions, bound 8192");
}

TEST(CudaAttention, VerifyRowsAtLongContextWithBlockSelection) {
  expect_matches_reference({kFlashNext, 4, 4996, 8192, 0.25}, "4 rows at 5000 positions, a quarter of blocks");
}

TEST(CudaAttention, DecodeRowAtLongContextOverChunks) {
  expect_matches_reference({kFlashNext, 1, 4700, 8192, 0.25}, "1 row at 4701 positions (19 chunks of 256)");
}

// Scores spread over tens of units, so that a warp's running peak moves from one batch of positions to the next and
// the rescaling of the running sums and weighted values decides the result.
TEST(CudaAttention, SharpScoresRescaleAcrossBatches) {
  expect_matches_reference({kFlashNext, 1, 63, 8192, 1.0, 3.0f}, "1 row at 64 positions, queries of deviation 3");
  expect_matches_reference({kFlashNext, 4, 4996, 8192, 0.25, 3.0f}, "4 rows at 5000 positions, queries of deviation 3");
  expect_matches_reference({{6, 2, 8, 4, 16, 4, 2}, 3, 40, 1024, 0.5, 3.0f}, "groups of 3 heads of 8, deviation 3");
}

TEST(CudaAttention, PrefillPassOfSixtyFourRows) {
  expect_matches_reference({kFlashNext, 64, 1000, 1064, 0.5}, "64 rows from position 1000");
}

TEST(CudaAttention, PrefillPassesOnTheTensorCores) {
  expect_matches_reference({kFlashNext, 64, 0, 64, 1.0}, "a prompt's first 64 rows");
  expect_matches_reference({kFlashNext, 32, 4000, 4032, 0.25}, "32 rows at 4000 positions, a quarter of blocks");
  expect_matches_reference({kFlashNext, 37, 2030, 2067, 0.5}, "37 rows across the indexer's limit");
  expect_matches_reference({kFlashNext, 5, 300, 305, 1.0, 3.0f}, "5 rows at 300 positions, queries of deviation 3");
  expect_matches_reference({kFlashNext, 130, 2100, 2230, 0.5}, "130 rows at 2100 positions (25 query tiles a kv head)");
  expect_matches_reference({kFlashNext, 16, 4000, 4016, 0.03}, "16 rows keeping 3 % of blocks (few gathered tiles)");
}

// The tiny fixtures' shapes on the prefill kernel (also fast enough for compute-sanitizer).
TEST(CudaAttention, PrefillPassesOfTinyHeads) {
  expect_matches_reference({{6, 2, 8, 4, 16, 4, 4}, 9, 40, 49, 0.5, 3.0f}, "9 rows, groups of 3 heads of 8");
  expect_matches_reference({{2, 1, 32, 4, 16, 2, 4}, 7, 17, 24, 0.5}, "7 rows, a group of 2 heads of 32");
  expect_matches_reference({{8, 1, 16, 4, 16, 4, 2}, 6, 0, 6, 1.0}, "6 rows from the first position, heads of 16");
  expect_matches_reference({{4, 2, 16, 4, 16, 4, 16}, 70, 100, 170, 0.5}, "70 rows, 2 query tiles a kv head");
}

// Long prompts: the tensor-core kernel walks only the blocks its tile's rows chose (their union, gathered), whatever
// the positions they see.
TEST(CudaAttention, PrefillPassesOfLongPrompts) {
  expect_matches_reference({kFlashNext, 8, 8500, 8508, 0.25}, "8 rows at 8500 positions, a quarter of blocks");
  expect_matches_reference({kFlashNext, 64, 16320, 16384, 0.125}, "64 rows at 16320 positions, an eighth of blocks");
  expect_matches_reference({kFlashNext, 12, 32760, 32772, 0.0625, 3.0f}, "12 rows at 32760, deviation 3");
}

// The gathered tiles of the tiny shapes: few chosen blocks among many, rows of one head a kv head (64 rows a query
// tile), and rows of more heads than a tile's queries (tiles straddle rows).
TEST(CudaAttention, PrefillGathersChosenBlocksOfTinyHeads) {
  expect_matches_reference({{6, 2, 8, 4, 16, 4, 2}, 9, 3000, 3009, 0.02}, "9 rows keeping ~2 % of 750 blocks");
  expect_matches_reference({{2, 2, 16, 4, 16, 4, 2}, 70, 100, 170, 0.3}, "70 rows of one head a kv head");
  expect_matches_reference({{80, 1, 8, 4, 16, 4, 2}, 6, 40, 46, 0.5}, "6 rows of 80 heads over one kv head");
}

TEST(CudaAttention, OneChunkWritesTheOutputItself) {
  expect_matches_reference({kFlashNext, 2, 150, 256, 1.0}, "2 rows at 151 positions, bound 256 (one chunk)");
  expect_matches_reference({{6, 2, 8, 4, 16, 4, 2}, 3, 40, 200, 0.5}, "one chunk with block selection");
}

TEST(CudaAttention, TinyHeadGroups) {
  expect_matches_reference({{6, 2, 8, 4, 16, 4, 2}, 3, 40, 1024, 0.5}, "groups of 3 heads of 8");
  expect_matches_reference({{2, 1, 32, 4, 16, 2, 4}, 2, 17, 1024, 0.5}, "a group of 2 heads of 32");
  expect_matches_reference({{8, 1, 16, 4, 16, 4, 2}, 1, 0, 1024, 1.0}, "the first position");
}

}  // namespace
}  // namespace vavilov
