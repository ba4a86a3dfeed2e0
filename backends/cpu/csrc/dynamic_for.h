// Units of a kernel split over the threads in equal contiguous parts, as at::parallel_for splits them, except
// that a thread that is done takes the unclaimed chunks of another thread's part, and that the loop runs on
// the kernels' own threads (thread_pool.h), so its end waits for no thread that never started.
//
// The parts do not take equal times on the two cores of a small server: a decode batch's rows have different
// context lengths (attention), and the HTTP event loop or a page fault takes one core for a while in the
// middle of a kernel. Each thread claims its own part's chunks in order (the same contiguous sweep over
// memory as a static split, which a 1-row linear, bound by the weight's bytes, needs: handing out chunks
// round-robin made it a quarter slower), then helps with what is left of the others'. Each unit is computed
// by the same loops wherever it runs: the same bits as a static split, or as one thread.

#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "thread_pool.h"

// body(begin, end) over [0, n) in chunks of at most `chunk` units, never across two threads' parts, on the
// kernels' own threads (thread_pool.h); serially where one thread is all there is, the range is one chunk,
// or the caller is already inside a parallel loop
template <typename F>
void dynamic_for(int64_t n, int64_t chunk, const F& body) {
  FLAGDEPLOY_OPS_NS::pool_for(n, chunk, at::get_num_threads(),
                              [](int64_t b, int64_t e, const void* f) { (*static_cast<const F*>(f))(b, e); }, &body);
}
