#pragma once
// The scheduler thread: admits queued jobs up to `parallel` active sequences (each starting from the longest cached
// prefix of its prompt). Every iteration runs one prompt chunk of each sequence still prefilling, then one batched
// verify step over all decoding sequences (step_batch), turning tokens into text with stop-string holdback; a long
// prompt thus delays the others by one chunk per step, not by its whole prefill. Cancelled and expired jobs leave
// before the next step.
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/speculative.h"
#include "model/weights.h"
#include "server/job.h"
#include "server/metrics.h"
#include "server/prefix_cache.h"
#include "tokenizer/tokenizer.h"

namespace vavilov::server {

struct SchedulerOptions {
  int parallel = 4;  // sequences decoding together
  int queue = 64;    // jobs waiting beyond those
  SpeculativeOptions speculative;
  SequenceFactory device;  // GPU sequences; empty: the CPU engine (the prefix cache keeps either's states)
};

class Scheduler {
 public:
  Scheduler(const Model& model, const tokenizer::Tokenizer& tokenizer, SchedulerOptions options, PrefixCache& cache,
            Metrics& metrics);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class Admission { kQueued, kQueueFull, kClosed };
  Admission submit(std::shared_ptr<Job> job);

  // Graceful stop: refuses new jobs and fails queued ones, lets active ones finish for up to `grace`, cancels the
  // rest, and joins the thread.
  void shutdown(std::chrono::milliseconds grace);

 private:
  struct Active;

  void loop();
  std::vector<std::shared_ptr<Job>> take_admitted();
  void start(std::shared_ptr<Job> job);
  void prefill();
  void step();
  // Emits tokens into the job's text; returns false once the job is finished.
  bool emit(Active& active, const std::vector<int32_t>& tokens);
  void retire(Active& active);
  void publish_load();

  const Model& model_;
  const tokenizer::Tokenizer& tokenizer_;
  const SchedulerOptions options_;
  PrefixCache& cache_;
  Metrics& metrics_;

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  size_t active_count_ = 0;  // mirror of active_.size() for submit()
  bool closed_ = false, stop_ = false;
  std::vector<std::unique_ptr<Active>> active_;  // scheduler thread only
  std::thread thread_;
};

}  // namespace vavilov::server
