#include "thread_pool.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace offload_adam {
namespace {

class Pool {
 public:
  void run(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    const int wanted = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), n));
    if (wanted == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job_at_a_time(job_mutex_);
    grow(wanted - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      helpers_ = wanted - 1;
      pending_ = wanted - 1;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void grow(int count) {
    while (static_cast<int>(threads_.size()) < count) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { worker(index); });
      threads_.back().detach();  // the pool lives for the whole process
    }
  }

  void drain() {
    for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      (*fn_)(i);
    }
  }

  void worker(int index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= helpers_) continue;  // this job wants fewer threads
      }
      drain();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int helpers_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
};

Pool* g_pool = new Pool();  // never destroyed: detached workers may outlive static destructors

#if defined(__unix__) || defined(__APPLE__)
// A forked child (a DataLoader worker, say) has none of the parent's threads:
// give it a fresh pool instead of one whose workers do not exist.
const int g_atfork = pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });
#endif

}  // namespace

void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
  g_pool->run(n, num_threads, fn);
}

}  // namespace offload_adam
