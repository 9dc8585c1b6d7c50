#pragma once
// One request's generation as its HTTP handler and the scheduler thread share it: the scheduler appends text and
// finishes it; the handler takes what is new, and cancels it when the client goes away.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/generate.h"

namespace vavilov::server {

struct JobInput {
  std::vector<int32_t> prompt;
  GenerateOptions options;  // sampling, prefill chunk, stop ids
  int64_t max_tokens = 0;
  std::vector<std::string> stop;
  std::chrono::steady_clock::time_point deadline;
};

struct JobOutput {
  std::string text;  // new text since the last take()
  bool done = false;
  std::string finish_reason;  // "stop" or "length" when done without error
  int error_status = 0;       // when done with an error
  std::string error;
  int64_t completion_tokens = 0, cached_tokens = 0;
};

class Job {
 public:
  explicit Job(JobInput input) : input_(std::move(input)) {}
  const JobInput& input() const { return input_; }

  // Scheduler side.
  void set_cached_tokens(int64_t tokens);
  void append(const std::string& text, int64_t tokens);
  void finish(const std::string& reason);
  void fail(int status, const std::string& message);

  // Handler side: waits up to `timeout` for news, then returns the text since the last call and the current state.
  JobOutput take(std::chrono::milliseconds timeout);
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }

 private:
  const JobInput input_;
  std::mutex mutex_;
  std::condition_variable changed_;
  JobOutput output_;
  std::atomic<bool> cancelled_{false};
};

}  // namespace vavilov::server
