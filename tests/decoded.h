#pragma once
// Decoding a prompt through a Decoder as generate_speculative does, and comparing two such decodings token for token
// and statistic for statistic (the seam and greedy-step tests compare a path against its reference this way).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "model/weights.h"

namespace vavilov::test {

struct Decoded {
  std::vector<int32_t> tokens;
  SpeculativeStats stats;
};

// Decodes until options.max_tokens tokens or a stop, as generate_speculative does.
inline Decoded decode(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& options,
                      const SpeculativeOptions& speculative, const SequenceFactory& device) {
  Decoder decoder(model, options, speculative, device);
  Decoded run;
  std::vector<int32_t> pending{decoder.start(prompt)};
  for (;;) {
    bool done = false;
    for (size_t i = 0; i < pending.size() && !done; ++i) {
      run.tokens.push_back(pending[i]);
      done = decoder.is_stop(pending[i]) || int64_t(run.tokens.size()) >= options.max_tokens;
    }
    if (done) break;
    pending = decoder.step();
  }
  run.stats = decoder.stats();
  return run;
}

inline void expect_same_stats(const SpeculativeStats& a, const SpeculativeStats& b, const std::string& what) {
  EXPECT_EQ(a.proposed, b.proposed) << what;
  EXPECT_EQ(a.accepted, b.accepted) << what;
  EXPECT_EQ(a.verify_steps, b.verify_steps) << what;
  EXPECT_EQ(a.emitted, b.emitted) << what;
}

inline void expect_same_decoding(const Decoded& got, const Decoded& want, const std::string& what) {
  EXPECT_EQ(got.tokens, want.tokens) << what;
  expect_same_stats(got.stats, want.stats, what);
}

}  // namespace vavilov::test
