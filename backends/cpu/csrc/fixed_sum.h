// A dot product summed in one fixed order, shared by the kernels whose results must not depend on the build.
//
// A `#pragma omp simd reduction` sums in the order of the machine's vector lanes, so an AVX2 build and an
// AVX-512 one of the same kernel rounded differently, and the compiler finishes it with a chain of 16
// dependent scalar adds. Here the kLanes partial sums are explicit (element i into lane i % kLanes, in
// element order) and are folded by halves: the same float32 result for any vector width, and a short tree.
#pragma once

#include <cstdint>

#include "bf16.h"

constexpr int kLanes = 16;

// sum_i a[i] * b[i] in float32 (each operand read through as_float: float32 or bf16 bits)
template <typename A, typename B>
inline float fixed_dot(const A* a, const B* b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += as_float(a[i + j]) * as_float(b[i + j]);
  }
  for (int j = 0; i < n; ++i, ++j) part[j] += as_float(a[i]) * as_float(b[i]);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  return part[0];
}

// sum_i a[i] in float32 (or the wider Acc) in fixed_dot's order (element i into lane i % kLanes, then folds by
// halves): the same bits on any build, and 16 independent adds where one running sum was a chain of dependent ones
template <typename Acc = float>
inline Acc fixed_sum(const float* a, int64_t n) {
  Acc part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += a[i + j];
  }
  for (int j = 0; i < n; ++i, ++j) part[j] += a[i];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) part[j] += part[j + width];
  return part[0];
}
