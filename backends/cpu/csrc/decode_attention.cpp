// Decode attention over paged caches, one (query row, query head) at a time: the eager decode step's
// attention on the CPU.
//
// torch's fused SDPA costs ~200 us per call at a few hundred keys for SmolLM2's 9 heads (mostly fixed
// cost), and a speculative verify step needs one call per row, because a masked batched call rounds
// differently from a lone row's unmasked one. Here every (row, query head) pair is computed by the same
// loops in the same order whatever else is in the call, so a row's result is bitwise the same alone, in a
// batch, or as one of a verify step's rows, and one call serves them all.
//
// Per (row, query head): scores s_t = scale * q . k_t in float32 (fixed_sum.h's order: the same on every
// build), a float32 softmax (its sum in fixed_sum's order too), and out = sum_t p_t v_t accumulated in float32
// in key order. Rows that read the same keys (a speculative verify step's rows: one sequence at consecutive
// lengths; a lone row; a prompt's rows, lengths 1 to n) go through attend_rows: one pass over the keys and one over
// the values for all their query heads, each key and value widened once for all of them, the heads' and rows'
// chains side by side, each key scored only for the rows that read it. The same arithmetic per (row, query head),
// so the same bits either way.
//   q [R, H, D] float32 or bf16; k_cache, v_cache [blocks, block_size, KH, D] float32 or bf16 (the same);
//   block_tables [R, W] int64 (row r's keys are positions 0..context_lens[r]-1 through its table);
//   out [R, H, D] in q's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

#include "bf16.h"
#include "dynamic_for.h"
#include "exp_nonpositive.h"
#include "fixed_sum.h"
#include "static_count.h"

#include "kernels.h"

namespace {

#if defined(__AVX512F__)  // bf16.h has included immintrin.h

// The scores of `count` (at most 16) keys from their 16 partial sums each (`p`, fixed_dot's lanes: fused
// multiply-adds in element order, see dots16_n), each fixed_dot(q, key, D) bit for bit: the keys' folds by
// halves run together, two to eight keys per vector, through shuffles that add exactly the lanes
// fixed_dot's fold adds. One key at a time, the fold was a chain of 15 dependent scalar adds per key and
// query head, the larger part of a decode step's attention.
inline void fold16(const __m512* p, int64_t count, float* out) {
  __m512 a[8], b[4], c[2];
  for (int m = 0; m < 8; ++m)  // lanes j + (j + 8): a[m] = keys 2m, 2m+1 in 8 lanes each
    a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // lanes j + (j + 4): b[m] = keys 4m .. 4m+3 in 4 lanes each
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // lanes j + (j + 2): in 128-bit chunk k of c[m], keys 8m + k and 8m + 4 + k
    c[m] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0x44), _mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0xEE));
  // lanes 0 + 1: lane 4k + e holds key 4e + k, put in key order (a run of 16 keys: one store)
  const __m512 keyed = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                             _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)));
  if (count == 16) return _mm512_storeu_ps(out, keyed);
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << count) - 1), keyed);
}

// The scores of N queries (q[n]: D floats) against the same `count` keys at once, each key read and widened
// once for all N, the queries' chains of fused multiply-adds side by side; per query fixed_dot's partial sums
// in its order, so the same bits as one query at a time. out[n][t]: key t's score for query n.
template <typename T, int D, int N>
inline void dots16_n(const float* const* q, const T* keys, int64_t stride, int64_t count, float* const* out) {
  constexpr bool held = N * D / 16 <= 16;  // the queries in registers for all the keys where they fit
  __m512 qv[held ? N : 1][held ? D / 16 : 1];
  if constexpr (held)
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < D / 16; ++i) qv[n][i] = _mm512_loadu_ps(q[n] + 16 * i);
  __m512 p[N][16];
  for (int t = 0; t < 16; ++t) {
    __m512 acc[N];
    for (int n = 0; n < N; ++n) acc[n] = _mm512_setzero_ps();
    if (t < count)
      for (int i = 0; i < D; i += 16) {
        const __m512 key = load16(keys + t * stride + i);
        for (int n = 0; n < N; ++n)
          acc[n] = _mm512_fmadd_ps(held ? qv[n][held ? i / 16 : 0] : _mm512_loadu_ps(q[n] + i), key, acc[n]);
      }
    for (int n = 0; n < N; ++n) p[n][t] = acc[n];
  }
  for (int n = 0; n < N; ++n) fold16(p[n], count, out[n]);
}

template <typename T, int D>
inline void dots16(const float* q, const T* keys, int64_t stride, int64_t count, float* out) {
  dots16_n<T, D, 1>(&q, keys, stride, count, &out);
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

// The AVX2 form of fold16: the scores of `count` (at most 8) keys from their partial sums, lanes j and j + 8
// of fixed_dot already added (p[t], 8 lanes), each fixed_dot(q, key, D) bit for bit: the keys' remaining
// folds (j + 4, j + 2, j + 1) run together through shuffles that add exactly the lanes fixed_dot's fold adds,
// where one key at a time it was a chain of dependent scalar adds per key and query head: one thread, SmolLM2's
// 9 heads over 256 bf16 keys, 41 -> 31 us a row, 5 rows 195 -> 139 us (the AVX-512 build: 24, 71), bitwise equal.
inline void fold8(const __m256* p, int64_t count, float* out) {
  __m256 a[4], b[2];
  for (int m = 0; m < 4; ++m)  // lanes j + (j + 4): a[m] = key 2m in its low 128 bits, key 2m + 1 in its high
    a[m] = _mm256_add_ps(_mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // lanes j + (j + 2): low 128 bits keys 4m, 4m + 2; high keys 4m + 1, 4m + 3
    b[m] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * m], a[2 * m + 1], 0x44), _mm256_shuffle_ps(a[2 * m], a[2 * m + 1], 0xEE));
  // lanes 0 + 1: lane (t % 2) * 4 + t / 2 holds key t, put in key order (a run of 8 keys: one store)
  const __m256 keyed = _mm256_permutevar8x32_ps(_mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD)),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (count == 8) return _mm256_storeu_ps(out, keyed);
  alignas(32) float r[8];
  _mm256_store_ps(r, keyed);
  std::copy(r, r + count, out);
}

// fixed_dot(q[n], key, D) of N queries and up to 8 keys: per query and key its 16 partial sums as two vectors,
// fused multiply-adds in element order (element i into lane i % 16), then fold8; each key widened once for
// all N queries, their chains side by side
template <typename T, int D, int N>
inline void dots8_n(const float* const* q, const T* keys, int64_t stride, int64_t count, float* const* out) {
  __m256 p[N][8];
  for (int t = 0; t < 8; ++t) {
    __m256 lo[N], hi[N];
    for (int n = 0; n < N; ++n) lo[n] = hi[n] = _mm256_setzero_ps();
    if (t < count)
      for (int i = 0; i < D; i += 16) {
        const __m256 k0 = load8(keys + t * stride + i), k1 = load8(keys + t * stride + i + 8);
        for (int n = 0; n < N; ++n) {
          lo[n] = _mm256_fmadd_ps(_mm256_loadu_ps(q[n] + i), k0, lo[n]);
          hi[n] = _mm256_fmadd_ps(_mm256_loadu_ps(q[n] + i + 8), k1, hi[n]);
        }
      }
    for (int n = 0; n < N; ++n) p[n][t] = _mm256_add_ps(lo[n], hi[n]);  // fixed_dot's first fold: lanes j + (j + 8)
  }
  for (int n = 0; n < N; ++n) fold8(p[n], count, out[n]);
}

template <typename T, int D>
inline void dots8(const float* q, const T* keys, int64_t stride, int64_t count, float* out) {
  dots8_n<T, D, 1>(&q, keys, stride, count, &out);
}
#endif

// s[0, n) = softmax(scale * s) in place: every unit's the same arithmetic on every build (the maximum is exact in
// any order; fixed_sum's order)
inline void softmax(float* s, int64_t n, float scale) {
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] *= scale;
  float part[kLanes], m = -INFINITY;  // the maximum in lanes (a running one was a chain of dependent compares)
  std::fill(part, part + kLanes, -INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] = std::max(part[j], s[t + j]);
  }
  for (; t < n; ++t) m = std::max(m, s[t]);
  for (int j = 0; j < kLanes; ++j) m = std::max(m, part[j]);
#pragma omp simd
  for (t = 0; t < n; ++t) s[t] = exp_nonpositive(s[t] - m);
  const float inv = 1.f / fixed_sum(s, n);
#pragma omp simd
  for (t = 0; t < n; ++t) s[t] *= inv;
}

// Asks for a block's keys and values of one key head (`width` values of each of its first `slots` slots, `stride`
// values apart), two blocks before the pass over the keys reaches it: the values pass follows that one over the
// same blocks. The blocks lie wherever the table puts them, so the hardware prefetcher's streams end at each
// block, and a decode step's caches, 30 layers' worth, come from L3 or memory. Where a unit has few query heads
// (a lone row, a stream of a decode batch): more hide the memory behind their arithmetic. No value changes.
// A step's 30 layers, separate processes on the 2-core Xeon, ms: 16 streams of ~250 keys 13.5-13.9 -> 7.4-8.2
// (AVX-512 build), 16.6-18.1 -> 8.9-9.1 (AVX2); a lone row 0.80-0.87 -> 0.62-0.64 (with kAlone's split; AVX2 0.87-0.90
// -> 0.62-0.67); a verify step's 5 and 16 rows as before. (Asked for inside weighted_values instead, the prefetch
// made GCC spill the 24 sums of weighted_values<24, 1> to the stack even where it was compiled out: 16 rows 1.2x.
// Its two call sites, attend_rows and attend's per-head loop, each work out block b + 2 themselves: folded into one
// helper with the check inside, GCC 12 dropped every prefetch of both loops, 16 streams 1.9x slower;
// tests/test_ops.py checks that the built library still has them.)
template <typename T>
inline void prefetch_block(const T* keys, const T* values, int64_t slots, int64_t stride, int64_t width) {
  for (int64_t j = 0; j < slots; ++j)
    for (int64_t at = 0; at < width * static_cast<int64_t>(sizeof(T)); at += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(keys + j * stride) + at, 0, 3);
      __builtin_prefetch(reinterpret_cast<const char*>(values + j * stride) + at, 0, 3);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ATTEND_ROWS 1
// One vector of float32 lanes of the build's ISA: what attend_rows is written in.
#if defined(__AVX512F__)
using vec = __m512;
constexpr int kWidth = 16, kSums = 24;  // kSums: accumulators a pass over the values keeps in registers (32 zmm)
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
template <typename T> inline vec vload(const T* x) { return load16(x); }
template <typename T, int D, int N>
inline void dots_n(const float* const* q, const T* keys, int64_t stride, int64_t count, float* const* out) {
  dots16_n<T, D, N>(q, keys, stride, count, out);
}
#else
using vec = __m256;
constexpr int kWidth = 8, kSums = 12;  // 16 ymm
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
template <typename T> inline vec vload(const T* x) { return load8(x); }
template <typename T, int D, int N>
inline void dots_n(const float* const* q, const T* keys, int64_t stride, int64_t count, float* const* out) {
  dots8_n<T, D, N>(q, keys, stride, count, out);
}
#endif

constexpr int kQueries = 4;  // queries whose scores attend_rows computes side by side

// What attend_rows keeps per unit of a group (a query head of one of its rows)
struct Unit {
  const float* q;
  float* out;
  float* p;   // the unit's scores, then its probabilities, key by key
  int64_t n;  // its row's keys
};

// Columns [c, c + C * kWidth) of N units' outputs: sum_t p[t] v_t in key order from 0, each unit over its own
// keys (the keys below `shortest` are every unit's), one fused multiply-add a key, as `attend`'s loop does.
// Past kApart units, probs[t * N + i] is unit i's probability of key t, the N units' side by side: one pointer
// for all of them, where N pointers, one a unit, did not fit the general registers and were reloaded key by
// key (5 verify rows, 15 units a key head: 82 -> 76 us on AVX2, 71 -> 62 on AVX-512); up to kApart units
// read their own arrays (copying them side by side cost a lone row 5%).
constexpr int kApart = 4;
template <int N, int C, typename T>
void weighted_values(const Unit* u, const float* probs, const T* v_cache, const int64_t* table, int64_t block_size,
                     int64_t stride, int64_t longest, int64_t shortest, int64_t c) {
  vec acc[N][C];  // unrolled throughout: in registers
#pragma GCC unroll 32
  for (int i = 0; i < N; ++i)
#pragma GCC unroll 32
    for (int k = 0; k < C; ++k) acc[i][k] = vzero();
  for (int64_t t0 = 0, b = 0; t0 < longest; t0 += block_size, ++b) {
    const T* values = v_cache + table[b] * block_size * stride + c;
    for (int64_t j = 0, end = std::min(block_size, longest - t0); j < end; ++j) {
      const int64_t t = t0 + j;
      const float* p = N > kApart ? probs + t * N : nullptr;
      vec v[C];
#pragma GCC unroll 32
      for (int k = 0; k < C; ++k) v[k] = vload(values + j * stride + kWidth * k);
      const bool all = t < shortest;
#pragma GCC unroll 32
      for (int i = 0; i < N; ++i) {
        if (!all && t >= u[i].n) continue;
        const vec w = vset1(N > kApart ? p[i] : u[i].p[t]);
#pragma GCC unroll 32
        for (int k = 0; k < C; ++k) acc[i][k] = vfma(w, v[k], acc[i][k]);
      }
    }
  }
  for (int i = 0; i < N; ++i)
    for (int k = 0; k < C; ++k) vstore(u[i].out + c + kWidth * k, acc[i][k]);
}

// Column vectors a pass over the values takes: the most, up to `most`, that divide the head's `vecs` evenly (a
// pass of a count that did not, 3 of AVX2's 8 for a 64-wide head, ran past the head's columns)
constexpr int columns(int vecs, int most) {
  for (int c = std::min(vecs, most); c > 1; --c)
    if (vecs % c == 0) return c;
  return 1;
}

// The values of N units with their accumulators in registers: as many column vectors at once as kSums allows.
// probs: room for `longest` x N floats (weighted_values).
template <int N, typename T, int D>
void weighted_values_of(const Unit* u, float* probs, const T* v_cache, const int64_t* table, int64_t block_size,
                        int64_t stride, int64_t longest, int64_t shortest) {
  if constexpr (N > kApart)
    for (int64_t t = 0; t < longest; ++t)
      for (int i = 0; i < N; ++i) probs[t * N + i] = t < u[i].n ? u[i].p[t] : 0.f;
  constexpr int C = columns(D / kWidth, kSums / N);
  for (int64_t c = 0; c < D; c += C * kWidth)
    weighted_values<N, C, T>(u, probs, v_cache, table, block_size, stride, longest, shortest, c);
}

// Scratch of one thread for attend_rows: a run of keys widened to float32, the units' scores, their
// probabilities side by side (weighted_values)
struct Scratch {
  std::vector<float> keys, scores, probs;
  std::vector<Unit> units;
  std::vector<int64_t> live;  // the units a run of keys is scored for
};

// Key head kh of rows that read the same keys through `table` (rows [0, rows) of q, lens, out: a verify step's
// rows of one sequence at consecutive lengths, or a lone row) in one pass over the keys and one over the values
// for all their query heads, where a (row, query head) at a time read and widened each key and value once per
// head and row. Per unit the arithmetic of `attend`'s loop, in its order (fixed_dot's scores, the softmax, the
// sums of values in key order): each row's result is the same bits alone, in a group or per head.
template <typename T, int D>
void attend_rows(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, const int64_t* lens,
                 int64_t rows, int64_t heads, int64_t kv_heads, int64_t kh, int64_t block_size, float scale,
                 Scratch& sc, float* out) {
  const int64_t group = heads / kv_heads, stride = kv_heads * D, count = rows * group;
  const int64_t longest = *std::max_element(lens, lens + rows);
  sc.keys.resize(kWidth * D);
  sc.scores.resize(count * longest);
  sc.units.resize(count);
  Unit* u = sc.units.data();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t at = (i / group * heads + kh * group + i % group) * D;
    u[i] = {q + at, out + at, sc.scores.data() + i * longest, lens[i / group]};
  }
  for (int64_t t0 = 0, b = 0; t0 < longest; t0 += block_size, ++b) {
    const T* keys = k_cache + (table[b] * block_size * kv_heads + kh) * D;
    if (count <= kQueries && t0 + 2 * block_size < longest) {
      const int64_t ahead = (table[b + 2] * block_size * kv_heads + kh) * D;
      prefetch_block(k_cache + ahead, v_cache + ahead, std::min(block_size, longest - t0 - 2 * block_size), stride, D);
    }
    for (int64_t j = 0, end = std::min(block_size, longest - t0); j < end; j += kWidth) {
      const int64_t run = std::min<int64_t>(kWidth, end - j);
      // the scores of the units that read the run's first key (those of the run's keys past a unit's own: not read).
      // A prompt's rows read 1 to n keys: scoring every unit for every key did twice the work.
      std::vector<int64_t>& live = sc.live;
      live.clear();
      for (int64_t i = 0; i < count; ++i)
        if (u[i].n > t0 + j) live.push_back(i);
      const int64_t m = live.size();
      // straight from the cache for one batch of queries, else from the keys widened once for all batches
      const bool widen = m > kQueries;
      if (widen)
        for (int64_t t = 0; t < run; ++t)
          for (int64_t i = 0; i < D; i += kWidth) vstore(sc.keys.data() + t * D + i, vload(keys + (j + t) * stride + i));
      for (int64_t i = 0, left = (m + kQueries - 1) / kQueries; i < m; --left) {  // batches of equal sizes
        const int64_t batch = (m - i) / left;
        const float* qs[kQueries];
        float* outs[kQueries];
        for (int64_t k = 0; k < batch; ++k) qs[k] = u[live[i + k]].q, outs[k] = u[live[i + k]].p + t0 + j;
        with_count<kQueries>(batch, [&](auto n) {
          if (widen)
            dots_n<float, D, n>(qs, sc.keys.data(), D, run, outs);
          else
            dots_n<T, D, n>(qs, keys + j * stride, stride, run, outs);
        });
        i += batch;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) softmax(u[i].p, u[i].n, scale);
  sc.probs.resize(kSums * longest);
  for (int64_t i = 0; i < count; i += kSums)
    with_count<kSums>(std::min<int64_t>(kSums, count - i), [&](auto n) {
      // over the batch's own keys (consecutive units: a prompt's rows of similar lengths), not the longest row's
      int64_t most = 0, least = longest;
      for (int64_t k = i; k < i + n; ++k) most = std::max(most, u[k].n), least = std::min(least, u[k].n);
      weighted_values_of<n, T, D>(u + i, sc.probs.data(), v_cache + kh * D, table, block_size, stride, most, least);
    });
}
#endif

// The most rows of a run that one attend_rows call takes (a prompt's rows: a run of up to prompt_max_keys). Its
// scores are rows x heads a key head x keys floats: a whole 2048-token prompt's, 25 MB a key head, went to memory
// and back three times (scores, softmax, the values' pass), where 16 rows' stay in L2 and each part reads the
// keys and values again from the caches. One layer of a prompt (9 heads over 3, bf16 caches, two threads of the
// 2-core AVX2 EPYC, interleaved), 16-row parts against one part a thread: 256 keys 0.83x, 512 0.70x, 1024 0.66x,
// 2048 0.64x (32-row parts 0.87x, 0.71x, 0.63x, 0.69x). A unit's arithmetic is the same in any part: the same bits.
constexpr int64_t kPieceRows = 16;

// What a (row, query head) costs on its own (reading and widening the keys and values for itself alone) against one
// of attend_rows' units' (which share them): a lone row over 1024 keys on the 2-core Xeon, the AVX-512 build, 11.3 us
// a query head alone, 6.1 in a unit. Where the units are too few to keep the threads busy (a lone row: its key
// heads), attend splits by query heads if that leaves the busiest thread less to do: a lone row's 3 units of 3 query
// heads each go over 2 threads as units (6 units of work for the busier thread, where 5 alone cost 10), over 16 as
// 9 query heads alone (3 against 2).
constexpr int64_t kAlone = 2;

// Runs of rows that read the same keys through attend_rows, unless their units are too few for the threads
// (kAlone); then each (row, query head) on its own, split over the threads evenly however few rows there are
// (a lone row's 9 heads on 16 threads, not its 3 key heads). A unit's loops are the same wherever it runs. D is the
// head width where it is one the build knows (the partial sums then stay in registers), else 0: d at run
// time, the same arithmetic.
template <typename T, int D>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t width,
            float scale, float* out) {
  if constexpr (D > 0) d = D;
  const int64_t group = heads / kv_heads, stride = kv_heads * d;  // stride: one slot's row to the next's
  const int64_t most = rows ? *std::max_element(lens, lens + rows) : 0;
#if ATTEND_ROWS
  // Rows that read the same keys go together with all their query heads (attend_rows), a unit of work being
  // such a run of rows (or a part of it) and one key head, unless too few of them keep the threads busy (kAlone).
  // Rows read the same keys where their tables agree over the blocks either reads (compared with the
  // run's first row, whose table the run reads through).
  if constexpr (D > 0 && D % 16 == 0) {
    std::vector<int64_t> runs{0};  // the runs' first rows, then `rows`
    auto blocks = [&](int64_t n) { return (n + block_size - 1) / block_size; };
    for (int64_t r = 1; r < rows; ++r) {
      const int64_t first = runs.back();
      if (std::memcmp(tables + first * width, tables + r * width,
                      sizeof(int64_t) * blocks(std::max(lens[first], lens[r]))) != 0)
        runs.push_back(r);
    }
    runs.push_back(rows);
    const int64_t n_runs = runs.size() - 1, threads = at::get_num_threads();
    // each run cut into up to `parts` parts (each reads the keys again): two units a thread where it can, and parts
    // of at most kPieceRows rows
    const int64_t parts = std::max<int64_t>(1, (2 * threads + n_runs * kv_heads - 1) / (n_runs * kv_heads));
    struct Piece { int64_t r0, r1, reads; };  // rows [r0, r1), read through row `reads`' table (the run's first)
    std::vector<Piece> pieces;
    for (int64_t i = 0; i < n_runs; ++i) {
      const int64_t n = runs[i + 1] - runs[i], cut = std::min(std::max(parts, (n + kPieceRows - 1) / kPieceRows), n);
      for (int64_t p = 0, r = runs[i]; p < cut; ++p) {
        const int64_t take = (runs[i] + n - r) / (cut - p);
        pieces.push_back({r, r + take, runs[i]});
        r += take;
      }
    }
    // attend_rows where the busiest thread's units cost no more than its share of (row, query head) units alone
    int64_t widest = 0;
    for (const Piece& p : pieces) widest = std::max(widest, p.r1 - p.r0);
    const int64_t units = pieces.size() * kv_heads;
    auto share = [&](int64_t n) { return (n + threads - 1) / threads; };
    if (share(units) * widest * group <= kAlone * share(rows * heads)) {
      dynamic_for(units, 1, [&](int64_t w0, int64_t w1) {
        Scratch sc;
        for (int64_t w = w0; w < w1; ++w) {
          const auto [r0, r1, reads] = pieces[w / kv_heads];
          attend_rows<T, D>(q + r0 * heads * D, k_cache, v_cache, tables + reads * width, lens + r0,
                            r1 - r0, heads, kv_heads, w % kv_heads, block_size, scale, sc, out + r0 * heads * D);
        }
      });
      return;
    }
  }
#endif
  dynamic_for(rows * heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> s(most), acc(D > 0 ? 0 : d);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / heads, kh = p % heads / group, n = lens[r];
      const int64_t* table = tables + r * width;
      const float* qh = q + p * d;
      // keys by the blocks of the row's table: block b holds keys [b * block_size, (b + 1) * block_size)
      for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
        const T* keys = k_cache + (table[b] * block_size * kv_heads + kh) * d;
        const int64_t end = std::min(block_size, n - t0);
        if (t0 + 2 * block_size < n) {
          const int64_t ahead = (table[b + 2] * block_size * kv_heads + kh) * d;
          prefetch_block(k_cache + ahead, v_cache + ahead, std::min(block_size, n - t0 - 2 * block_size), stride, d);
        }
#if defined(__AVX512F__)
        if constexpr (D > 0 && D % 16 == 0) {
          for (int64_t j = 0; j < end; j += 16) dots16<T, D>(qh, keys + j * stride, stride, std::min<int64_t>(16, end - j), &s[t0 + j]);
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (D > 0 && D % 16 == 0) {
          for (int64_t j = 0; j < end; j += 8) dots8<T, D>(qh, keys + j * stride, stride, std::min<int64_t>(8, end - j), &s[t0 + j]);
          continue;
        }
#endif
        for (int64_t j = 0; j < end; ++j) s[t0 + j] = fixed_dot(qh, keys + j * stride, d);
      }
      softmax(s.data(), n, scale);
#if ATTEND_ROWS
      // out = sum_t p_t v_t through attend_rows' pass over the values, as one unit: its sums in registers, where
      // this loop's array went through the stack key by key (a store-to-load chain per key: a lone row over 1024
      // keys took 59 us on one thread, 77 us on two)
      if constexpr (D > 0 && D % 16 == 0) {
        const Unit unit{qh, out + p * d, s.data(), n};
        weighted_values_of<1, T, D>(&unit, nullptr, v_cache + kh * d, table, block_size, stride, n, n);
        continue;
      }
#endif
      // out = sum_t p_t v_t, each value summed in key order from 0, in a local array
      float fixed[D > 0 ? D : 1] = {};
      float* a = D > 0 ? fixed : acc.data();
      if constexpr (D == 0) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
        const T* values = v_cache + (table[b] * block_size * kv_heads + kh) * d;
        for (int64_t j = 0, end = std::min(block_size, n - t0); j < end; ++j) {
          const float w = s[t0 + j];
          const T* v = values + j * stride;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * as_float(v[i]);
        }
      }
      std::copy(a, a + d, out + p * d);
    }
  });
}

template <typename T>
void attend_any(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
                int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t width,
                float scale, float* out) {
  switch (d) {
    case 64: return attend<T, 64>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
    case 128: return attend<T, 128>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
    default: return attend<T, 0>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
  }
}

// A bf16 q over caches of T: q widened to float32 in q32, the sums in out32, rounded to bf16 into out
template <typename T>
void attend_bf16(const uint16_t* q, int64_t rows, int64_t heads, int64_t d, const T* k_cache, const T* v_cache,
                 int64_t kv_heads, int64_t block_size, const int64_t* tables, int64_t width, const int64_t* lens,
                 float scale, float* q32, float* out32, uint16_t* out) {
  const int64_t values = rows * heads * d;
  for (int64_t i = 0; i < values; ++i) q32[i] = as_float(q[i]);
  attend_any(q32, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out32);
  for (int64_t i = 0; i < values; ++i) out[i] = bf16_bits(out32[i]);
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

void paged_decode_attention_rows(const uint16_t* q, int64_t rows, int64_t heads, int64_t d, const uint16_t* k_cache,
                                 const uint16_t* v_cache, int64_t kv_heads, int64_t block_size, const int64_t* tables,
                                 int64_t width, const int64_t* lens, float scale, float* q32, float* out32,
                                 uint16_t* out) {
  attend_bf16(q, rows, heads, d, k_cache, v_cache, kv_heads, block_size, tables, width, lens, scale, q32, out32, out);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && block_tables.dim() == 2,
              "paged_decode_attention: q [R, H, D], caches [blocks, block_size, KH, D], block_tables [R, W]");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0 && block_tables.size(0) == rows &&
                  context_lens.numel() == rows,
              "paged_decode_attention: head width, head groups or row counts disagree");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "paged_decode_attention: caches must both be float32 or both bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  at::Tensor tables = block_tables.to(at::kLong).contiguous(), lens = context_lens.to(at::kLong).contiguous();
  const int64_t block_size = k_cache.size(1), width = tables.size(1), values = rows * heads * d;
  // float32 q and sums; a bf16 q widened and its output rounded here, in plain loops (as ops, two dispatched
  // conversions and allocations a layer)
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  at::Tensor qc = bf16 ? q.contiguous() : q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, heads, d}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const float f = static_cast<float>(scale);
  if (bf16) {
    std::vector<float> q32(values), out32(values);
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
    uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    if (k_cache.scalar_type() == at::kFloat)
      attend_bf16(qb, rows, heads, d, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), kv_heads, block_size,
                  tables.data_ptr<int64_t>(), width, lens.data_ptr<int64_t>(), f, q32.data(), out32.data(), ob);
    else
      attend_bf16(qb, rows, heads, d, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), kv_heads, block_size,
                  tables.data_ptr<int64_t>(), width, lens.data_ptr<int64_t>(), f, q32.data(), out32.data(), ob);
    return out;
  }
  const float* qf = qc.data_ptr<float>();
  float* of = out.data_ptr<float>();
  if (k_cache.scalar_type() == at::kFloat)
    attend_any(qf, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, f, of);
  else
    attend_any(qf, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, f, of);
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("paged_decode_attention", &FLAGDEPLOY_OPS_NS::paged_decode_attention);
}
