// thread_pool.h's loop: the protocol between the caller and the workers.
//
// A loop is published by bumping `gen_` to an odd value (open); the caller works, then bumps it to even
// (closed) and waits until no worker is inside. A worker enters by raising its own `inside_` flag and then
// checking that the loop it saw is still open (both sequentially consistent: either the caller's wait sees
// the flag, or the worker sees the loop closed and leaves without touching it). So the loop's description
// (parts, body) is only read while its caller is still waiting, and a late worker costs the caller nothing.
//
// What a loop costs besides its units grows with the threads, and a decode step has ~300 loops: on 16 cores
// the default model's 120 linears took ~20 us a call whatever their bytes (docs/performance.md, issue 54's
// sixteenth pass). So the end of a loop touches shared lines with plain loads where it can: a locked
// read-modify-write is a full barrier, and a thread's sweep over the others' parts, or the workers leaving
// through one shared counter, made one cross-core round trip after another, where loads of many lines
// overlap. A part is claimed only while a load of its cursor shows units left (the cursor only grows, so a
// part seen done is done); each worker's flag is a line of its own, which only it writes.

#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

namespace {

// A spinning thread's pause: it yields the core's pipeline to a sibling thread (this file is also built for CPUs
// other than x86, with the other portable kernels: native.py's PORTABLE)
inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

constexpr int kMaxThreads = 64;
// How long a worker spins for the next loop before it sleeps: a step's loops follow each other within a few
// microseconds; between steps the engine's Python runs for ~0.3 ms, and a spinning worker would take a core
// from it and from the HTTP event loop.
constexpr auto kSpin = std::chrono::microseconds(50);

thread_local bool in_loop = false;  // inside a pool loop (worker or caller): nested loops run serially

struct alignas(64) Part {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

class Pool {
 public:
  void run(int64_t n, int64_t chunk, int threads, void (*body)(int64_t, int64_t, const void*), const void* context) {
    grow(threads - 1);
    threads_ = threads, chunk_ = chunk, body_ = body, context_ = context;
    const int64_t each = (n + threads - 1) / threads;
    for (int i = 0; i < threads; ++i) {
      parts_[i].next.store(std::min(n, i * each), std::memory_order_relaxed);
      parts_[i].end = std::min(n, (i + 1) * each);
    }
    const uint32_t open = gen_.load(std::memory_order_relaxed) + 1;
    gen_.store(open, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) gen_.notify_all();
    struct Close {  // also when body throws on this thread
      Pool* pool;
      uint32_t open;
      ~Close() {
        pool->gen_.store(open + 1, std::memory_order_seq_cst);
        for (int w = 1; w <= pool->started_; ++w)
          for (int spins = 0; pool->inside_[w].on.load(std::memory_order_seq_cst); ++spins)
            spins < 4096 ? relax() : std::this_thread::yield();
        pool->busy_.clear(std::memory_order_release);
      }
    } close{this, open};
    work(0);
  }

  bool try_acquire() { return !busy_.test_and_set(std::memory_order_acquire); }

 private:
  // this thread's part first, then what the others have not claimed
  void work(int me) {
    for (int j = 0; j < threads_; ++j) {
      Part& p = parts_[(me + j) % threads_];
      while (p.next.load(std::memory_order_relaxed) < p.end) {
        const int64_t b = p.next.fetch_add(chunk_, std::memory_order_relaxed);
        if (b >= p.end) break;
        body_(b, std::min(p.end, b + chunk_), context_);
      }
    }
  }

  void grow(int workers) {
    for (int w = started_; w < std::min(workers, kMaxThreads - 1); ++w) {
      std::thread([this, me = w + 1] { serve(me); }).detach();  // never joined: the pool lives as long as the process
      started_ = w + 1;
    }
  }

  void serve(int me) {
    in_loop = true;
    uint32_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t g = next_open(seen);
      seen = g;
      inside_[me].on.store(true, std::memory_order_seq_cst);
      if (gen_.load(std::memory_order_seq_cst) == g && me < threads_) work(me);
      inside_[me].on.store(false, std::memory_order_release);
    }
  }

  // the next open loop after `seen`: spin for kSpin, then sleep on gen_
  uint32_t next_open(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int spins = 0;; ++spins) {
      const uint32_t g = gen_.load(std::memory_order_acquire);
      if (g != seen && (g & 1)) return g;
      if (g != seen) seen = g;  // a loop opened and closed meanwhile: wait for the next
      relax();
      if (spins % 64 == 63 && std::chrono::steady_clock::now() > until) break;
    }
    for (;;) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t g = gen_.load(std::memory_order_seq_cst);
      if (g != seen && (g & 1)) {
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        return g;
      }
      gen_.wait(g, std::memory_order_seq_cst);
      sleepers_.fetch_sub(1, std::memory_order_relaxed);
      seen = g;
    }
  }

  struct alignas(64) Flag {
    std::atomic<bool> on{false};
  };
  std::atomic<uint32_t> gen_{0};  // odd: a loop is open
  Flag inside_[kMaxThreads];      // worker w inside a loop (w >= 1: the caller is 0)
  std::atomic<int> sleepers_{0};  // workers asleep on gen_
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  int started_ = 0;  // workers running (written by the caller holding busy_)
  // the open loop (written before gen_ opens it, read by workers inside it)
  Part parts_[kMaxThreads];
  int threads_ = 0;
  int64_t chunk_ = 1;
  void (*body_)(int64_t, int64_t, const void*) = nullptr;
  const void* context_ = nullptr;
};

std::atomic<Pool*> the_pool{nullptr};  // made on first use, never destroyed (its threads run until the process exits)

void forget_in_child() { the_pool.store(nullptr); }  // fork copies no threads: a child starts a pool of its own

Pool* pool() {
  static const bool registered = pthread_atfork(nullptr, nullptr, forget_in_child) == 0;
  (void)registered;
  Pool* p = the_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    Pool* made = new Pool();
    if (the_pool.compare_exchange_strong(p, made, std::memory_order_acq_rel)) return made;
    delete made;  // another thread's came first (no thread started yet: Pool starts them on first use)
  }
  return p;
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

void pool_for(int64_t n, int64_t chunk, int threads, void (*body)(int64_t, int64_t, const void*), const void* context) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  threads = static_cast<int>(std::min<int64_t>({threads, kMaxThreads, (n + chunk - 1) / chunk}));
  if (threads <= 1 || in_loop || at::in_parallel_region()) return body(0, n, context);
  Pool* p = pool();
  if (!p->try_acquire()) return body(0, n, context);
  in_loop = true;
  struct Leave {
    ~Leave() { in_loop = false; }
  } leave;
  p->run(n, chunk, threads, body, context);
}

}  // namespace FLAGDEPLOY_OPS_NS
