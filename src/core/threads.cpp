#include "core/threads.h"

#include <immintrin.h>

#include <algorithm>
#include <memory>

namespace vavilov {

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < std::max(threads, 1); ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

namespace {

// Spins until `ready` holds or about 50 µs have passed; returns whether it holds.
template <typename Ready>
bool spin_until(const Ready& ready) {
  for (int i = 0; i < 20000; ++i) {
    if (ready()) return true;
    _mm_pause();
  }
  return ready();
}

}  // namespace

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
    pending_.store(int(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  body(0, std::min(chunk, n));
  if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
  }
}

void ThreadPool::worker_loop(int index) {
  size_t seen = 0;
  for (;;) {
    auto has_work = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_until(has_work)) {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, has_work);
    }
    if (stop_) return;
    const std::function<void(size_t, size_t)>* body;
    size_t begin, end;
    {
      std::lock_guard lock(mutex_);
      seen = generation_.load(std::memory_order_acquire);
      body = body_;
      begin = std::min(n_, chunk_ * size_t(index));
      end = std::min(n_, begin + chunk_);
    }
    if (begin < end) (*body)(begin, end);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mutex_);
      done_.notify_one();
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
