#include "core/threads.h"

#include <algorithm>
#include <memory>

namespace vavilov {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < std::max(threads, 1); ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body) {
  if (n == 0) return;
  size_t parts = std::min<size_t>(size(), (n + std::max<size_t>(grain, 1) - 1) / std::max<size_t>(grain, 1));
  if (parts <= 1) {
    body(0, n);
    return;
  }
  size_t chunk = (n + parts - 1) / parts;
  {
    std::lock_guard lock(mutex_);
    body_ = &body;
    n_ = n;
    chunk_ = chunk;
    pending_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  body(0, std::min(chunk, n));
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  body_ = nullptr;
}

void ThreadPool::worker_loop(int index) {
  size_t seen = 0;
  for (;;) {
    const std::function<void(size_t, size_t)>* body;
    size_t begin, end;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      body = body_;
      begin = std::min(n_, chunk_ * size_t(index));
      end = std::min(n_, begin + chunk_);
    }
    if (begin < end) (*body)(begin, end);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

namespace {
int requested_threads = 0;
}

void set_thread_count(int threads) { requested_threads = threads; }

ThreadPool& thread_pool() {
  static ThreadPool pool(requested_threads > 0 ? requested_threads
                                               : int(std::max(1u, std::thread::hardware_concurrency())));
  return pool;
}

}  // namespace vavilov
