// A stand-in for the AMX tile instructions q4_linear.cpp uses, in plain C++, written from Intel's documented
// semantics (the Intel 64 and IA-32 Architectures Software Developer's Manual: LDTILECFG, TILELOADD, TILESTORED,
// TILEZERO, TDPBSSD, TILERELEASE), so that the kernel's AMX path (its tile layouts, strides, configurations and
// the float steps after them) is checked bit for bit against the VNNI path on a CPU without AMX
// (tests/test_ops.py builds q4_linear with FLAGDEPLOY_AMX_STANDIN). It is no model of AMX's speed, and a build
// with it is only ever a test's.
#pragma once

#include <cstdint>
#include <cstring>

namespace amx_standin {

// the 8 tile registers of palette 1 (16 rows of 64 bytes at most), each with its configured shape
struct Tile {
  int rows = 0, colsb = 0;
  uint8_t data[16][64];
};

inline thread_local Tile tiles[8];

// LDTILECFG's 64-byte operand: byte 0 the palette (1), bytes 16-47 each tile's bytes a row (uint16), bytes
// 48-63 each tile's rows; loading a configuration zeroes every tile
inline void loadconfig(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    tiles[t].colsb = colsb, tiles[t].rows = c[48 + t];
    std::memset(tiles[t].data, 0, sizeof(tiles[t].data));
  }
}

inline void loadd(int t, const void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(tiles[t].data[r], static_cast<const uint8_t*>(base) + r * stride, tiles[t].colsb);
}

inline void stored(int t, void* base, int64_t stride) {
  for (int r = 0; r < tiles[t].rows; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles[t].data[r], tiles[t].colsb);
}

inline void zero(int t) { std::memset(tiles[t].data, 0, sizeof(tiles[t].data)); }

// TDPBSSD c, a, b: for each row m of c and dword n of it, the products of a's bytes 4k..4k+3 of row m with b's
// bytes 4n..4n+3 of row k (all signed), k over a's dwords a row, added to c's dword
inline void dpbssd(int c, int a, int b) {
  Tile &C = tiles[c], &A = tiles[a], &B = tiles[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t sum;
      std::memcpy(&sum, C.data[m] + 4 * n, 4);
      for (int k = 0; k < A.colsb / 4; ++k)
        for (int i = 0; i < 4; ++i)
          sum += static_cast<int8_t>(A.data[m][4 * k + i]) * static_cast<int8_t>(B.data[k][4 * n + i]);
      std::memcpy(C.data[m] + 4 * n, &sum, 4);
    }
}

}  // namespace amx_standin

#define _tile_loadconfig(config) amx_standin::loadconfig(config)
#define _tile_loadd(t, base, stride) amx_standin::loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_standin::stored(t, base, stride)
#define _tile_zero(t) amx_standin::zero(t)
#define _tile_dpbssd(c, a, b) amx_standin::dpbssd(c, a, b)
#define _tile_release() ((void)0)
