// A count known only at run time (the rows of a pass, the units of a group) handed to code that needs it as a
// compile-time constant: the kernels keep one sum a row or unit in registers, so each count is its own
// instantiation, unrolled.
#pragma once

#include <cstdint>
#include <type_traits>

// f(std::integral_constant<int, n>{}) for 1 <= n <= Most
template <int Most, typename F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (Most > 1) {
    if (n < Most) return with_count<Most - 1>(n, f);
  }
  f(std::integral_constant<int, Most>{});
}
