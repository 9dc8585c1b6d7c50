// cpu::argmax (the vectorised greedy choice shared by sampling and the CPU backend) against std::max_element, the
// host rule the GPU kernel and the Decoder's greedy ids follow: random rows of every length around the 8- and
// 16-lane steps and at Flash-Next's vocabulary, ties, ±0, infinities and NaN anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu/argmax.h"

namespace vavilov {
namespace {

constexpr int64_t kFlashNextVocab = 248320;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

int32_t max_element_index(const std::vector<float>& row) {
  return int32_t(std::max_element(row.begin(), row.end()) - row.begin());
}

TEST(CpuArgmax, RandomRowsMatchMaxElement) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<int64_t> lengths{kFlashNextVocab, kFlashNextVocab - 3, 4096, 1000};
  for (int64_t n = 1; n <= 70; ++n) lengths.push_back(n);
  for (int64_t n : lengths)
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<float> row(static_cast<size_t>(n));
      for (float& x : row) x = normal(rng);
      EXPECT_EQ(cpu::argmax(row.data(), n), max_element_index(row)) << "length " << n;
    }
}

// Values from a handful of levels: the maximum occurs many times, and the lowest index must win.
TEST(CpuArgmax, TiesPickTheLowestIndex) {
  std::mt19937 rng(2);
  for (int64_t n : {int64_t(1), int64_t(9), int64_t(17), int64_t(333), kFlashNextVocab})
    for (int levels : {1, 2, 3, 50}) {
      std::uniform_int_distribution<int> level(0, levels - 1);
      std::vector<float> row(static_cast<size_t>(n));
      for (float& x : row) x = float(level(rng)) * 0.5f;
      EXPECT_EQ(cpu::argmax(row.data(), n), max_element_index(row)) << "length " << n << ", levels " << levels;
    }
  const std::vector<float> zeros{-0.0f, 0.0f, -0.0f, -1.0f};  // +0 == −0: the first zero wins
  EXPECT_EQ(cpu::argmax(zeros.data(), 4), 0);
  std::vector<float> last_only(100, 1.0f);
  last_only.back() = 2.0f;
  EXPECT_EQ(cpu::argmax(last_only.data(), 100), 99);
}

TEST(CpuArgmax, InfinitiesAndNaNFollowMaxElement) {
  const std::vector<std::vector<float>> rows{
      {-kInf, -kInf, -kInf},  // all −inf: 0
      {-kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, -kInf, 3.0f},
      {1.0f, kInf, 2.0f, kInf},  // the first +inf
      {kNaN, 1.0f, 5.0f},        // NaN first: max_element keeps it
      {1.0f, kNaN, 5.0f, kNaN},  // NaN later: never chosen
      {kNaN, kNaN, kNaN},        // all NaN: 0
      {-kInf, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN},
  };
  const std::vector<int32_t> expected{0, 9, 1, 0, 2, 0, 0};
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(cpu::argmax(rows[i].data(), int64_t(rows[i].size())), expected[i]) << "case " << i;
    EXPECT_EQ(max_element_index(rows[i]), expected[i]) << "case " << i << " (std::max_element)";
  }
  // NaN, ±inf, ties and −0 sprinkled over random rows of every length.
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> kind(0, 9), small(-2, 2);
  const float specials[] = {kNaN, kInf, -kInf, -0.0f, 0.0f};
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<float> row(static_cast<size_t>(1 + trial % 97));
    for (float& x : row) x = kind(rng) < 2 ? specials[size_t(kind(rng)) % 5] : float(small(rng));
    EXPECT_EQ(cpu::argmax(row.data(), int64_t(row.size())), max_element_index(row)) << "trial " << trial;
  }
}

}  // namespace
}  // namespace vavilov
