// A thread pool for the CPU kernels whose caller never waits for a sleeping thread.
//
// at::parallel_for (OpenMP) splits a loop into one range per thread and joins them all:
// a thread that has gone to sleep since the last parallel region must be woken, and the
// region lasts until it has run its share. A single-stream decode step of the default
// model runs ~120 such regions, 10-50 us apart (the Python between two matmuls), and a
// woken thread takes 20-150 us to run on a 2-vCPU VM: with OpenMP's short spin (see
// threads.py) a step took 10-13 ms on a 2-vCPU EPYC, against 6-7 ms with threads
// spinning through the gaps, which on shared cores starves the front end instead.
//
// Here the loop is cut into more chunks than threads, and every thread, the caller
// included, claims chunks from one atomic counter until none are left: a worker that is
// asleep or descheduled when a loop starts leaves its chunks to the others, and one that
// wakes late finds nothing to do. The caller waits only for chunks already claimed.
// Workers spin for a short while after their last chunk (the next loop of a step is
// usually microseconds away), yielding the CPU now and then, then sleep on a futex.
//
// One pool per process: each extension module that includes this header can make one
// (its workers start on first use), and cpu_ext.py hands the first module's to the
// others at load (pool_handle / use_pool), so that no two sets of workers spin against
// each other. The thread count follows torch's (at::get_num_threads), read every loop.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pybind11/pybind11.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <string>
#include <cstdint>
#include <thread>
#include <vector>

namespace sl {

class Pool {
 public:
  using Body = void (*)(const void* ctx, int64_t begin, int64_t end);

  // fn(begin, end) over [0, n) in chunks of at least `grain` items; returns when every
  // chunk has run. fn must not throw. A nested call (from inside a chunk), or one made
  // while another thread's loop runs, runs inline on its caller.
  // The bytes that the caller's next loop will read (a weight matrix), for the workers
  // to pull into their caches while the caller runs what comes between two loops (the
  // Python of a decode step: ~25% of a 2-thread step, during which the weights would
  // otherwise wait in memory; the matmuls stream them at near the memory bandwidth).
  // Taken by each worker after its chunks of the next loop started (a hint set before
  // run() is seen after that loop).
  void prefetch_next(const void* p, int64_t bytes) {
    hint_bytes_.store(bytes, std::memory_order_relaxed);
    hint_.store(p, std::memory_order_relaxed);
    hint_serial_.fetch_add(1, std::memory_order_release);
  }

  template <class F>
  void run(int64_t n, int64_t grain, const F& fn) {
    if (n <= 0) return;
    const int threads = std::max(1, at::get_num_threads());
    grain = std::max<int64_t>(grain, 1);
    bool idle = false;
    if (threads == 1 || n <= grain || in_chunk_ || !busy_.compare_exchange_strong(idle, true)) {
      fn(int64_t{0}, n);  // one thread, little work, nested, or another thread's loop running
      return;
    }
    ensure_workers(threads - 1);
    // a few chunks per thread: a thread that starts late (or is preempted) leaves the
    // rest of the loop to the others
    const int64_t chunk = std::max(grain, (n + kChunksPerThread * threads - 1) / (kChunksPerThread * threads));
    const int64_t nchunks = (n + chunk - 1) / chunk;
    gen_++;
    Job& job = jobs_[gen_ & 1];  // not the last job's slot: a late reader of that one is safe
    job.body.store(&trampoline<F>, std::memory_order_relaxed);
    job.ctx.store(&fn, std::memory_order_relaxed);
    job.n.store(n, std::memory_order_relaxed);
    job.chunk.store(chunk, std::memory_order_relaxed);
    job.nchunks.store(nchunks, std::memory_order_relaxed);
    job.workers.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(gen_) << 32, std::memory_order_seq_cst);  // publishes the job
    epoch_.store(gen_, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(&epoch_, FUTEX_WAKE_PRIVATE, INT_MAX);
    in_chunk_ = true;
    work(gen_, -1);
    in_chunk_ = false;
    for (int spins = 0; done_.load(std::memory_order_acquire) < nchunks; spins++) {  // chunks others hold
      _mm_pause();
      if (spins % 64 == 63) sched_yield();
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  static constexpr int kChunksPerThread = 4;
  static constexpr auto kSpin = std::chrono::microseconds(100);  // a worker's spin before it sleeps
  static constexpr int64_t kPrefetchStep = 4096;  // bytes prefetched between checks for a new loop

  struct Job {  // written only while no chunk of it can be claimed (see run)
    std::atomic<Body> body{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int64_t> n{0}, chunk{0}, nchunks{0};
    std::atomic<int> workers{0};  // workers that may take part (torch's threads - 1)
  };

  template <class F>
  static void trampoline(const void* ctx, int64_t begin, int64_t end) {
    (*static_cast<const F*>(ctx))(begin, end);
  }

  static long futex(std::atomic<uint32_t>* addr, int op, uint32_t val) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, nullptr, nullptr, 0);
  }

  // claims and runs chunks of job `gen` (as worker `index`, -1: the caller) until none is
  // left or the job is no longer current. A claim is a CAS on state_ = gen << 32 | next
  // chunk, so it succeeds only while `gen` is current; the job's slot, read after state_
  // showed `gen`, is rewritten only for job gen + 2, after gen + 1 has replaced it there
  // (values read then are never used: the claim fails).
  void work(uint32_t gen, int index) {
    uint64_t s = state_.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(s >> 32) != gen) return;
    const Job& job = jobs_[gen & 1];
    if (index >= job.workers.load(std::memory_order_relaxed)) return;  // more workers than torch's threads now
    const Body body = job.body.load(std::memory_order_relaxed);
    const void* ctx = job.ctx.load(std::memory_order_relaxed);
    const int64_t n = job.n.load(std::memory_order_relaxed);
    const int64_t chunk = job.chunk.load(std::memory_order_relaxed);
    const int64_t nchunks = job.nchunks.load(std::memory_order_relaxed);
    while (static_cast<uint32_t>(s >> 32) == gen && static_cast<int64_t>(s & 0xFFFFFFFFu) < nchunks) {
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      const int64_t c = static_cast<int64_t>(s & 0xFFFFFFFFu);
      body(ctx, c * chunk, std::min(n, (c + 1) * chunk));
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }

  void worker_loop(int index) {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      uint32_t now = seen;
      for (int spins = 0; (now = epoch_.load(std::memory_order_acquire)) == seen; spins++) {
        _mm_pause();
        if (spins % 64 == 63) {
          if (std::chrono::steady_clock::now() > until) break;
          // now and then the CPU goes to whoever else wants it (the front end, or the
          // thread we wait for, placed on this CPU). Not at every poll: a yield per
          // microsecond kept the caller and the worker on one CPU, and a matmul of one
          // row ran no faster on two threads than on one (66 against 67 us, against 35
          // us with this rarer yield)
          if (spins % 1024 == 1023) sched_yield();
        }
      }
      if (now == seen) {  // nothing within the spin: sleep until the next loop
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (epoch_.load(std::memory_order_seq_cst) == seen) futex(&epoch_, FUTEX_WAIT_PRIVATE, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      seen = now;
      in_chunk_ = true;
      work(now, index);
      in_chunk_ = false;
      prefetch_hinted(now, index);
    }
  }

  // Until loop `gen` is followed by another, prefetches this worker's share of the
  // hinted bytes (see prefetch_next), from where its last pass over the same hint
  // stopped: lines are fetched once per hint, not again after every loop between two
  // matmuls (a mixture-of-experts layer's expert loops stream weights of their own). A
  // prefetch never faults, so a stale hint (its memory freed since) costs only the lines.
  void prefetch_hinted(uint32_t gen, int index) {
    const uint64_t serial = hint_serial_.load(std::memory_order_acquire);
    const char* p = static_cast<const char*>(hint_.load(std::memory_order_relaxed));
    const int64_t bytes = hint_bytes_.load(std::memory_order_relaxed);
    const int workers = workers_count_.load(std::memory_order_relaxed);
    if (p == nullptr || bytes <= 0 || index >= workers) return;
    if (serial != done_serial_) done_serial_ = serial, done_offset_ = 0;  // a new hint
    const int64_t begin = bytes * index / workers, end = bytes * (index + 1) / workers;
    for (int64_t off = begin + done_offset_; off < end; off += kPrefetchStep) {
      if (epoch_.load(std::memory_order_relaxed) != gen) return;  // the next loop is here
      for (int64_t i = off; i < std::min(end, off + kPrefetchStep); i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
      done_offset_ = off + kPrefetchStep - begin;
    }
  }

  void ensure_workers(int count) {
    // grows only: extra workers of a smaller setting just find fewer chunks
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { worker_loop(index); });
      workers_.back().detach();
      workers_count_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    }
  }

  Job jobs_[2];
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> busy_{false};  // a loop is running (one caller at a time)
  uint32_t gen_ = 0;  // the caller's
  std::vector<std::thread> workers_;
  std::atomic<int> workers_count_{0};  // workers_.size(), for the workers to read
  std::atomic<const void*> hint_{nullptr};  // prefetch_next's
  std::atomic<int64_t> hint_bytes_{0};
  std::atomic<uint64_t> hint_serial_{0};  // one more at every prefetch_next
  // a worker's progress through the hint numbered done_serial_ (its own)
  static inline thread_local uint64_t done_serial_ = 0;
  static inline thread_local int64_t done_offset_ = 0;
  static inline thread_local bool in_chunk_ = false;
};

namespace {  // this module's own (internal linkage: not merged with other modules')
Pool* g_pool = nullptr;
}  // namespace

// the pool this module runs on: the one handed over by use_pool, else its own (never
// destroyed: workers may outlive static destructors)
inline Pool& pool() {
  if (g_pool == nullptr) g_pool = new Pool();
  return *g_pool;
}

// For the module's Python side: its pool as a capsule, and running on another module's.
// use_pool must come before this module's first loop (cpu_ext.py calls it at load).
inline pybind11::capsule pool_handle() { return pybind11::capsule(static_cast<void*>(&pool()), "structllm.pool"); }
inline void use_pool(const pybind11::capsule& handle) {
  TORCH_CHECK(std::string(handle.name()) == "structllm.pool", "use_pool: not a structllm pool handle");
  g_pool = static_cast<Pool*>(handle.get_pointer());
}

// at::parallel_for's contract (fn(begin, end) over [begin, end), chunks >= grain) on the pool
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  pool().run(end - begin, grain, [&](int64_t b, int64_t e) { fn(begin + b, begin + e); });
}

}  // namespace sl
