// exp(x) for x <= 0 (a softmax's s - max, a sigmoid's -|g|), to ~1 ulp: 2^n e^r with n = round(x / ln 2) and a
// degree-7 series for e^r (Cephes' coefficients), every multiply-add an explicit fma. Plain arithmetic, so the
// compiler runs 16 values at a time where libm's expf is a call per value (a quarter of decode attention's
// time), and any build computes the same bits. Below -87.3 (e^x < 2^-126) it is 0. Always inlined: called,
// as GCC chose to in attention's grouped loops, it ran one key at a time (~2% of a 16-row decode step).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.3f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = std::fma(n, -1.428606765330187045e-6f, std::fma(n, -6.93145751953125e-1f, xc));  // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.3f ? 0.f : y * scale;
}
