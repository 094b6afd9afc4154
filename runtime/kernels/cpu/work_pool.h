// Work sharing for the CPU kernels (gguf_cpu.cpp, fused_layer.cpp): the calling thread and
// helper threads claim chunks [0, n) of a job from one shared counter.
//
// Why not OpenMP (at::parallel_for): its static split makes the caller wait at the join for
// every thread's whole share. On a 2-core server the HTTP event loop and the clients are
// runnable too; when the OS deschedules one OpenMP thread for a few ms, the other spins at
// the barrier, and a batch-1 decode step served over HTTP ran at half its in-process speed
// (docs/benchmarks.md). Here the caller never waits for a helper to arrive, only for chunks
// a helper has already claimed, so a descheduled helper costs at most one small chunk.
//
// A job is identified by a generation in the high 32 bits of the claim counter; a helper
// executes chunk i only after a successful compare-and-swap of (generation, i), so a helper
// that wakes late never runs a chunk of a job that has been retired. Idle helpers spin for
// a while (steps issue a job every few microseconds), then sleep on an atomic wait.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sparkgate {

class WorkPool {
 public:
  static WorkPool& instance() {
    static WorkPool pool;
    return pool;
  }

  // Total threads including the caller (>= 1). Changing it joins and restarts the helpers.
  void set_threads(int n) {
    std::lock_guard<std::mutex> lock(run_mutex_);
    n = n < 1 ? 1 : n;
    if (n == threads_) return;
    stop_helpers();
    threads_ = n;
    stop_.store(false);
    for (int i = 1; i < n; ++i) helpers_.emplace_back([this] { helper_loop(); });
  }

  int threads() const { return threads_; }

  // Run f(i) for every i in [0, n), on the caller and the helpers; returns when all are done.
  // f must not throw (check arguments before calling run) nor call run itself. Calls from
  // several threads are serialised (the engine makes them from one thread).
  void run(int64_t n, const std::function<void(int64_t)>& f) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> lock(run_mutex_);
    if (threads_ == 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    fn_ = &f;
    n_ = n;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++gen_;
    claim_.store(gen << 32);  // publishes fn_, n_ (seq_cst: pairs with the sleeper check below)
    if (sleepers_.load() > 0) {
      wake_.fetch_add(1, std::memory_order_release);
      wake_.notify_all();
    }
    work(gen);
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();  // a helper holding a chunk may need this core
    }
  }

  ~WorkPool() { stop_helpers(); }

 private:
  WorkPool() {
    cpu_set_t set;
    int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    set_threads(cpus);
  }

  // Claim and run chunks of job `gen` until none is left.
  void work(uint64_t gen) {
    const std::function<void(int64_t)>* f = fn_;
    const int64_t n = n_;
    uint64_t cur = claim_.load(std::memory_order_acquire);
    while ((cur >> 32) == gen && static_cast<int64_t>(cur & 0xffffffffu) < n) {
      if (claim_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) {
        (*f)(static_cast<int64_t>(cur & 0xffffffffu));
        done_.fetch_add(1, std::memory_order_acq_rel);
        cur = claim_.load(std::memory_order_acquire);
      }
    }
  }

  void helper_loop() {
    uint64_t seen = claim_.load(std::memory_order_acquire) >> 32;
    while (!stop_.load(std::memory_order_acquire)) {
      uint64_t gen = claim_.load(std::memory_order_acquire) >> 32;
      for (int spins = 0; gen == seen && spins < kSpins && !stop_.load(std::memory_order_relaxed); ++spins) {
        _mm_pause();
        gen = claim_.load(std::memory_order_acquire) >> 32;
      }
      if (gen == seen) {  // idle for a while: sleep until the next job (or stop)
        const uint32_t w = wake_.load(std::memory_order_acquire);
        sleepers_.fetch_add(1);  // seq_cst, then re-check: either run() sees us or we see its job
        if ((claim_.load() >> 32) == seen && !stop_.load()) wake_.wait(w);
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        continue;
      }
      seen = gen;
      work(gen);
    }
  }

  void stop_helpers() {
    stop_.store(true);
    wake_.fetch_add(1);
    wake_.notify_all();
    for (auto& t : helpers_) t.join();
    helpers_.clear();
  }

  static constexpr int kSpins = 200000;  // ~0.1-1 ms of pause loops before sleeping

  int threads_ = 1;
  std::mutex run_mutex_;
  std::vector<std::thread> helpers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  uint64_t gen_ = 0;
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace sparkgate
