// The kernels' own worker threads: a parallel loop whose end does not wait for a thread that never came.
//
// An OpenMP region ends at a barrier every thread of the team must reach. On a small server the cores are
// shared with the HTTP event loop, the client, the engine's Python: when one of them takes a core in the
// middle of a decode step, the OpenMP worker on it is descheduled, and the calling thread, its own part done,
// spins at the barrier until the worker is given the core back, at each of the ~150 regions a step has. Here
// a loop's units are claimed by whoever is running (the caller first, its own part then the others', as
// dynamic_for.h describes) and the loop is done when every unit is: a worker that wakes late finds nothing
// left and goes back to waiting, so the caller goes on at one core's speed rather than none. The default
// model's 1-row C++ decode step on the 2-core AVX-512 EPYC, steps/s, OpenMP / this pool: alone 336 / 386;
// beside another process busy on a whole core 142 / 248, on 30% of one 192 / 247.
//
// One loop runs at a time (a second caller meanwhile, e.g. another Python thread, runs its loop on its own
// thread: the same units, the same bits). Workers spin a short while after a loop (the next one of a step
// comes within microseconds), then sleep until the next.

#pragma once

#include <cstdint>

#include "ops_ns.h"

namespace FLAGDEPLOY_OPS_NS {

// body(begin, end, context) over [0, n) in chunks of at most `chunk`, on up to `threads` threads (the caller
// among them), each unit in exactly one call; returns when all are done. Serial when threads <= 1, when
// the range is one chunk, inside another pool loop or OpenMP region, or when another loop holds the pool.
void pool_for(int64_t n, int64_t chunk, int threads, void (*body)(int64_t, int64_t, const void*), const void* context);

}  // namespace FLAGDEPLOY_OPS_NS
