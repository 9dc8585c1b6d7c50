#pragma once
// Server counters, rendered as Prometheus text for GET /metrics. Safe to update from any thread.
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "engine/speculative.h"
#include "server/prefix_cache.h"

namespace vavilov::server {

class Metrics {
 public:
  void count_request(const std::string& endpoint, int status);
  void add_prompt(int64_t tokens, int64_t cached_tokens);
  // Tokens emitted by one scheduler step (the tokens/s gauge is over the last kWindow).
  void add_generated(int64_t tokens);
  void add_speculative(const SpeculativeStats& stats);
  void set_load(int64_t queued, int64_t active);

  std::string render(const PrefixCache::Stats& cache) const;

 private:
  static constexpr std::chrono::seconds kWindow{10};
  using Clock = std::chrono::steady_clock;

  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, int64_t> requests_;
  int64_t prompt_tokens_ = 0, cached_tokens_ = 0, generated_tokens_ = 0, queued_ = 0, active_ = 0;
  SpeculativeStats speculative_;
  mutable std::deque<std::pair<Clock::time_point, int64_t>> recent_;  // (when, tokens) within kWindow
};

}  // namespace vavilov::server
