// Vectorized float32 transcendentals for the elementwise kernels: exp, tanh, erf, sigmoid and the
// fused Gelu / Silu / Erf forward and gradient formulas, over arrays.
//
// The build targets baseline x86-64, so the vector code is compiled for AVX-512F and for AVX2+FMA
// with target attributes (as gemm_dnnl.cpp does) and picked at run time with
// __builtin_cpu_supports. Without either (or with GRAFT_VMATH=0 in the environment) active() is
// false and the kernels keep their scalar libm loops; float64 kernels always do.
//
// Accuracy (tests/cpp/test_vmath.cpp, a dense sweep of [-100, 100] against float64 libm): exp,
// tanh, erf and sigmoid within 2 ulp; NaN propagates; +-inf, signed zeros, denormal inputs and
// results are handled. Both ISAs run the same sequence of IEEE operations and give the same bits;
// an element's value does not depend on its position in the array (tails go through a masked
// vector), so results do not depend on the thread split either.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace graft::vmath {

enum class Fn { Exp, Tanh, Erf, Sigmoid, Silu, GeluErf, GeluTanh };  // y = f(x)
enum class Fn2 { GeluErfGrad, GeluTanhGrad, SiluGrad, ErfGrad };     // dx = f(dy, x)

#if defined(__x86_64__)
#define GRAFT_VMATH_X86 1

// GCC 12 warns (-Wmaybe-uninitialized, GCC bug 105593) about the _mm512_undefined_* inside the
// unmasked AVX-512 intrinsics.
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace avx512 {
#define GRAFT_VM __attribute__((target("avx512f"), always_inline)) inline
#define GRAFT_VM_LOOP __attribute__((target("avx512f"))) inline
using V = __m512;
using M = __mmask16;
constexpr int64_t kLanes = 16;
GRAFT_VM V set1(float a) { return _mm512_set1_ps(a); }
GRAFT_VM V load(const float* p) { return _mm512_loadu_ps(p); }
GRAFT_VM void store(float* p, V a) { _mm512_storeu_ps(p, a); }
GRAFT_VM V add(V a, V b) { return _mm512_add_ps(a, b); }
GRAFT_VM V sub(V a, V b) { return _mm512_sub_ps(a, b); }
GRAFT_VM V mul(V a, V b) { return _mm512_mul_ps(a, b); }
GRAFT_VM V div(V a, V b) { return _mm512_div_ps(a, b); }
GRAFT_VM V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
GRAFT_VM V min(V a, V b) { return _mm512_min_ps(a, b); }
GRAFT_VM V max(V a, V b) { return _mm512_max_ps(a, b); }
GRAFT_VM M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
GRAFT_VM M ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
GRAFT_VM V sel(M m, V t, V f) { return _mm512_mask_blend_ps(m, f, t); }
GRAFT_VM V abs(V a) {
  return _mm512_castsi512_ps(
      _mm512_and_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
GRAFT_VM V xor_sign(V a, V s) {
  const __m512i sign = _mm512_and_epi32(_mm512_castps_si512(s), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_xor_epi32(_mm512_castps_si512(a), sign));
}
GRAFT_VM V round(V a) {
  return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// Double vectors of half the lanes, for sums in double (Note [row sums in double]).
using VD = __m512d;
GRAFT_VM VD zero_d() { return _mm512_setzero_pd(); }
GRAFT_VM VD add_d(VD a, VD b) { return _mm512_add_pd(a, b); }
GRAFT_VM VD mul_d(VD a, VD b) { return _mm512_mul_pd(a, b); }
GRAFT_VM VD lo_d(V a) { return _mm512_cvtps_pd(_mm512_castps512_ps256(a)); }
GRAFT_VM VD hi_d(V a) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
GRAFT_VM void store_d(double* p, VD a) { _mm512_storeu_pd(p, a); }
// a * 2^n in one instruction (one rounding): the same bits as AVX2's two multiplies, whose first
// is exact for the range vmath_impl.h gives (a normal result of a * 2^(n/2 rounded down)).
GRAFT_VM V ldexp2(V a, V n) { return _mm512_scalef_ps(a, n); }
// The first k of 16 lanes (k < 16), zeros past them; masked-off lanes are not read or written.
GRAFT_VM __mmask16 first_n(int64_t k) { return static_cast<__mmask16>((1u << k) - 1); }
GRAFT_VM V load_n(const float* p, int64_t k) { return _mm512_maskz_loadu_ps(first_n(k), p); }
GRAFT_VM void store_n(float* p, V a, int64_t k) { _mm512_mask_storeu_ps(p, first_n(k), a); }
GRAFT_VM V keep_n(V a, int64_t k) { return _mm512_maskz_mov_ps(first_n(k), a); }
#include "vmath_impl.h"
#undef GRAFT_VM
#undef GRAFT_VM_LOOP
}  // namespace avx512
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace avx2 {
#define GRAFT_VM __attribute__((target("avx2,fma"), always_inline)) inline
#define GRAFT_VM_LOOP __attribute__((target("avx2,fma"))) inline
using V = __m256;
using M = __m256;
constexpr int64_t kLanes = 8;
GRAFT_VM V set1(float a) { return _mm256_set1_ps(a); }
GRAFT_VM V load(const float* p) { return _mm256_loadu_ps(p); }
GRAFT_VM void store(float* p, V a) { _mm256_storeu_ps(p, a); }
GRAFT_VM V add(V a, V b) { return _mm256_add_ps(a, b); }
GRAFT_VM V sub(V a, V b) { return _mm256_sub_ps(a, b); }
GRAFT_VM V mul(V a, V b) { return _mm256_mul_ps(a, b); }
GRAFT_VM V div(V a, V b) { return _mm256_div_ps(a, b); }
GRAFT_VM V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
GRAFT_VM V min(V a, V b) { return _mm256_min_ps(a, b); }
GRAFT_VM V max(V a, V b) { return _mm256_max_ps(a, b); }
GRAFT_VM M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
GRAFT_VM M ge(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
GRAFT_VM V sel(M m, V t, V f) { return _mm256_blendv_ps(f, t, m); }
GRAFT_VM V abs(V a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
GRAFT_VM V xor_sign(V a, V s) {
  return _mm256_xor_ps(a, _mm256_and_ps(s, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))));
}
GRAFT_VM V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
using VD = __m256d;
GRAFT_VM VD zero_d() { return _mm256_setzero_pd(); }
GRAFT_VM VD add_d(VD a, VD b) { return _mm256_add_pd(a, b); }
GRAFT_VM VD mul_d(VD a, VD b) { return _mm256_mul_pd(a, b); }
GRAFT_VM VD lo_d(V a) { return _mm256_cvtps_pd(_mm256_castps256_ps128(a)); }
GRAFT_VM VD hi_d(V a) { return _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)); }
GRAFT_VM void store_d(double* p, VD a) { _mm256_storeu_pd(p, a); }
GRAFT_VM V ldexp2(V a, V n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const V s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const V s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, s1), s2);
}
// The first k of 8 lanes (k < 8), zeros past them; masked-off lanes are not read or written.
GRAFT_VM __m256i first_n(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
GRAFT_VM V load_n(const float* p, int64_t k) { return _mm256_maskload_ps(p, first_n(k)); }
GRAFT_VM void store_n(float* p, V a, int64_t k) { _mm256_maskstore_ps(p, first_n(k), a); }
GRAFT_VM V keep_n(V a, int64_t k) { return _mm256_and_ps(a, _mm256_castsi256_ps(first_n(k))); }
#include "vmath_impl.h"
#undef GRAFT_VM
#undef GRAFT_VM_LOOP
}  // namespace avx2
#endif

// 2: AVX-512F, 1: AVX2 + FMA, 0: neither (or GRAFT_VMATH=0): the kernels' scalar loops.
// GRAFT_VMATH=avx2 picks the AVX2 code on an AVX-512 machine.
inline int level() {
  static const int l = [] {
#ifdef GRAFT_VMATH_X86
    const char* e = std::getenv("GRAFT_VMATH");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (e && std::strcmp(e, "0") == 0) return 0;
    if (e && std::strcmp(e, "avx2") == 0) return avx2 ? 1 : 0;
    if (__builtin_cpu_supports("avx512f")) return 2;
    return avx2 ? 1 : 0;
#else
    return 0;
#endif
  }();
  return l;
}
inline bool active() { return level() > 0; }

// y[i] = f(x[i]) over n elements (x == y allowed) with level lv's code (1 or 2; the CPU must
// have it).
inline void map_at(int lv, Fn f, const float* x, float* y, int64_t n) {
#ifdef GRAFT_VMATH_X86
  auto run = [&]<Fn F>() {
    if (lv == 2)
      avx512::map1<F>(x, y, n);
    else
      avx2::map1<F>(x, y, n);
  };
  switch (f) {
    case Fn::Exp:
      return run.template operator()<Fn::Exp>();
    case Fn::Tanh:
      return run.template operator()<Fn::Tanh>();
    case Fn::Erf:
      return run.template operator()<Fn::Erf>();
    case Fn::Sigmoid:
      return run.template operator()<Fn::Sigmoid>();
    case Fn::Silu:
      return run.template operator()<Fn::Silu>();
    case Fn::GeluErf:
      return run.template operator()<Fn::GeluErf>();
    case Fn::GeluTanh:
      return run.template operator()<Fn::GeluTanh>();
  }
#endif
}
// y[i] = f(g[i], x[i]) over n elements (y may be g or x) with level lv's code.
inline void map2_at(int lv, Fn2 f, const float* g, const float* x, float* y, int64_t n) {
#ifdef GRAFT_VMATH_X86
  auto run = [&]<Fn2 F>() {
    if (lv == 2)
      avx512::map2<F>(g, x, y, n);
    else
      avx2::map2<F>(g, x, y, n);
  };
  switch (f) {
    case Fn2::GeluErfGrad:
      return run.template operator()<Fn2::GeluErfGrad>();
    case Fn2::GeluTanhGrad:
      return run.template operator()<Fn2::GeluTanhGrad>();
    case Fn2::SiluGrad:
      return run.template operator()<Fn2::SiluGrad>();
    case Fn2::ErfGrad:
      return run.template operator()<Fn2::ErfGrad>();
  }
#endif
}

// The largest of x[0, n), n >= 1 (NaN: see max_n in vmath_impl.h). Only when active().
inline float max_of(const float* x, int64_t n) {
#ifdef GRAFT_VMATH_X86
  return level() == 2 ? avx512::max_n(x, n) : avx2::max_n(x, n);
#else
  return x[0];
#endif
}

// Note [row sums in double]: the row kernels of softmax-like ops, each one pass over a row.
// exp_shift_sum: y[i] = exp(x[i] - c) over n elements (x == y allowed); returns the sum of the
// y[i] in double.
// dot_and_sum: sum p[i] * d[i] and sum p[i], both in double. scale: y[i] *= a. sub_mul:
// d[i] = p[i] * (d[i] - c). Only when active().
inline double exp_shift_sum(const float* x, float c, float* y, int64_t n) {
#ifdef GRAFT_VMATH_X86
  return level() == 2 ? avx512::exp_shift_sum(x, c, y, n) : avx2::exp_shift_sum(x, c, y, n);
#else
  return 0;
#endif
}
// y[i] = exp(x[i] - c), no sum (x == y allowed). Only when active().
inline void exp_shift(const float* x, float c, float* y, int64_t n) {
#ifdef GRAFT_VMATH_X86
  level() == 2 ? avx512::exp_shift_n(x, c, y, n) : avx2::exp_shift_n(x, c, y, n);
#endif
}
inline void dot_and_sum(const float* p, const float* d, int64_t n, double* pd, double* ps) {
#ifdef GRAFT_VMATH_X86
  level() == 2 ? avx512::dot_and_sum(p, d, n, pd, ps) : avx2::dot_and_sum(p, d, n, pd, ps);
#endif
}
inline void scale(float* y, float a, int64_t n) {
#ifdef GRAFT_VMATH_X86
  level() == 2 ? avx512::scale_n(y, a, n) : avx2::scale_n(y, a, n);
#endif
}
inline void sub_mul(const float* p, float c, float* d, int64_t n) {
#ifdef GRAFT_VMATH_X86
  level() == 2 ? avx512::sub_mul_n(p, c, d, n) : avx2::sub_mul_n(p, c, d, n);
#endif
}

// The same with this machine's level: what the kernels call, only when active().
inline void map(Fn f, const float* x, float* y, int64_t n) { map_at(level(), f, x, y, n); }
inline void map2(Fn2 f, const float* g, const float* x, float* y, int64_t n) {
  map2_at(level(), f, g, x, y, n);
}

}  // namespace graft::vmath
