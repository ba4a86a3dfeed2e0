// Units of a kernel split over the threads as at::parallel_for splits them, except that a thread that is
// done takes the unclaimed chunks of another thread's part.
//
// at::parallel_for gives each thread one equal, fixed part. On the two cores of a small server the parts do
// not take equal times: a decode batch's rows have different context lengths (attention), and the HTTP event
// loop or a page fault takes one core for a while in the middle of a kernel; the other thread then spins at
// the region's end (perf: a fifth of a 16-row decode step). Here each thread claims its own part's chunks in
// order (the same contiguous sweep over memory as a static split, which a 1-row linear, bound by the
// weight's bytes, needs: handing out chunks round-robin made it a quarter slower), then helps with what is
// left of the others'. Each unit is computed by the same loops wherever it runs: the same bits as a static
// split.

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// body(begin, end) over [0, n) in chunks of at most `chunk` units, never across two threads' parts;
// serially where one thread is all there is, the range is one chunk, or the caller is already inside a
// parallel region
template <typename F>
void dynamic_for(int64_t n, int64_t chunk, const F& body) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk));
  if (n <= 0) return;
  if (threads <= 1 || at::in_parallel_region()) return body(0, n);
  struct alignas(64) Part {
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Part> parts(threads);
  const int64_t each = (n + threads - 1) / threads;
  for (int i = 0; i < threads; ++i) {
    parts[i].next.store(std::min(n, i * each), std::memory_order_relaxed);
    parts[i].end = std::min(n, (i + 1) * each);
  }
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    for (int j = 0; j < threads; ++j) {
      Part& p = parts[(me + j) % threads];
      for (int64_t b; (b = p.next.fetch_add(chunk, std::memory_order_relaxed)) < p.end;)
        body(b, std::min(p.end, b + chunk));
    }
  }
}
