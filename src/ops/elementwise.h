// What the elementwise op files (unary.cpp, binary.cpp) share: the flat parallel loops and their
// work estimates. Internal to src/ops (not installed).
#pragma once

#include "util.h"

namespace graft::opsutil {

// Element operations per element, for the parallel split: a libm call costs ~16 adds.
constexpr int64_t kCheap = 1, kMath = 16;

// y[i] = f(x[i]) over n elements, threaded; a plain loop the compiler can vectorize.
template <class T, class U, class F>
void map1(const T* x, U* y, int64_t n, int64_t work, F f) {
  parallel_elems(n, work, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] = f(x[i]);
  });
}
// z[i] = f(x[i], y[i]) over n elements, threaded.
// (f captures its scalars by value: a captured reference is reloaded in every iteration, since a
// store to z might change it, and the loop stays scalar; perf found ClipGrad so in mobilenet_v2.)
template <class T, class U, class F>
void map2(const T* x, const T* y, U* z, int64_t n, int64_t work, F f) {
  parallel_elems(n, work, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) z[i] = f(x[i], y[i]);
  });
}

}  // namespace graft::opsutil
