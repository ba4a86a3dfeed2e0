// int4 weights x int8 activations on AVX-512 VNNI: the few-row (decode) linear of a 4-bit GGUF model.
//
// torch's own CPU int4 kernel (_weight_int4pack_mm_for_cpu) converts every nibble to bf16 for one
// multiply-add. Here the activations are quantised once per call in blocks of 32 (one scale each, as
// llama.cpp's Q8 and ONNX Runtime's MatMulNBits do, but as two int8 parts: see Activations), and one
// vpdpbusd multiplies 4 nibbles of each of 16 output rows by the same 4 int8 activations, broadcast: the
// 16 lanes are 16 outputs, so a block's int32 dot needs no horizontal sum, and its scales (one per row)
// are one vector. The weight's offset term, m * sum(x) per block, is taken from the float activations.
//
// Layout (written by `pack_q4` in native.py), N a multiple of 16 and K of 32, tiles of 16 output rows:
//   nib [N/16, K/32, 4, 16, 4] uint8: for tile t and block b, 4 chunks of 64 bytes; in chunk c, byte
//       (j, i) holds row j's value 8c + i in its low nibble and value 8c + 4 + i in its high nibble.
//   dm  [N/16, K/32, 2, 16] float16: the tile's 16 scales d, then its 16 offsets m: w = d * q + m, q in 0..15.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "bf16.h"
#include "dynamic_for.h"
#include "static_count.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define Q4_AVX512 1  // 16 rows per vpdpbusd
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_AVX512 0  // two halves of 8 rows, vpmaddubsw + vpmaddwd for each vpdpbusd
#else
#error "q4_linear needs AVX2 with FMA and F16C (native.py builds it only on such CPUs)"
#endif

#include "kernels.h"

// AMX (Intel since Sapphire Rapids), native.py's "amx" build: the AVX-512 build plus a path that takes a block's
// dot products of up to 16 activation rows with a tile's 16 outputs in one tile multiply per 8 rows (see amx_tile).
// FLAGDEPLOY_AMX_STANDIN builds that path over amx_standin.h instead (a test's build, on any AVX-512 CPU).
#if Q4_AVX512 && ((defined(__AMX_TILE__) && defined(__AMX_INT8__)) || defined(FLAGDEPLOY_AMX_STANDIN))
#define Q4_AMX 1
#if defined(FLAGDEPLOY_AMX_STANDIN)
#include "amx_standin.h"
#else
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define Q4_AMX 0
#endif

namespace {

// f(first row, count) over rows [0, rows) in as few passes of at most `most` rows as there can be, of equal
// sizes: 10 rows in passes of up to 8 as 5 + 5, not 8 + 2
template <typename F>
void equal_passes(int64_t rows, int64_t most, const F& f) {
  const int64_t passes = (rows + most - 1) / most;
  for (int64_t p = 0, r = 0; p < passes; ++p) {
    const int64_t n = (rows - r) / (passes - p);
    f(r, n);
    r += n;
  }
}

// The weight's prefetches go to L2: L1's few miss buffers held back how far ahead a thread could ask
constexpr auto kPrefetchHint = _MM_HINT_T1;

// Activation rows taken in one pass over a tile: each weight chunk is unpacked once for all of them, so
// the rows between 2 and kMaxRows cost the instructions of their dot products only, not the weight's bytes
// again. Held by the registers: on AVX-512 a row's two int32 and one float sums for one tile (half as many
// rows for a pair of tiles), on AVX2 a row's two int16 sums for each half of a tile (16 ymm registers; the
// float sums, touched once a block, go to the stack). kOneMaxRows: the same with one activation part (parts = 1),
// whose rows hold one int16 sum a half and one pair of broadcasts: twice the rows on AVX2.
#if Q4_AVX512
constexpr int kMaxRows = 8, kOneMaxRows = 8;
#else
constexpr int kMaxRows = 2, kOneMaxRows = 4;
#endif
template <bool One>
constexpr int max_rows() { return One ? kOneMaxRows : kMaxRows; }

#if Q4_AVX512

// From this many rows on, tiles go two at a time (see q4_linear). Measured on the 2-core AVX-512 EPYC, the
// default model's 120 linears of a decode step, interleaved A/B: 16 rows 6.31 -> 5.96 ms, 12 rows 5.17 ->
// 4.85, bitwise equal; at 8 rows pairs were no faster (3.65 / 3.78), at 1-4 rows slower.
constexpr int64_t kPairRows = 12;
// How far ahead in its tiles' bytes a thread asks for the weight (one prefetch per 64-byte line it is about
// to read). The hardware prefetcher alone left the 1-row step's 120 linears at ~25 GB/s of the ~37 GB/s two
// cores read here: measured on the 2-core AVX-512 EPYC, the whole decode step in-process, interleaved A/B,
// a lone stream 151 -> 194 tok/s (with the int8 head's prefetch, q8_linear.cpp); 2 KiB and 8 KiB were
// slower than 4 KiB. Bitwise the same (a prefetch changes no value). Since the weights lie end to end on huge
// pages (weight_arena.py), 8 KiB ahead into L2 (kPrefetchHint) beats 4 KiB into L1 in every build: the C++
// 1-row step, interleaved, two runs, 3.67 / 3.75 -> 3.62 / 3.61 ms (AVX2 build 4.48 / 4.27 -> 4.19 / 4.05).
// Keep every prefetch address linear in the block index: GCC 12 dropped all the prefetches of a loop whose address had
// b % 8 in it (2-5 rows 30-50% slower); tests/test_ops.py checks that the built library still has them.
constexpr int64_t kPrefetchBytes = 8192;

// A block's dots with one activation row into its 16 outputs' float sums: the exact int32 dot (hi part * 256 + lo
// part, < 2^24: exact in float) times the tile's scales d and the row's block scale, then the offsets m times
// the block's float sum. The VNNI and AMX paths both add through here, so their outputs agree bit for bit.
inline __m512 add_block(__m512 acc, __m512i dot_hi, __m512i dot_lo, __m512 d, __m512 m, float scale, float sum) {
  const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dot_hi, 8), dot_lo);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(scale)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(sum), acc);
}

// Tiles [t, t + T) of 16 output rows for activation rows [r0, r0 + R): each weight chunk is unpacked once
// and used for R activation rows, and each broadcast activation for T tiles.
// (noinline, both forms: inlined into the row-count dispatch, AVX2 tiles of 5 and 16 rows were 9-12% slower)
// One: the activations' one int8 part (lo is 0, its products left out: the same bits).
template <int R, int T, bool One>
__attribute__((noinline)) void tiles(const uint8_t* nib, const uint16_t* dm, const Activations& a, int64_t k,
                                     int64_t r0, int64_t t, uint16_t* y, int64_t n_out) {
  const int64_t blocks = k / QK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[T][R];
  for (int u = 0; u < T; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot_hi[T][R], dot_lo[T][R];
    for (int u = 0; u < T; ++u)
      for (int r = 0; r < R; ++r) dot_hi[u][r] = dot_lo[u][r] = _mm512_setzero_si512();
    for (int u = 0; u < T; ++u) {
      const int64_t at = (t + u) * blocks + b;
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(nib + at * 256 + kPrefetchBytes + 64 * c), kPrefetchHint);
      _mm_prefetch(reinterpret_cast<const char*>(dm + at * 32 + kPrefetchBytes / 8), kPrefetchHint);  // dm: 64 bytes a 256
    }
    for (int c = 0; c < 4; ++c) {
      __m512i q0[T], q1[T];
      for (int u = 0; u < T; ++u) {
        __m512i raw = _mm512_loadu_si512(nib + ((t + u) * blocks + b) * 256 + 64 * c);
        q0[u] = _mm512_and_si512(raw, low4), q1[u] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * k + b * QK + 8 * c;
        const int32_t* xh = reinterpret_cast<const int32_t*>(a.hi.data() + at);
        const __m512i h0 = _mm512_set1_epi32(xh[0]), h1 = _mm512_set1_epi32(xh[1]);
        for (int u = 0; u < T; ++u)
          dot_hi[u][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot_hi[u][r], q0[u], h0), q1[u], h1);
        if constexpr (!One) {
          const int32_t* xl = reinterpret_cast<const int32_t*>(a.lo.data() + at);
          const __m512i l0 = _mm512_set1_epi32(xl[0]), l1 = _mm512_set1_epi32(xl[1]);
          for (int u = 0; u < T; ++u)
            dot_lo[u][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot_lo[u][r], q0[u], l0), q1[u], l1);
        }
      }
    }
    for (int u = 0; u < T; ++u) {
      const uint16_t* s = dm + ((t + u) * blocks + b) * 32;
      __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * blocks + b;
        acc[u][r] = add_block(acc[u][r], dot_hi[u][r], dot_lo[u][r], d, m, a.scale[at], a.sum[at]);
      }
    }
  }
  for (int u = 0; u < T; ++u)
    for (int r = 0; r < R; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * n_out + 16 * (t + u)),
                          _mm512_cvtepi32_epi16(bf16_lanes(acc[u][r])));
}

#if Q4_AMX

// From this many activation rows on, the AMX path takes a call: tune.yaml's `amx_min_rows`, which native.py sets
// through q4_amx_min_rows when it loads the kernels and `flagdeploy ops tune --chip cpu` measures. Where the table
// has none, never: on a 16-core Xeon with AMX (2026-12-05) the tiles beat the VNNI path from 8 rows on one thread
// (SmolLM2's 120 linears: 8 rows 1.31x, 16 rows 1.34x) but at none with all 16 threads (0.80-0.91x),
// where a call's share of a thread is a few tiles. Either path gives the same bits: the setting moves only the speed.
std::atomic<int64_t> amx_min_rows{int64_t{1} << 62};
// Activation rows of one pass, in halves of up to 8: a half's hi and lo parts of a block stacked in one tile (16
// rows of 32 bytes), so that one tile multiply gives both parts' dots, and the halves share the weight's tile
constexpr int kAmxMaxRows = 16, kAmxHalf = 8;
// Blocks per group: their weights are unpacked, then multiplied, then their dots added, each for the whole group
// in turn, so that a tile load never reads what a vector store has just written nor a vector load what a tile store
// has (a forwarding stall each), and the tile multiplies of consecutive blocks overlap (two sets of registers).
// Block by block, as the first form did, the tiles were 1.1-4x slower than the VNNI path at 1-12 rows on the Xeon
// (one thread), about even at 16.
constexpr int kAmxGroup = 8;

// Whether this process may use the tiles: Linux gives a process AMX's register state only once it asks
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); where it refuses (an old kernel, a VM that hides it), the
// VNNI path serves every call.
bool amx_permitted() {
#if defined(FLAGDEPLOY_AMX_STANDIN)
  return true;
#else
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#endif
}

// The tiles of amx_tile for n activation rows: 0 a block's activations of the first half of the rows (2 n0 x 32
// int8: their hi parts, then their lo parts; n0 = min(n, 8)), 2 the tile's weights of the block (8 x 64: 4 values
// of each of the 16 outputs a row, the VNNI layout), 3 the half's int32 dots (2 n0 x 16). 1 and 4 are the second
// half's activations and dots where n > 8; up to 8 rows, 1, 5 and 4 are a second set for odd blocks instead.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int n) {
  TileConfig c;
  const int n0 = std::min(n, kAmxHalf), n1 = n > kAmxHalf ? n - n0 : n0;
  c.colsb[0] = c.colsb[1] = QK, c.rows[0] = 2 * n0, c.rows[1] = 2 * n1;
  c.colsb[3] = c.colsb[4] = 64, c.rows[3] = 2 * n0, c.rows[4] = 2 * n1;
  for (int i : {2, 5}) c.colsb[i] = 64, c.rows[i] = QK / 4;
  _tile_loadconfig(&c);
}

// Rows [r0, r0 + n) of the activations as amx_tile's tiles read them: per block and half of the rows (up to 8,
// then the rest), the half's hi parts, then its lo parts, 32 bytes each
std::vector<int8_t> stack_parts(const Activations& a, int64_t r0, int64_t n, int64_t k) {
  const int64_t blocks = k / QK;
  std::vector<int8_t> out(blocks * 2 * n * QK);
  int8_t* o = out.data();
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t h0 = 0; h0 < n; h0 += kAmxHalf) {
      const int64_t h1 = std::min<int64_t>(n, h0 + kAmxHalf);
      for (const std::vector<int8_t>* part : {&a.hi, &a.lo})
        for (int64_t r = h0; r < h1; ++r, o += QK) std::memcpy(o, part->data() + (r0 + r) * k + b * QK, QK);
    }
  return out;
}

// Tile t of 16 outputs for activation rows [r0, r0 + R) through the AMX tiles, `parts` from stack_parts. Per block
// of 32: the weight's nibbles unpacked as the VNNI path unpacks them (chunk c's low nibbles are values 8c..8c+3 of
// each output, its high nibbles 8c+4..8c+7: rows 2c and 2c + 1 of the weight tile as they are), one tile multiply
// for both activation parts (int8 x int8 into int32, exact), and the int32 dots out through memory into the VNNI
// path's float steps per row, in its order: each output the same bits as the VNNI path's (and so as one row alone,
// and as AVX2's).
template <int R>
__attribute__((noinline)) void amx_tile(const uint8_t* nib, const uint16_t* dm, const Activations& a,
                                        const int8_t* parts, int64_t k, int64_t r0, int64_t t, uint16_t* y,
                                        int64_t n_out) {
  const int64_t blocks = k / QK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  alignas(64) uint8_t w[kAmxGroup][QK / 4 * 64];
  alignas(64) int32_t dots[kAmxGroup][2 * R * 16];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < blocks; b0 += kAmxGroup) {
    const int group = static_cast<int>(std::min<int64_t>(kAmxGroup, blocks - b0));
    for (int g = 0; g < group; ++g) {
      const int64_t at = t * blocks + b0 + g;
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(nib + at * 256 + kPrefetchBytes + 64 * c), kPrefetchHint);
      _mm_prefetch(reinterpret_cast<const char*>(dm + at * 32 + kPrefetchBytes / 8), kPrefetchHint);
      for (int c = 0; c < 4; ++c) {
        const __m512i raw = _mm512_loadu_si512(nib + at * 256 + 64 * c);
        _mm512_store_si512(w[g] + 128 * c, _mm512_and_si512(raw, low4));
        _mm512_store_si512(w[g] + 128 * c + 64, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
      }
    }
    for (int g = 0; g < group; ++g) {  // tile numbers are immediates
      const int8_t* x = parts + (b0 + g) * 2 * R * QK;
      if constexpr (R > kAmxHalf) {  // both halves on the block's one weight tile
        _tile_loadd(2, w[g], 64);
        _tile_loadd(0, x, QK);
        _tile_loadd(1, x + 2 * kAmxHalf * QK, QK);
        _tile_zero(3);
        _tile_zero(4);
        _tile_dpbssd(3, 0, 2);
        _tile_dpbssd(4, 1, 2);
        _tile_stored(3, dots[g], 64);
        _tile_stored(4, dots[g] + 2 * kAmxHalf * 16, 64);
      } else if (g % 2 == 0) {  // even blocks on 0, 2, 3, odd ones on 1, 5, 4
        _tile_loadd(2, w[g], 64);
        _tile_loadd(0, x, QK);
        _tile_zero(3);
        _tile_dpbssd(3, 0, 2);
        _tile_stored(3, dots[g], 64);
      } else {
        _tile_loadd(5, w[g], 64);
        _tile_loadd(1, x, QK);
        _tile_zero(4);
        _tile_dpbssd(4, 1, 5);
        _tile_stored(4, dots[g], 64);
      }
    }
    for (int g = 0; g < group; ++g) {
      const uint16_t* s = dm + (t * blocks + b0 + g) * 32;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
      for (int r = 0; r < R; ++r) {  // row r's hi dots, then its lo ones n rows on, n its half's row count
        constexpr int n0 = std::min(R, kAmxHalf);
        const int32_t* hi = r < n0 ? dots[g] + 16 * r : dots[g] + 16 * (2 * n0 + r - n0);
        const int n = r < n0 ? n0 : R - n0;
        const int64_t row_block = (r0 + r) * blocks + b0 + g;
        acc[r] = add_block(acc[r], _mm512_load_si512(hi), _mm512_load_si512(hi + 16 * n), d, m, a.scale[row_block],
                           a.sum[row_block]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * n_out + 16 * t),
                        _mm512_cvtepi32_epi16(bf16_lanes(acc[r])));
}

#endif

#else

constexpr int64_t kPairRows = 0;

// AVX2: the same arithmetic on each half of a tile (output rows 0-7 and 8-15, one ymm each), both halves in
// one pass so that each broadcast activation serves two multiplies (passes of up to kMaxRows = 2 rows: the
// two halves' int16 sums of 2 rows, the 4 unpacked nibble vectors and the broadcasts fill the 16 registers).
// Against the halves one after the other in passes of 4 rows, interleaved A/B of the C++ step, AVX2 build on
// the AVX-512 EPYC, two runs: 0.94-0.97x at 1 row, 0.98-0.99x at 2-16 rows, bitwise equal. vpmaddubsw sums
// two nibble x int8 products into int16 (at most 2 * 15 * 128 = 3840: no saturation); a block's 8 of those
// per lane are summed in int16 for each part (at most 30720: no overflow), and only then does vpmaddwd widen
// them to int32, times 256 (hi part) or 1 (lo part): two widening multiplies a block instead of eight, the
// same exact int32 dot as the AVX-512 path. The weight stream is prefetched 8 KiB ahead into L2, as on
// AVX-512 (see there; 1 KiB before: 5 rows 10.29 -> 9.74 ms).
constexpr int64_t kPrefetchBytes = 8192;

#if defined(__AVXVNNI__)
// AVX-VNNI (the avxvnni build): vpdpbusd on 8 lanes, as the AVX-512 path's on 16, sums each lane's 4 products
// straight into int32, one instruction where AVX2 takes vpmaddubsw + vpaddw; the same int32 dot per block.
inline __m256i add_dots(__m256i sums, __m256i q, __m256i x) { return _mm256_dpbusd_avx_epi32(sums, q, x); }
inline __m256i block_dot(__m256i hi, __m256i lo) { return _mm256_add_epi32(_mm256_slli_epi32(hi, 8), lo); }
inline __m256i block_dot(__m256i hi) { return _mm256_slli_epi32(hi, 8); }
#else
inline __m256i add_dots(__m256i sums, __m256i q, __m256i x) {
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(q, x));
}
inline __m256i block_dot(__m256i hi, __m256i lo) {
  return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(256)), _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
}
inline __m256i block_dot(__m256i hi) { return _mm256_madd_epi16(hi, _mm256_set1_epi16(256)); }  // lo = 0
#endif

// One block's int16 dots of rows [r0, r0 + R) with both halves of a tile's chunk vectors q[c][0 | 1][h] (the low
// and high nibbles of chunk c, half h), then their float steps into acc[r][h]. R is at most max_rows<One>(): the
// dots of R rows and the broadcasts fill the registers. One: the hi part alone (lo is 0: the same bits).
template <int R, bool One, typename Q>
inline void block_rows(const Q& q, const Activations& a, int64_t k, int64_t blocks, int64_t b, int64_t r0, __m256 d[2],
                       __m256 m[2], __m256 (*acc)[2]) {
  __m256i hi[2][R], lo[2][R];  // lo unused with One (the compiler drops it)
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) hi[h][r] = lo[h][r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    for (int r = 0; r < R; ++r) {  // each broadcast activation serves both halves
      const int64_t at = (r0 + r) * k + b * QK + 8 * c;
      const int32_t* xh = reinterpret_cast<const int32_t*>(a.hi.data() + at);
      const int32_t* xl = reinterpret_cast<const int32_t*>(a.lo.data() + (One ? 0 : at));
      const __m256i h0 = _mm256_set1_epi32(xh[0]), h1 = _mm256_set1_epi32(xh[1]);
      const __m256i l0 = One ? h0 : _mm256_set1_epi32(xl[0]), l1 = One ? h1 : _mm256_set1_epi32(xl[1]);
      for (int h = 0; h < 2; ++h) {
        hi[h][r] = add_dots(add_dots(hi[h][r], q(c, 0, h), h0), q(c, 1, h), h1);
        if constexpr (!One) lo[h][r] = add_dots(add_dots(lo[h][r], q(c, 0, h), l0), q(c, 1, h), l1);
      }
    }
    // Sums in this order, chunk by chunk: otherwise GCC reassociates the integer adds into one tree per
    // block with all 16 x R products live at once, spilled to the stack (16 ymm registers)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        if constexpr (One)
          asm("" : "+x"(hi[h][r]));
        else
          asm("" : "+x"(hi[h][r]), "+x"(lo[h][r]));
      }
  }
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * blocks + b;
      __m256i dot;
      if constexpr (One)
        dot = block_dot(hi[h][r]);
      else
        dot = block_dot(hi[h][r], lo[h][r]);
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[h], _mm256_set1_ps(a.scale[at])), acc[r][h]);
      acc[r][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a.sum[at]), acc[r][h]);
    }
}

// Rows [r0, r0 + rows) of tile t (at most Most; where Most is one pass, Most rows), block by block: each block's
// passes of up to kMaxRows rows (its 256 bytes in L1, unpacked again for each pass) before the next block. At
// kMaxRows rows or fewer that is one pass over the tile; for more rows, passes one after the other over the whole tile read the tile back from L2 once a pass,
// and from kBlockMajorRows rows on q4_linear gives all of them to one call instead. The same integer dots and
// float steps per row and block, in the same order, either way: the same bits. Measured on a 2-core AVX2 EPYC
// (Zen 3), the default model's 120 linears, interleaved A/B (benchmarks/cpu_kernels_ab.py), all rows in one call
// against passes over the tile: 16 rows 0.899x, 12 rows 0.926x, 8 rows 0.956x, 5 rows 0.995x, 4 rows 1.043x,
// 3 rows 1.072x. Unpacking each block once into a scratch that the passes read back cost more in its stores than
// it saved (16 rows 0.912x, 5 rows 1.018x).
constexpr int64_t kBlockMajorRows = 8;
constexpr int64_t kBlockRows = 16;  // the most rows of one call (their float sums on the stack)

template <int Most, bool One>
__attribute__((noinline)) void tile_rows(const uint8_t* nib, const uint16_t* dm, const Activations& a, int64_t k,
                                         int64_t r0, int64_t rows, int64_t t, uint16_t* y, int64_t n_out) {
  constexpr int M = max_rows<One>();
  const int64_t blocks = k / QK, n = Most <= M ? Most : rows;  // one pass: its float sums in registers
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[Most][2];
  for (int64_t r = 0; r < n; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = nib + (t * blocks + b) * 256;
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64 * c), kPrefetchHint);
    _mm_prefetch(reinterpret_cast<const char*>(dm + (t * blocks + b) * 32 + kPrefetchBytes / 8), kPrefetchHint);
    auto q = [&](int c, int part, int h) {  // chunk c's low (part 0) or high nibbles, half h
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32 * h));
      return _mm256_and_si256(part ? _mm256_srli_epi16(raw, 4) : raw, low4);
    };
    __m256 d[2], m[2];
    for (int h = 0; h < 2; ++h) {
      const uint16_t* s = dm + (t * blocks + b) * 32 + 8 * h;
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
      m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16)));
    }
    int64_t r = 0;
    for (; r + M <= n; r += M) block_rows<M, One>(q, a, k, blocks, b, r0 + r, d, m, acc + r);
    // the last rows, fewer than a pass (written out: through with_count's lambda the whole block loop compiled
    // slower, the 120 linears 1.14x at 5 rows and 1.16x at 16 in the AVX2 build)
    static_assert(M <= 4, "passes of at most four rows on AVX2");
    const int64_t left = n - r;
    if (left == 1) block_rows<1, One>(q, a, k, blocks, b, r0 + r, d, m, acc + r);
    if constexpr (M > 2) {
      if (left == 2) block_rows<2, One>(q, a, k, blocks, b, r0 + r, d, m, acc + r);
      if (left == 3) block_rows<3, One>(q, a, k, blocks, b, r0 + r, d, m, acc + r);
    }
  }
  for (int64_t r = 0; r < n; ++r)
    for (int h = 0; h < 2; ++h) {
      float out[8];
      _mm256_storeu_ps(out, acc[r][h]);
      for (int j = 0; j < 8; ++j) y[(r0 + r) * n_out + 16 * t + 8 * h + j] = bf16_bits(out[j]);
    }
}

// q4_linear's passes of R rows over tiles [t, t + T), one tile at a time (kPairRows is 0 here)
template <int R, int T, bool One>
void tiles(const uint8_t* nib, const uint16_t* dm, const Activations& a, int64_t k, int64_t r0, int64_t t, uint16_t* y,
           int64_t n_out) {
  for (int u = 0; u < T; ++u) tile_rows<R, One>(nib, dm, a, k, r0, R, t + u, y, n_out);
}

#endif

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

// Rows [0, rows_n) of x, quantised as `a`, times the packed weight (nib, dm: n_tiles tiles of 16 outputs) into y, whose
// rows are ldy values apart (a piece of a wider output, llama_step.cpp's workspace); q4_linear is this on tensors.
void q4_linear_into(const Activations& a, int64_t rows_n, int64_t k, const uint8_t* w, const uint16_t* s, int64_t n_tiles,
                    bool one, uint16_t* out, int64_t ldy) {
  // Every row group over one tile before the next tile: the tile's bytes (K/32 x 256) are read from memory
  // once and stay in L1 for the other rows, where rows outermost streamed the whole weight once per group
  // (16 rows took ~10x one row's time; the kernel is bound by the weight's bytes at few rows).
  // Past a dozen rows the kernel is bound by its instructions rather than the weight's bytes, and two tiles
  // at a time share each broadcast activation (one vpbroadcastd per two vpdpbusd, not one each).
  const bool pairs = kPairRows > 0 && rows_n >= kPairRows;
  auto rows_over = [&](auto tile_count, auto one_part, int64_t t) {
    constexpr int T = decltype(tile_count)::value;
    constexpr bool One = decltype(one_part)::value;
    constexpr int most = max_rows<One>() / T;  // the registers hold T x most rows' sums
    equal_passes(rows_n, most, [&](int64_t r, int64_t n) {
      with_count<most>(n, [&](auto rows) { tiles<rows, T, One>(w, s, a, k, r, t, out, ldy); });
    });
  };
#if Q4_AMX
  if (rows_n >= amx_min_rows.load(std::memory_order_relaxed) && amx_permitted()) {
    // each chunk of tiles in passes of up to 16 rows (a tile's weight read from memory once, then from the caches),
    // every pass's activations stacked once for all threads
    struct Pass { int64_t r, n; std::vector<int8_t> parts; };  // rows [r, r + n), stacked by stack_parts
    std::vector<Pass> passes;
    equal_passes(rows_n, kAmxMaxRows, [&](int64_t r, int64_t n) { passes.push_back({r, n, stack_parts(a, r, n, k)}); });
    const int64_t chunk = std::max<int64_t>(1, (n_tiles + 8 * at::get_num_threads() - 1) / (8 * at::get_num_threads()));
    dynamic_for(n_tiles, chunk, [&](int64_t t0, int64_t t1) {
      for (const Pass& p : passes) {
        configure_tiles(static_cast<int>(p.n));
        with_count<kAmxMaxRows>(p.n, [&](auto rows) {
          for (int64_t t = t0; t < t1; ++t) amx_tile<rows>(w, s, a, p.parts.data(), k, p.r, t, out, ldy);
        });
      }
      _tile_release();
    });
    return;
  }
#endif
  // chunks of an even count of tiles (pairs stay pairs), about eight a thread
  const int64_t chunk = 2 * std::max<int64_t>(1, (n_tiles + 16 * at::get_num_threads() - 1) / (16 * at::get_num_threads()));
  auto run = [&](auto one_part) {
    constexpr bool One = decltype(one_part)::value;
    dynamic_for(n_tiles, chunk, [&](int64_t t0, int64_t t1) {
      int64_t t = t0;
#if !Q4_AVX512
      if (rows_n >= kBlockMajorRows) {
        for (; t < t1; ++t)
          equal_passes(rows_n, kBlockRows,
                       [&](int64_t r, int64_t n) { tile_rows<kBlockRows, One>(w, s, a, k, r, n, t, out, ldy); });
        return;
      }
#endif
      if constexpr (kPairRows > 0)
        for (; pairs && t + 2 <= t1; t += 2) rows_over(std::integral_constant<int, 2>{}, one_part, t);
      for (; t < t1; ++t) rows_over(std::integral_constant<int, 1>{}, one_part, t);
    });
  };
  if (one)
    run(std::true_type{});
  else
    run(std::false_type{});
}

// parts: the activations as two int8 parts (~15 bits, the default) or one (llama.cpp's Q8 precision: half the
// products, and on AVX2 twice the rows a pass; docs/performance.md, issue 54's twenty-fifth pass).
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& dm, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && nib.dim() == 5 && dm.dim() == 4,
              "q4_linear: x [M, K], nib [N/16, K/32, 4, 16, 4], dm [N/16, K/32, 2, 16]");
  const int64_t rows_n = x.size(0), k = x.size(1), n_tiles = nib.size(0), n_out = 16 * n_tiles;
  TORCH_CHECK(k % QK == 0 && nib.size(1) == k / QK && dm.size(0) == n_tiles && dm.size(1) == k / QK,
              "q4_linear: x's width does not match the packed weight's (K a multiple of 32)");
  TORCH_CHECK(nib.scalar_type() == at::kByte && dm.scalar_type() == at::kHalf && nib.is_contiguous() && dm.is_contiguous(),
              "q4_linear: nib must be contiguous uint8, dm contiguous float16");
  TORCH_CHECK(parts == 1 || parts == 2, "q4_linear: parts is 1 or 2 (the activations' int8 parts), not ", parts);
  const bool one = parts == 1;
  Activations a = quantize(x, one);
  at::Tensor y = at::empty({rows_n, n_out}, x.options().dtype(at::kBFloat16));
  q4_linear_into(a, rows_n, k, nib.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()),
                 n_tiles, one, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), n_out);
  return y;
}

// The least row count of q4_linear's AMX path: set to `rows` where that is positive, and returned; 0 in a build
// without the path.
int64_t q4_amx_min_rows(int64_t rows) {
#if Q4_AMX
  if (rows > 0) amx_min_rows.store(rows, std::memory_order_relaxed);
  return amx_min_rows.load(std::memory_order_relaxed);
#else
  (void)rows;
  return 0;
#endif
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("q4_linear(Tensor x, Tensor nib, Tensor dm, int parts=2) -> Tensor");
  m.def("q4_amx_min_rows(int rows) -> int", &FLAGDEPLOY_OPS_NS::q4_amx_min_rows);
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("q4_linear", &FLAGDEPLOY_OPS_NS::q4_linear);
}
