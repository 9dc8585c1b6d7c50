#include "server/job.h"

namespace vavilov::server {

void Job::set_cached_tokens(int64_t tokens) {
  std::lock_guard lock(mutex_);
  output_.cached_tokens = tokens;
}

void Job::append(const std::string& text, int64_t tokens) {
  {
    std::lock_guard lock(mutex_);
    output_.text += text;
    output_.completion_tokens += tokens;
  }
  if (!text.empty()) changed_.notify_all();
}

void Job::finish(const std::string& reason) {
  {
    std::lock_guard lock(mutex_);
    if (output_.done) return;
    output_.done = true;
    output_.finish_reason = reason;
  }
  changed_.notify_all();
}

void Job::fail(int status, const std::string& message) {
  {
    std::lock_guard lock(mutex_);
    if (output_.done) return;
    output_.done = true;
    output_.error_status = status;
    output_.error = message;
  }
  changed_.notify_all();
}

JobOutput Job::take(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  changed_.wait_for(lock, timeout, [&] { return output_.done || !output_.text.empty(); });
  JobOutput snapshot = output_;
  output_.text.clear();
  return snapshot;
}

}  // namespace vavilov::server
