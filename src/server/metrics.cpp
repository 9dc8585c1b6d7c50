#include "server/metrics.h"

#include <fmt/format.h>

namespace vavilov::server {

void Metrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lock(mutex_);
  ++requests_[{endpoint, status}];
}

void Metrics::add_prompt(int64_t tokens, int64_t cached_tokens) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += tokens;
  cached_tokens_ += cached_tokens;
}

void Metrics::add_generated(int64_t tokens) {
  std::lock_guard lock(mutex_);
  generated_tokens_ += tokens;
  recent_.emplace_back(Clock::now(), tokens);
}

void Metrics::add_speculative(const SpeculativeStats& stats) {
  std::lock_guard lock(mutex_);
  speculative_.add(stats);
}

void Metrics::set_load(int64_t queued, int64_t active) {
  std::lock_guard lock(mutex_);
  queued_ = queued;
  active_ = active;
}

std::string Metrics::render(const PrefixCache::Stats& cache) const {
  std::lock_guard lock(mutex_);
  std::string out;
  const auto metric = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  metric("vavilov_requests_total", "counter", "HTTP requests by endpoint and status code.");
  for (const auto& [key, count] : requests_)
    out += fmt::format("vavilov_requests_total{{endpoint=\"{}\",code=\"{}\"}} {}\n", key.first, key.second, count);
  metric("vavilov_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.");
  out += fmt::format("vavilov_prompt_tokens_total {}\n", prompt_tokens_);
  metric("vavilov_prompt_tokens_cached_total", "counter", "Prompt tokens restored from the prefix cache.");
  out += fmt::format("vavilov_prompt_tokens_cached_total {}\n", cached_tokens_);
  metric("vavilov_generation_tokens_total", "counter", "Generated tokens.");
  out += fmt::format("vavilov_generation_tokens_total {}\n", generated_tokens_);

  const auto now = Clock::now();
  while (!recent_.empty() && now - recent_.front().first > kWindow) recent_.pop_front();
  int64_t window_tokens = 0;
  for (const auto& entry : recent_) window_tokens += entry.second;
  metric("vavilov_generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.");
  out += fmt::format("vavilov_generation_tokens_per_second {:.3f}\n", double(window_tokens) / double(kWindow.count()));
  metric("vavilov_queue_depth", "gauge", "Requests waiting for a decoding slot.");
  out += fmt::format("vavilov_queue_depth {}\n", queued_);
  metric("vavilov_active_sequences", "gauge", "Sequences decoding now.");
  out += fmt::format("vavilov_active_sequences {}\n", active_);

  metric("vavilov_spec_verify_steps_total", "counter", "Speculative verify steps of finished requests.");
  out += fmt::format("vavilov_spec_verify_steps_total {}\n", speculative_.verify_steps);
  metric("vavilov_spec_drafts_proposed_total", "counter", "MTP drafts proposed, by draft position.");
  for (size_t j = 0; j < speculative_.proposed.size(); ++j)
    out += fmt::format("vavilov_spec_drafts_proposed_total{{position=\"{}\"}} {}\n", j + 1, speculative_.proposed[j]);
  metric("vavilov_spec_drafts_accepted_total", "counter", "MTP drafts accepted, by draft position.");
  for (size_t j = 0; j < speculative_.accepted.size(); ++j)
    out += fmt::format("vavilov_spec_drafts_accepted_total{{position=\"{}\"}} {}\n", j + 1, speculative_.accepted[j]);

  metric("vavilov_prefix_cache_hits_total", "counter", "Requests that started from a cached prefix.");
  out += fmt::format("vavilov_prefix_cache_hits_total {}\n", cache.hits);
  metric("vavilov_prefix_cache_misses_total", "counter", "Requests with no cached prefix.");
  out += fmt::format("vavilov_prefix_cache_misses_total {}\n", cache.misses);
  metric("vavilov_prefix_cache_entries", "gauge", "States in the prefix cache.");
  out += fmt::format("vavilov_prefix_cache_entries {}\n", cache.entries);
  metric("vavilov_prefix_cache_bytes", "gauge",
         "Bytes held by the prefix cache (budget: vavilov_prefix_cache_budget_bytes).");
  out += fmt::format("vavilov_prefix_cache_bytes {}\n", cache.bytes);
  metric("vavilov_prefix_cache_budget_bytes", "gauge", "The prefix cache's byte budget.");
  out += fmt::format("vavilov_prefix_cache_budget_bytes {}\n", cache.budget);
  return out;
}

}  // namespace vavilov::server
