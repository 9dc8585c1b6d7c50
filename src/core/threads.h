#pragma once
// A fixed pool of worker threads and a blocking parallel_for over an index range.
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace vavilov {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return int(workers_.size()) + 1; }

  // Splits [0, n) into contiguous chunks of at least `grain` and runs body(begin, end) on them,
  // the calling thread included; returns when all are done.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body);

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(size_t, size_t)>* body_ = nullptr;
  size_t n_ = 0, chunk_ = 0;
  // Workers and the caller spin briefly on these before sleeping: a decode step issues hundreds of small parallel
  // loops, and waking a sleeping thread costs more than many of them take.
  std::atomic<size_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

// The process-wide pool; its size is set once (0 = all hardware threads).
ThreadPool& thread_pool();
void set_thread_count(int threads);

inline void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& body) {
  thread_pool().parallel_for(n, grain, body);
}

}  // namespace vavilov
