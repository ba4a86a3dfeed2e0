// int8 weights x activations quantised to ~15 bits, on AVX2: the few-row (decode) linear of an int8 weight
// with per-channel scales, what a quantized model's LM head is (a GGUF's Q8_0 token embedding, tied), or with
// a scale per group of 32 inputs, what a GGUF's Q8_0 and Q5_0 linears are exactly, or of 16, what its Q6_K ones
// are (gguf_reader.py): the linears a Q4_K_M file holds beside its 4-bit ones.
//
// torch's _weight_int8pack_mm converts every weight to float for one multiply-add, and reaches ~7 GB/s of
// weight on a 2-core AVX2 EPYC where the cores read ~26 GB/s. Here each activation block of 32 is
// quantised once per call (activations.h: x / s ~ hi + lo / 256), and hi * 256 + lo is one int16
// (|.| <= 32640), so vpmaddwd multiplies two sign-extended int16 weights of each of 8 output rows by the
// same two activations, broadcast, into exact int32 sums (vpdpwssd where the CPU has VNNI: the same sums in one
// instruction instead of vpmaddwd + vpaddd): 8 lanes, 8 rows, no horizontal sum. A block's
// int32 dot (|.| < 2^27) becomes float once, times the block's scale; the row's scale d multiplies the
// finished sum (per-group scales: each group's int32 dots are their own float step, times the group's scales
// and the activation block's, and nothing multiplies the sum). With AVX-512 VNNI, two adjacent tiles (16 output
// rows, one a lane) go through one vpdpwssd per column pair and activation row, which sums the same int16
// products into int32 as vpmaddwd + vpaddd do (integer sums, no overflow: the same values), and the float steps
// are the same per lane, so both builds compute the same bits.
//
// Layout (written by `pack_q8` in native.py), N a multiple of 8 and K of 32, tiles of 8 output rows:
//   w8 [N/8, K/32, 16, 8, 2] int8: for tile t and block b, 16 pairs of columns; in pair c, row j's values
//       2c and 2c + 1.
//   d [N] float32: the rows' scales, w = d * q; or per group of G inputs (16 or 32), d [N/8, K/G, 8] float32: for
//       tile t and group g, its 8 rows' scales of that group, w = d * q.
//
// Per-group weights whose values fit 5 or 6 bits (a GGUF's Q5_0: -16..15; Q6_K: -32..31) may be held in as many
// bits (fewer bytes a step reads; native.py's Isa.low_bit_weights: by default where vpdpbusd is), as
// u = q + 2^(bits - 1) in 0..63, and multiplied as bytes: vpdpbusd (AVX-512 VNNI, AVX-VNNI; vpmaddubsw + vpmaddwd
// on AVX2) of the unsigned u by the activations' two int8 parts, 4 inputs of a row a lane, one instruction per 4
// products and part where the 8-bit form's vpdpwssd takes int16 weights widened from bytes.
// The offset comes off the exact int32 dot (sum u x - 2^(bits - 1) sum x, x the int16 activations), so a
// block's dot, and every output, is the 8-bit form's bit for bit. Layout (`pack_q8` with bits 5 or 6):
//   w [N/8, K/32, 128 + 32 E] int8 (E = bits - 4): for tile t and block b, 8 chunks of 32 bytes, chunk c = the
//       tile's 8 rows x inputs 4c..4c+3 (byte 4 j + i: row j, input 4c + i), stored as 4 x 32 bytes of low nibbles
//       (byte i of the v-th: chunk 2v's byte i in its low nibble, chunk 2v + 1's in its high one), then E x 32
//       bytes of the high bits (byte i of the e-th: chunk (8 / E) e + j's byte i's high bits at bit E j).
//   With Q6_K's scales (native.py `_q6k_scales`: where each is exactly an int8 times a float32 per 256 inputs of its
//   row), 6 bits and 16 more bytes a block, its two groups' int8 scales of the 8 rows, and d [N/8, K/256, 8] float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "activations.h"
#include "bf16.h"
#include "dynamic_for.h"
#include "static_count.h"

#if !(defined(__AVX2__) && defined(__FMA__))
#error "q8_linear needs AVX2 with FMA (native.py builds it only on such CPUs)"
#endif

#include "kernels.h"

namespace {

constexpr int64_t kTile = 8;
constexpr int kTileRows = 8;   // most rows a pass over one tile takes (rows_over)
// Rows from which AVX-512 VNNI takes tiles in pairs (fewer: bound by the bytes). The LM head, one thread, ms
// single tiles / pairs: 2 rows 1.37 / 1.52, 3 rows 2.09 / 1.65, 4 rows 1.71 (pairs)
constexpr int64_t kPairRows = 3;
// How far ahead in a tile's bytes the weight is asked for (each 64-byte line), as in q4_linear.cpp. The LM head
// (49152 x 576) with the last-level cache flushed between calls, 2-core AVX-512 EPYC: 1 row 0.78 -> 0.72 ms,
// 16 rows 2.5 -> 1.8 ms; 2 and 4 KiB gained less.
constexpr int64_t kPrefetchBytes = 8192;

template <int64_t Bytes = kTile * QK>
inline void prefetch_block(const int8_t* w) {  // a tile's block of Bytes, kPrefetchBytes on
  for (int c = 0; c < (Bytes + 63) / 64; ++c)
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64 * c), _MM_HINT_T0);
}

// How many times a block's int32 dots become float, for weights with a scale per Group inputs (0: per channel)
template <int Group>
constexpr int kParts = Group == 16 ? 2 : 1;

// sums + each lane's two products of int16 w and x, in int32: one vpdpwssd where the CPU has VNNI (AVX-VNNI or
// AVX-512 VNNI), else vpmaddwd + vpaddd; the same exact sums either way
inline __m256i add_pairs(__m256i sums, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(sums, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(sums, w, x);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(w, x));
#endif
}

// ---- the 5- and 6-bit forms ----

// Rows of one pass over a tile: their hi and lo int32 sums in registers (16 ymm on AVX2, 32 with AVX-512)
#if defined(__AVX512VL__)
constexpr int kLowRows = 8;
#else
constexpr int kLowRows = 4;
#endif

// A 5- or 6-bit form: its bits, and whether its scales come as Q6_K holds them (`sub`: an int8 per group of 16 in
// the block, times a float32 per 256 inputs of a row) rather than as a float32 per group; a tile's block's bytes
template <int Bits, bool Sub>
struct Low {
  static constexpr int bits = Bits;
  static constexpr bool sub = Sub;
  static constexpr int64_t bytes = 128 + 32 * (Bits - 4) + (Sub ? 2 * kTile : 0);
};

// The tile's 8 scales of group `part` of block b: its float32s, or its int8s times the rows' float32s of the 256
// inputs (`pack_q8` keeps only factorings whose products are the scales exactly: the same floats either way)
template <class F>
inline __m256 group_scales(const int8_t* w, const float* d, int64_t t, int64_t k, int64_t b, int part, int parts) {
  if constexpr (F::sub) {
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + F::bytes - 2 * kTile + kTile * part));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), _mm256_loadu_ps(d + (t * (k / 256) + b / 8) * kTile));
  } else {
    return _mm256_loadu_ps(d + ((t * (k / QK) + b) * parts + part) * kTile);
  }
}

// Chunk c of a block: its 32 values u (0 .. 2^Bits - 1) as bytes. 16-bit shifts: the bits each mask keeps never
// cross a byte.
template <int Bits>
inline __m256i low_chunk(const int8_t* w, int c) {
  constexpr int extra = Bits - 4, per = 8 / extra;
  const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * (c / 2)));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * (c / per)));
  const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(nib, 4 * (c % 2)), _mm256_set1_epi8(0x0F));
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(high, extra * (c % per)), _mm256_set1_epi8((1 << extra) - 1));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// sums + each lane's 4 products u x (u unsigned, x int8) in int32
inline __m256i add_dots(__m256i sums, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(sums, u, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sums, u, x);
#else  // two products a 16-bit sum: at most 2 * 63 * 128, no saturation
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// ---- one activation part (q8_linear's parts = 1: serve --q8-activations) ----
//
// The activations' lo part is 0, so the 8-bit form's int16 x is 256 hi and a block's int32 dot 256 sum(w hi). Where
// the CPU has vpdpbusd that dot is taken from the bytes: w + 128 (0..255: the weights are -127..127) as the unsigned
// factor, hi as the signed one, 4 products a lane instead of vpdpwssd's 2, and 128 sum(hi) taken off: the same int32,
// so the same bits as the int16 form (which the AVX2 build keeps: vpmaddubsw's int16 sums of those products saturate).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define Q8_ONE_BYTES 1
#else
#define Q8_ONE_BYTES 0
#endif

// 32 bytes of the layout (column pairs 2c and 2c + 1 of a tile's 8 rows) as vpdpbusd takes them: lane j = row j's
// values 4c .. 4c + 3, each plus 128
inline __m256i as_quads(const int8_t* w) {
  const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,  //
                                         0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i halves = _mm256_permute4x64_epi64(raw, _MM_SHUFFLE(3, 1, 2, 0));  // rows 0-3 of both pairs, then 4-7
  return _mm256_xor_si256(_mm256_shuffle_epi8(halves, order), _mm256_set1_epi8(-128));
}

// A part's int32 dot as the int16 form has it: 256 (sum((w + 128) hi) - 128 sum(hi))
inline __m256i one_part_dot(__m256i sums, int32_t hsum) {
  return _mm256_slli_epi32(_mm256_sub_epi32(sums, _mm256_set1_epi32(128 * hsum)), 8);
}

// A row's int32 dot of a block's group into its float sum: times the activation block's scale, and the group's
// scales of the outputs where they have them (dg; per channel, the finished sum is multiplied instead)
template <int Group>
inline __m256 add_dot(__m256 acc, __m256i dot, __m256 dg, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), Group > 0 ? _mm256_mul_ps(dg, s) : s, acc);
}

// Activations of one call as the tiles take them: the int16 values (hi * 256 + lo) and the blocks' scales, and for
// one part on vpdpbusd the int8 hi values and each row's sums of them per block (per group of 16 with such scales)
struct Xs {
  const int16_t* x16;
  const int8_t* hi;
  const int32_t* hsum;
  const float* scale;
};

// Tile t of 8 output rows for activation rows [r0, r0 + R): each 32 bytes of weight are widened once (Bytes: shuffled
// once, as_quads) and used for R rows. Group 16 or 32: d holds a scale per row and group of inputs (the layout's
// second form), and each group's dots are their own float step. Bytes: one activation part on vpdpbusd, 4 products a
// row and instruction where the int16 form's vpdpwssd takes 2; the same int32 dots, so the same bits.
template <int R, int Group, bool Bytes>
void tile(const int8_t* w8, const float* d, const Xs& x, int64_t k, int64_t r0, int64_t t, uint16_t* y, int64_t n_out) {
  const int64_t blocks = k / QK;
  const int8_t* hi = x.hi;  // copied out of x: read through it in the loops, the avxvnni head was 1.3x slower at 16 rows
  const int16_t* x16 = x.x16;
  const int32_t* hsum = x.hsum;
  const float* scale = x.scale;
  constexpr int parts = kParts<Group>, chunks = QK / 4 / parts;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = w8 + (t * blocks + b) * (kTile * QK);
    prefetch_block(w);
    for (int part = 0; part < parts; ++part) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int c = part * chunks; c < (part + 1) * chunks; ++c) {  // two column pairs per 32 bytes
        if constexpr (Bytes) {
          const __m256i u = as_quads(w + 32 * c);
          for (int r = 0; r < R; ++r)
            dot[r] = add_dots(dot[r], u, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(hi + (r0 + r) * k + b * QK + 4 * c)));
        } else {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
          const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
          const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
          for (int r = 0; r < R; ++r) {
            const int32_t* xr = reinterpret_cast<const int32_t*>(x16 + (r0 + r) * k + b * QK + 4 * c);
            dot[r] = add_pairs(add_pairs(dot[r], w0, _mm256_set1_epi32(xr[0])), w1, _mm256_set1_epi32(xr[1]));
          }
        }
      }
      const __m256 dg = Group > 0 ? _mm256_loadu_ps(d + ((t * blocks + b) * parts + part) * kTile) : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t row_block = (r0 + r) * blocks + b;
        const __m256i whole = Bytes ? one_part_dot(dot[r], hsum[row_block * parts + part]) : dot[r];
        acc[r] = add_dot<Group>(acc[r], whole, dg, scale[row_block]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, Group > 0 ? acc[r] : _mm256_mul_ps(acc[r], _mm256_loadu_ps(d + kTile * t)));
    for (int j = 0; j < kTile; ++j) y[(r0 + r) * n_out + kTile * t + j] = bf16_bits(out[j]);
  }
}

// Tile t for activation rows [r0, r0 + R) of a 5- or 6-bit weight: each chunk unpacked once for the R rows; a
// group's dot is 256 hi + lo - 2^(Bits - 1) sum(x), the 8-bit form's int32, and the float steps are its own.
template <int R, int Group, class F, bool One>
void tile_low(const int8_t* w8, const float* d, const Activations& a, const int32_t* xsum, int64_t k, int64_t r0,
              int64_t t, uint16_t* y, int64_t n_out) {
  const int64_t blocks = k / QK, groups = k / Group;
  constexpr int parts = kParts<Group>, chunks = 8 / parts;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = w8 + (t * blocks + b) * F::bytes;
    prefetch_block<F::bytes>(w);
#pragma GCC unroll 2
    for (int part = 0; part < parts; ++part) {
      __m256i hi[R], lo[R];
      for (int r = 0; r < R; ++r) hi[r] = lo[r] = _mm256_setzero_si256();
#pragma GCC unroll 8  // constant chunk indices: low_chunk's shifts by immediates
      for (int c = part * chunks; c < (part + 1) * chunks; ++c) {
        const __m256i u = low_chunk<F::bits>(w, c);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * k + b * QK + 4 * c;
          hi[r] = add_dots(hi[r], u, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a.hi.data() + at)));
          if constexpr (!One)
            lo[r] = add_dots(lo[r], u, _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(a.lo.data() + at)));
        }
      }
      const __m256 dg = group_scales<F>(w, d, t, k, b, part, parts);
      for (int r = 0; r < R; ++r) {
        const int32_t offset = xsum[(r0 + r) * groups + b * parts + part] * (1 << (F::bits - 1));
        const __m256i both = One ? _mm256_slli_epi32(hi[r], 8) : _mm256_add_epi32(_mm256_slli_epi32(hi[r], 8), lo[r]);
        const __m256i dot = _mm256_sub_epi32(both, _mm256_set1_epi32(offset));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dg, _mm256_set1_ps(a.scale[(r0 + r) * blocks + b])),
                                 acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, acc[r]);
    for (int j = 0; j < kTile; ++j) y[(r0 + r) * n_out + kTile * t + j] = bf16_bits(out[j]);
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define Q8_LOW_PAIRS 1
constexpr int kLowPairRows = 16;  // rows of one pass over a pair of tiles: the chunks unpacked once for them all
// Tiles t and t + 1 (16 output rows) for rows [r0, r0 + R): tile_low on 16 lanes, each broadcast activation serving
// both tiles (kPairRows rows on, as the 8-bit form's pairs). Per lane the same steps: the same bits.
template <int R, int Group, class F, bool One>
void tile_low_pair(const int8_t* w8, const float* d, const Activations& a, const int32_t* xsum, int64_t k, int64_t r0,
                   int64_t t, uint16_t* y, int64_t n_out) {
  const int64_t blocks = k / QK, groups = k / Group;
  constexpr int parts = kParts<Group>, chunks = 8 / parts;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w0 = w8 + (t * blocks + b) * F::bytes;  // tile t + 1's block b is a tile further
    const int8_t* w1 = w0 + blocks * F::bytes;
    prefetch_block<F::bytes>(w0);
    prefetch_block<F::bytes>(w1);
#pragma GCC unroll 2
    for (int part = 0; part < parts; ++part) {
      // the part's chunks unpacked once for all R rows, whose dots go S rows at a time: up to 8 rows all at once;
      // more (a pass of 16) in steps that leave the 32 zmm registers room for the R float sums and the chunks
      constexpr int S = R <= 8 ? R : chunks == 4 ? 4 : 2;
      __m512i u[chunks];
#pragma GCC unroll 8
      for (int c = 0; c < chunks; ++c)
        u[c] = _mm512_inserti64x4(_mm512_castsi256_si512(low_chunk<F::bits>(w0, part * chunks + c)),
                                  low_chunk<F::bits>(w1, part * chunks + c), 1);
      const __m512 dg = _mm512_insertf32x8(_mm512_castps256_ps512(group_scales<F>(w0, d, t, k, b, part, parts)),
                                           group_scales<F>(w1, d, t + 1, k, b, part, parts), 1);
#pragma GCC unroll 16
      for (int s0 = 0; s0 < R; s0 += S) {
        __m512i hi[S], lo[S];
        for (int r = 0; r < S; ++r) hi[r] = lo[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < chunks; ++c)
          for (int r = 0; r < S && s0 + r < R; ++r) {
            const int64_t at = (r0 + s0 + r) * k + b * QK + 4 * (part * chunks + c);
            hi[r] = _mm512_dpbusd_epi32(hi[r], u[c], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a.hi.data() + at)));
            if constexpr (!One)
              lo[r] = _mm512_dpbusd_epi32(lo[r], u[c], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a.lo.data() + at)));
          }
        for (int r = 0; r < S && s0 + r < R; ++r) {
          const int64_t row = r0 + s0 + r;
          const int32_t offset = xsum[row * groups + b * parts + part] * (1 << (F::bits - 1));
          const __m512i both = One ? _mm512_slli_epi32(hi[r], 8) : _mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]);
          const __m512i dot = _mm512_sub_epi32(both, _mm512_set1_epi32(offset));
          acc[s0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dg, _mm512_set1_ps(a.scale[row * blocks + b])),
                                        acc[s0 + r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * n_out + kTile * t), _mm512_cvtepi32_epi16(bf16_lanes(acc[r])));
}
#else
#define Q8_LOW_PAIRS 0
#endif

template <int Group, class F, bool One>
void low_tiles(const int8_t* w, const float* ds, const Activations& a, const int32_t* xsum, int64_t k, int64_t rows_n,
               int64_t n_tiles, uint16_t* out, int64_t n_out) {
#if Q8_LOW_PAIRS
  if (rows_n >= kPairRows && n_tiles >= 2) {
    const int64_t pairs = n_tiles / 2;
    dynamic_for(pairs, std::max<int64_t>(8, pairs / (8 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
      for (int64_t t = 2 * p0; t < 2 * p1; t += 2)
        for (int64_t r0 = 0; r0 < rows_n; r0 += kLowPairRows)
          with_count<kLowPairRows>(std::min<int64_t>(kLowPairRows, rows_n - r0),
                                   [&](auto rows) { tile_low_pair<rows, Group, F, One>(w, ds, a, xsum, k, r0, t, out, n_out); });
    });
    if (n_tiles % 2 == 0) return;
    w += (n_tiles - 1) * (k / QK) * F::bytes;  // the odd tile on its own (below), as tile 0 of the rest
    ds += (n_tiles - 1) * (k / (F::sub ? 256 : Group)) * kTile;
    out += (n_tiles - 1) * kTile;
    n_tiles = 1;
  }
#endif
  dynamic_for(n_tiles, std::max<int64_t>(16, n_tiles / (8 * at::get_num_threads())), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r0 = 0; r0 < rows_n; r0 += kLowRows)  // every pass over the tile before the next: it stays in L1
        with_count<kLowRows>(std::min<int64_t>(kLowRows, rows_n - r0),
                             [&](auto rows) { tile_low<rows, Group, F, One>(w, ds, a, xsum, k, r0, t, out, n_out); });
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_TILE_PAIRS 1

constexpr int kPairsAtOnce = 8;  // column pairs widened into registers at a time (beside up to 16 rows' sums)

// add_dot and one_part_dot on 16 lanes (two tiles)
template <int Group>
inline __m512 add_dot(__m512 acc, __m512i dot, __m512 dg, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), Group > 0 ? _mm512_mul_ps(dg, s) : s, acc);
}
inline __m512i one_part_dot(__m512i sums, int32_t hsum) {
  return _mm512_slli_epi32(_mm512_sub_epi32(sums, _mm512_set1_epi32(128 * hsum)), 8);
}

// Tiles t and t + 1 (16 output rows) for activation rows [r0, r0 + R), `tile` on 16 lanes. Two parts: per block, the
// column pairs' weights are widened once into registers, 8 at a time, and used for all R rows: one vpdpwssd per pair
// and row, the row's two activations broadcast. The LM head (49152 x 576), ms, AVX2 tiles / these / the dense bf16
// copy through oneDNN: 4 rows 1.03 / 0.56 / 1.57, 8 rows 2.91 / 0.81 / 1.95, 16 rows 5.17 / 1.75 / 2.18 (R = 8
// twice: 2.5-3.3). One part: each 32 bytes of both tiles shuffled once for the R rows, one vpdpbusd a row, rows 4 at
// a time beside the part's chunks. Per lane the same steps as `tile`: the same bits.
template <int R, int Group, bool One>
void tile_pair(const int8_t* w8, const float* d, const Xs& x, int64_t k, int64_t r0, int64_t t, uint16_t* y,
               int64_t n_out) {
  const int64_t blocks = k / QK, tile_bytes = kTile * QK;
  const int8_t* hi = x.hi;  // as `tile` does
  const int16_t* x16 = x.x16;
  const int32_t* hsum = x.hsum;
  const float* scale = x.scale;
  constexpr int parts = kParts<Group>, pairs = QK / 2 / parts, chunks = QK / 4 / parts, S = R < 4 ? R : 4;
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w0 = w8 + (t * blocks + b) * tile_bytes;  // tile t's block b; tile t + 1's is a tile further
    const int8_t* w1 = w0 + blocks * tile_bytes;
    prefetch_block(w0);
    prefetch_block(w1);
#pragma GCC unroll 2
    for (int part = 0; part < parts; ++part) {
      auto pair_scales = [&] {  // the two tiles' scales of this group, as `tile` takes them
        if constexpr (Group == 0) return _mm512_setzero_ps();
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(d + ((t * blocks + b) * parts + part) * kTile)),
                                  _mm256_loadu_ps(d + (((t + 1) * blocks + b) * parts + part) * kTile), 1);
      };
      if constexpr (One) {
        const __m512 dg = pair_scales();
        __m512i u[chunks];
#pragma GCC unroll 8
        for (int c = 0; c < chunks; ++c) {
          const int at = 32 * (part * chunks + c);
          u[c] = _mm512_inserti64x4(_mm512_castsi256_si512(as_quads(w0 + at)), as_quads(w1 + at), 1);
        }
#pragma GCC unroll 16
        for (int s0 = 0; s0 < R; s0 += S) {
          __m512i dot[S];
          for (int r = 0; r < S; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
          for (int c = 0; c < chunks; ++c)
            for (int r = 0; r < S && s0 + r < R; ++r) {
              const int8_t* xr = hi + (r0 + s0 + r) * k + b * QK + 4 * (part * chunks + c);
              dot[r] = _mm512_dpbusd_epi32(dot[r], u[c], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr)));
            }
          for (int r = 0; r < S && s0 + r < R; ++r) {
            const int64_t row_block = (r0 + s0 + r) * blocks + b;
            const __m512i whole = one_part_dot(dot[r], hsum[row_block * parts + part]);
            acc[s0 + r] = add_dot<Group>(acc[s0 + r], whole, dg, scale[row_block]);
          }
        }
      } else {
        __m512i dot[R];
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int c0 = part * pairs; c0 < (part + 1) * pairs; c0 += kPairsAtOnce) {
          __m512i wc[kPairsAtOnce];  // column pair c0 + c: 8 rows x 2 values from each tile, as int16
#pragma GCC unroll 16
          for (int c = 0; c < kPairsAtOnce; ++c)
            wc[c] = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w0 + 16 * (c0 + c)))),
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w1 + 16 * (c0 + c))), 1));
#pragma GCC unroll 16
          for (int c = 0; c < kPairsAtOnce; ++c)
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              const int32_t* xr = reinterpret_cast<const int32_t*>(x16 + (r0 + r) * k + b * QK);
              dot[r] = _mm512_dpwssd_epi32(dot[r], wc[c], _mm512_set1_epi32(xr[c0 + c]));
            }
        }
        const __m512 dg = pair_scales();  // here, not live beside the dots and the widened pairs (32 registers)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r] = add_dot<Group>(acc[r], dot[r], dg, scale[(r0 + r) * blocks + b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (r0 + r) * n_out + kTile * t),
                        _mm512_cvtepi32_epi16(bf16_lanes(Group > 0 ? acc[r] : _mm512_mul_ps(acc[r], _mm512_loadu_ps(d + kTile * t)))));
}
#else
#define Q8_TILE_PAIRS 0
#endif

// Activation rows [r0, r0 + n), 0 < n <= Most, over tile t (or tiles t, t + 1: Pair) in one pass of exactly n rows
template <int Most, bool Pair, int Group, bool One>
void tile_rows(const int8_t* w8, const float* d, const Xs& x, int64_t k, int64_t r0, int64_t n, int64_t t, uint16_t* y,
               int64_t n_out) {
  with_count<Most>(n, [&](auto rows) {
#if Q8_TILE_PAIRS
    if constexpr (Pair) return tile_pair<rows, Group, One>(w8, d, x, k, r0, t, y, n_out);
#endif
    tile<rows, Group, One && Q8_ONE_BYTES>(w8, d, x, k, r0, t, y, n_out);
  });
}

// Rows [r0, r0 + n): passes of Most rows, then one pass of the rest (a pass widens the tile's weights again).
// Each row's arithmetic is the same in any pass. On AVX2 one pass of up to 8 rows is cheapest although 16 ymm
// registers hold only 8 rows' int32 sums (the float sums, touched once a block, go to the stack): the LM head,
// 49152 x 576, one thread, 2-core AVX-512 EPYC built for AVX2, ms by rows in one pass: 1 0.96, 2 1.58, 3 2.1,
// 4 2.15, 5 2.57, 6 3.07, 7 3.61, 8 4.12; 5 rows as 4 + 1 3.13, 8 as 4 + 4 4.55, 16 as 8 + 8 7.99 (4 x 4 8.70).
template <int Most, bool Pair, int Group, bool One>
void rows_over(const int8_t* w8, const float* d, const Xs& x, int64_t k, int64_t r0, int64_t n, int64_t t, uint16_t* y,
               int64_t n_out) {
  int64_t r = r0;
  for (; r + Most <= r0 + n; r += Most) tile_rows<Most, Pair, Group, One>(w8, d, x, k, r, Most, t, y, n_out);
  if (r < r0 + n) tile_rows<Most, Pair, Group, One>(w8, d, x, k, r, r0 + n - r, t, y, n_out);
}

// The call's tiles, in pairs where that pays (AVX-512 VNNI, kPairRows rows on)
template <int Group, bool One>
void q8_tiles(const int8_t* w, const float* ds, const Xs& x, int64_t k, int64_t rows_n, int64_t n_tiles, uint16_t* out,
              int64_t n_out) {
  // every row group over a tile (or pair of tiles) before the next: its K x 8 bytes stay in L1 for the others
  auto one = [&](int64_t t) { rows_over<kTileRows, false, Group, One>(w, ds, x, k, 0, rows_n, t, out, n_out); };
#if Q8_TILE_PAIRS
  if (rows_n >= kPairRows) {
    const int64_t pairs = n_tiles / 2;
    dynamic_for(pairs, std::max<int64_t>(8, pairs / (8 * at::get_num_threads())), [&](int64_t p0, int64_t p1) {
      for (int64_t t = 2 * p0; t < 2 * p1; t += 2) {
        int64_t r = 0;
        for (; r + 16 <= rows_n; r += 16) tile_rows<16, true, Group, One>(w, ds, x, k, r, 16, t, out, n_out);
        if (r < rows_n) rows_over<8, true, Group, One>(w, ds, x, k, r, rows_n - r, t, out, n_out);
      }
    });
    if (n_tiles % 2) one(n_tiles - 1);
    return;
  }
#endif
  dynamic_for(n_tiles, std::max<int64_t>(16, n_tiles / (8 * at::get_num_threads())), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) one(t);
  });
}

// The sums of each `width` consecutive values of v[0, count): a row's groups or blocks (K is a multiple of width)
template <typename T>
std::vector<int32_t> run_sums(const T* v, int64_t count, int64_t width) {
  std::vector<int32_t> sums(count / width);
  for (size_t i = 0; i < sums.size(); ++i)
    for (int64_t j = 0; j < width; ++j) sums[i] += v[i * width + j];
  return sums;
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

// parts: the activations as two int8 parts (~15 bits, the default) or one (llama.cpp's Q8 precision, as q4_linear's)
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& d, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && (w8.dim() == 5 || w8.dim() == 3) && (d.dim() == 1 || d.dim() == 3),
              "q8_linear: x [M, K], w8 [N/8, K/32, 16, 8, 2] (5- or 6-bit: [N/8, K/32, 160, 192 or 208]), d [N] or "
              "[N/8, K/G, 8] (G 16 or 32; 208 bytes a block: [N/8, K/256, 8])");
  const int64_t rows_n = x.size(0), k = x.size(1), n_tiles = w8.size(0), n_out = kTile * n_tiles;
  int64_t group = d.dim() == 3 && d.size(1) > 0 ? k / d.size(1) : 0;
  const int64_t block_bytes = w8.dim() == 3 ? w8.size(2) : 0;
  const bool sub = block_bytes == Low<6, true>::bytes;  // Q6_K's scales: d [N/8, K/256, 8], groups of 16
  const int bits = w8.dim() == 5                         ? 8
                   : block_bytes == Low<5, false>::bytes ? 5
                   : block_bytes == Low<6, false>::bytes || sub ? 6 : 0;
  if (sub) group = 16;
  TORCH_CHECK(bits == 8 || (bits && group),
              "q8_linear: a 5- or 6-bit weight has 160, 192 or 208 bytes a tile's block and a scale per group");
  TORCH_CHECK(k % QK == 0 && w8.size(1) == k / QK &&
                  (d.dim() == 3 ? d.size(0) == n_tiles && (group == 16 || group == 32) &&
                                      d.size(1) * (sub ? 256 : group) == k && d.size(2) == kTile
                                : d.size(0) == n_out),
              "q8_linear: x's width or the scales' count does not match the packed weight's (K a multiple of 32)");
  TORCH_CHECK(w8.scalar_type() == at::kChar && d.scalar_type() == at::kFloat && w8.is_contiguous() && d.is_contiguous(),
              "q8_linear: w8 must be contiguous int8, d contiguous float32");
  TORCH_CHECK(parts == 1 || parts == 2, "q8_linear: parts is 1 or 2 (the activations' int8 parts), not ", parts);
  const bool one = parts == 1;
  Activations a = quantize(x, one);
  // the int16 form (hi * 256 + lo), read by every form but one part on vpdpbusd over 8-bit weights (hi and hsum alone)
  const bool bytes_only = one && Q8_ONE_BYTES && bits == 8;
  std::vector<int16_t> x16(bytes_only ? 0 : rows_n * k);
  for (size_t i = 0; i < x16.size(); ++i) x16[i] = static_cast<int16_t>(a.hi[i] * 256 + a.lo[i]);
  at::Tensor y = at::empty({rows_n, n_out}, x.options().dtype(at::kBFloat16));
  const int8_t* w = w8.data_ptr<int8_t>();
  const float* ds = d.data_ptr<float>();
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  auto run = [&](auto one_part) {
    constexpr bool One = decltype(one_part)::value;
    if (bits < 8) {
      const std::vector<int32_t> xsum = run_sums(x16.data(), rows_n * k, group);  // per row and group of inputs
      const auto tiles = sub           ? low_tiles<16, Low<6, true>, One>
                         : group == 16 ? (bits == 6 ? low_tiles<16, Low<6, false>, One> : low_tiles<16, Low<5, false>, One>)
                                       : (bits == 6 ? low_tiles<32, Low<6, false>, One> : low_tiles<32, Low<5, false>, One>);
      return tiles(w, ds, a, xsum.data(), k, rows_n, n_tiles, out, n_out);
    }
    // one part on vpdpbusd: per row and block (per group of 16 of it, with such scales) the sum of its hi values
    const std::vector<int32_t> hsum =
        One && Q8_ONE_BYTES ? run_sums(a.hi.data(), rows_n * k, group == 16 ? 16 : QK) : std::vector<int32_t>{};
    const Xs xs{x16.data(), a.hi.data(), hsum.data(), a.scale.data()};
    if (group == 16) return q8_tiles<16, One>(w, ds, xs, k, rows_n, n_tiles, out, n_out);
    if (group == 32) return q8_tiles<32, One>(w, ds, xs, k, rows_n, n_tiles, out, n_out);
    q8_tiles<0, One>(w, ds, xs, k, rows_n, n_tiles, out, n_out);
  };
  if (one)
    run(std::true_type{});
  else
    run(std::false_type{});
  return y;
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("q8_linear(Tensor x, Tensor w8, Tensor d, int parts=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("q8_linear", &FLAGDEPLOY_OPS_NS::q8_linear);
}
