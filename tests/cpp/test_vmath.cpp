// The vectorized float32 transcendentals (src/ops/vmath.h) against float64 libm: a dense sweep of
// [-100, 100] (every 61st float, and a 1e-3 grid), special values, the tails, and the two ISAs.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "../../src/ops/vmath.h"

using namespace graft;
using vmath::Fn;
using vmath::Fn2;

namespace {

using Map1 = std::function<void(Fn, const float*, float*, int64_t)>;
using Map2 = std::function<void(Fn2, const float*, const float*, float*, int64_t)>;
struct Isa {
  std::string name;
  Map1 map1;
  Map2 map2;
};
// Every vector implementation this CPU runs.
std::vector<Isa> isas() {
  std::vector<Isa> v;
#ifdef GRAFT_VMATH_X86
  auto add = [&](const char* name, int lv) {
    v.push_back({name,
                 [lv](Fn f, const float* x, float* y, int64_t n) { vmath::map_at(lv, f, x, y, n); },
                 [lv](Fn2 f, const float* g, const float* x, float* y, int64_t n) {
                   vmath::map2_at(lv, f, g, x, y, n);
                 }});
  };
  if (__builtin_cpu_supports("avx512f")) add("avx512", 2);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) add("avx2", 1);
#endif
  return v;
}

// The spacing of floats at |r| (denormal spacing below FLT_MIN).
double ulp_at(double r) {
  r = std::fabs(r);
  if (r < FLT_MIN) return std::ldexp(1.0, -149);
  return std::ldexp(1.0, std::ilogb(r) - 23);
}
// Error of y against the float64 reference in float ulps (0 when both are the same infinity).
double ulps(float y, double ref) {
  if (std::isinf(static_cast<float>(ref)) || std::isinf(y))
    return y == static_cast<float>(ref) ? 0 : std::numeric_limits<double>::infinity();
  return std::fabs(static_cast<double>(y) - ref) / ulp_at(ref);
}

// The sweep: every 61st float with |x| <= 100 (all exponents, both signs), and a 1e-3 grid.
std::vector<float> sweep() {
  std::vector<float> xs;
  for (uint32_t b = 0; b <= 0x42c80000u; b += 61) {  // 0x42c80000 = 100.0f
    float x;
    std::memcpy(&x, &b, 4);
    xs.push_back(x);
    xs.push_back(-x);
  }
  for (int i = -100000; i <= 100000; ++i) xs.push_back(static_cast<float>(i * 1e-3));
  return xs;
}

double ref1(Fn f, double x) {
  switch (f) {
    case Fn::Exp:
      return std::exp(x);
    case Fn::Tanh:
      return std::tanh(x);
    case Fn::Erf:
      return std::erf(x);
    case Fn::Sigmoid:
      return 1 / (1 + std::exp(-x));
    case Fn::Silu:
      return x / (1 + std::exp(-x));
    case Fn::GeluErf:
      return 0.5 * x * (1 + std::erf(x * M_SQRT1_2));
    case Fn::GeluTanh:
      return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
  }
  return 0;
}

TEST(VMath, ElementaryFunctionsWithin2UlpOfFloat64) {
  const auto all = isas();
  if (all.empty()) GTEST_SKIP() << "no AVX2+FMA or AVX-512F on this CPU";
  const std::vector<float> xs = sweep();
  std::vector<float> y(xs.size());
  for (const Isa& isa : all) {
    for (Fn f : {Fn::Exp, Fn::Tanh, Fn::Erf, Fn::Sigmoid}) {
      isa.map1(f, xs.data(), y.data(), static_cast<int64_t>(xs.size()));
      double worst = 0, worst_rel = 0;
      float at = 0;
      for (size_t i = 0; i < xs.size(); ++i) {
        const double r = ref1(f, xs[i]);
        const double u = ulps(y[i], r);
        if (u > worst) worst = u, at = xs[i];
        if (std::fabs(r) >= FLT_MIN && !std::isinf(static_cast<float>(r)))
          worst_rel = std::max(worst_rel, std::fabs(y[i] - r) / std::fabs(r));
      }
      EXPECT_LE(worst, 2.0) << isa.name << " fn " << int(f) << " worst at x = " << at;
      EXPECT_LE(worst_rel, 4e-7) << isa.name << " fn " << int(f);
      std::printf("%s fn %d: max %.3f ulp (at %.9g), max relative error %.3g\n", isa.name.c_str(),
                  int(f), worst, at, worst_rel);
    }
  }
}

// The two ISAs give the same bits over the whole sweep, and over [-110, 95] on a dense grid: exp's
// denormal range (x below -87.3) and its overflow (above 88.7), where AVX-512 scales by 2^n in one
// instruction and AVX2 in two exact-or-once-rounded multiplies.
TEST(VMath, IsasAgreeBitForBitOverTheSweep) {
  const auto all = isas();
  if (all.size() < 2) GTEST_SKIP() << "this CPU runs one vector ISA";
  std::vector<float> xs = sweep();
  for (int i = -1100000; i <= 950000; ++i) xs.push_back(static_cast<float>(i * 1e-4));
  const int64_t n = static_cast<int64_t>(xs.size());
  for (int f = 0; f <= static_cast<int>(Fn::GeluTanh); ++f) {
    std::vector<float> a(n), b(n);
    all[0].map1(Fn(f), xs.data(), a.data(), n);
    all[1].map1(Fn(f), xs.data(), b.data(), n);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0)
          << "fn " << f << " at x = " << xs[i] << ": " << a[i] << " vs " << b[i];
  }
}

// The fused kernels: against the same formula in float64, within a few ulps of the result plus a
// few ulps of the formula's largest term (1 + erf(x) cancels for negative x: so does the scalar
// float formula the kernels used before, and PyTorch's).
TEST(VMath, FusedKernelsFollowTheirFormulas) {
  const auto all = isas();
  if (all.empty()) GTEST_SKIP() << "no AVX2+FMA or AVX-512F on this CPU";
  std::vector<float> xs;
  for (int i = -20000; i <= 20000; ++i) xs.push_back(static_cast<float>(i * 1e-3));
  const int64_t n = static_cast<int64_t>(xs.size());
  std::vector<float> g(xs.size()), y(xs.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(0.5 + 0.25 * std::sin(i * 0.1));
  const double u1 = std::ldexp(1.0, -23);
  for (const Isa& isa : all) {
    for (Fn f : {Fn::Silu, Fn::GeluErf, Fn::GeluTanh}) {
      isa.map1(f, xs.data(), y.data(), n);
      for (size_t i = 0; i < xs.size(); ++i) {
        const double x = xs[i], r = ref1(f, x);
        const double tol = 4 * ulp_at(r) + 4 * u1 * std::fabs(x);
        ASSERT_LE(std::fabs(y[i] - r), tol) << isa.name << " fn " << int(f) << " x = " << x;
      }
    }
    for (Fn2 f : {Fn2::GeluErfGrad, Fn2::GeluTanhGrad, Fn2::SiluGrad, Fn2::ErfGrad}) {
      isa.map2(f, g.data(), xs.data(), y.data(), n);
      for (size_t i = 0; i < xs.size(); ++i) {
        const double x = xs[i], d = g[i];
        double r = 0, scale = 0;
        if (f == Fn2::GeluErfGrad) {
          const double cdf = 0.5 * (1 + std::erf(x * M_SQRT1_2));
          const double pdf = std::exp(-0.5 * x * x) * 0.3989422804014327;
          // (x^2 rounds to float before exp: a relative error of up to x^2 ulps in exp)
          r = d * (cdf + x * pdf), scale = std::fabs(d) * (1 + std::fabs(x * pdf) * (1 + x * x));
        } else if (f == Fn2::GeluTanhGrad) {
          const double k = 0.7978845608028654, t = std::tanh(k * (x + 0.044715 * x * x * x));
          const double b = 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
          // 1 + t and 1 - t^2 cancel for large |x|: tanh's error is amplified by the x terms
          r = d * (0.5 * (1 + t) + b),
          scale = std::fabs(d) * (1 + std::fabs(x) * k * (1 + 0.134 * x * x));
        } else if (f == Fn2::SiluGrad) {
          const double s = 1 / (1 + std::exp(-x));
          r = d * s * (1 + x * (1 - s)), scale = std::fabs(d) * (1 + std::fabs(x));
        } else {
          r = d * 1.1283791670955126 * std::exp(-x * x), scale = std::fabs(r) * 2 * x * x;
        }
        const double tol = 4 * ulp_at(r) + 4 * u1 * scale;
        ASSERT_LE(std::fabs(y[i] - r), tol) << isa.name << " fn2 " << int(f) << " x = " << x;
      }
    }
  }
}

TEST(VMath, SpecialValues) {
  const auto all = isas();
  if (all.empty()) GTEST_SKIP() << "no AVX2+FMA or AVX-512F on this CPU";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float den = std::numeric_limits<float>::denorm_min();
  const std::vector<float> x = {nan,     -nan,      inf,     -inf,   0.0f,    -0.0f,    den,
                                -den,    1e-40f,    -1e-40f, 1e-30f, FLT_MAX, -FLT_MAX, 88.72f,
                                88.73f,  89.0f,     -87.3f,  -88.0f, -100.0f, -103.9f,  -104.0f,
                                -200.0f, 9.0f,      -9.1f,   20.0f,  -50.0f,  0.625f,   0.62499f,
                                0.875f,  -0.87499f, 3.9f,    -4.0f,  4.5f,    1e10f};
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<float> y(x.size());
  for (const Isa& isa : all) {
    for (Fn f : {Fn::Exp, Fn::Tanh, Fn::Erf, Fn::Sigmoid}) {
      isa.map1(f, x.data(), y.data(), n);
      SCOPED_TRACE(isa.name + " fn " + std::to_string(int(f)));
      EXPECT_TRUE(std::isnan(y[0]) && std::isnan(y[1]));  // NaN propagates
      for (size_t i = 2; i < x.size(); ++i) {
        const double r = ref1(f, x[i]);
        EXPECT_LE(ulps(y[i], r), 2.0) << "x = " << x[i] << " y = " << y[i] << " ref = " << r;
        if (r == 0 || x[i] == 0) {  // exact zeros keep their sign (tanh(-0) = -0, erf(-0) = -0)
          EXPECT_EQ(std::signbit(y[i]), std::signbit(static_cast<float>(r))) << "x = " << x[i];
        }
      }
    }
    // the exact values the saturating ends must give
    isa.map1(Fn::Exp, x.data(), y.data(), n);
    EXPECT_EQ(y[2], inf);
    EXPECT_EQ(y[3], 0.0f);
    EXPECT_EQ(y[4], 1.0f);
    EXPECT_EQ(y[6], 1.0f);
    EXPECT_EQ(y[11], inf);
    EXPECT_EQ(y[21], 0.0f);
    EXPECT_TRUE(std::isfinite(y[13]));
    EXPECT_EQ(y[14], inf);
    isa.map1(Fn::Tanh, x.data(), y.data(), n);
    EXPECT_EQ(y[2], 1.0f);
    EXPECT_EQ(y[3], -1.0f);
    EXPECT_EQ(y[6], den);  // tanh(x) = x for tiny x, denormals included
    EXPECT_EQ(y[10], 1e-30f);
    EXPECT_EQ(y[33], 1.0f);
    isa.map1(Fn::Erf, x.data(), y.data(), n);
    EXPECT_EQ(y[2], 1.0f);
    EXPECT_EQ(y[3], -1.0f);
    EXPECT_EQ(y[31], -1.0f);
    isa.map1(Fn::Sigmoid, x.data(), y.data(), n);
    EXPECT_EQ(y[2], 1.0f);
    EXPECT_EQ(y[3], 0.0f);
    EXPECT_EQ(y[4], 0.5f);
    EXPECT_GT(y[18], 0.0f);  // sigmoid(-100) = 3.7e-44: a denormal, not 0
    // NaN in the fused kernels too
    for (Fn f : {Fn::Silu, Fn::GeluErf, Fn::GeluTanh}) {
      isa.map1(f, x.data(), y.data(), n);
      EXPECT_TRUE(std::isnan(y[0])) << isa.name << " fn " << int(f);
    }
    for (Fn2 f : {Fn2::GeluErfGrad, Fn2::GeluTanhGrad, Fn2::SiluGrad, Fn2::ErfGrad}) {
      const std::vector<float> g(x.size(), 1.0f);
      isa.map2(f, g.data(), x.data(), y.data(), n);
      EXPECT_TRUE(std::isnan(y[0])) << isa.name << " fn2 " << int(f);
    }
  }
}

// An element's value does not depend on its position: the tail (n % lanes elements, through a
// masked vector) equals the same input in the vector body; in place equals out of place; every
// ISA gives the same bits.
TEST(VMath, TailsInPlaceAndIsasAgree) {
  const auto all = isas();
  if (all.empty()) GTEST_SKIP() << "no AVX2+FMA or AVX-512F on this CPU";
  const int64_t n = 16 * 5 + 11;
  std::vector<float> x(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<float>(std::sin(i * 1.7) * (1 + i % 9));
    g[i] = static_cast<float>(std::cos(i * 0.3));
  }
  std::vector<std::vector<float>> first;
  for (const Isa& isa : all) {
    for (int f = 0; f <= static_cast<int>(Fn::GeluTanh); ++f) {
      std::vector<float> y(n), body(16 * 6), yb(16 * 6);
      isa.map1(Fn(f), x.data(), y.data(), n);
      // each element again, at every position of a body vector (as a 16-element body run)
      for (int64_t i = 0; i < n; ++i) {
        std::fill(body.begin(), body.end(), x[i]);
        isa.map1(Fn(f), body.data(), yb.data(), 16 * 6);
        for (float v : yb) ASSERT_EQ(v, y[i]) << isa.name << " fn " << f << " i = " << i;
      }
      // lengths 1 .. 40: the prefix of the same data gives the same values
      for (int64_t m = 1; m <= 40; ++m) {
        std::vector<float> ym(m);
        isa.map1(Fn(f), x.data(), ym.data(), m);
        for (int64_t i = 0; i < m; ++i) ASSERT_EQ(ym[i], y[i]) << isa.name << " n = " << m;
      }
      std::vector<float> inplace = x;
      isa.map1(Fn(f), inplace.data(), inplace.data(), n);
      ASSERT_EQ(inplace, y) << isa.name << " fn " << f;
      if (&isa == &all[0])
        first.push_back(y);
      else
        EXPECT_EQ(y, first[f]) << isa.name << " and " << all[0].name << " differ, fn " << f;
    }
    for (int f = 0; f <= static_cast<int>(Fn2::ErfGrad); ++f) {
      std::vector<float> y(n), ys(n);
      isa.map2(Fn2(f), g.data(), x.data(), y.data(), n);
      for (int64_t i = 0; i < n; ++i) {  // each element alone (all tail) equals its body value
        isa.map2(Fn2(f), g.data() + i, x.data() + i, ys.data() + i, 1);
        ASSERT_EQ(ys[i], y[i]) << isa.name << " fn2 " << f << " i = " << i;
      }
    }
  }
}

// The dispatcher (what the kernels call) runs the vector code when the CPU has it.
TEST(VMath, Dispatch) {
  if (!vmath::active()) GTEST_SKIP() << "vmath inactive (no AVX2+FMA, or GRAFT_VMATH=0)";
  const std::vector<float> x = {-1.0f, 0.0f, 0.5f, 2.0f, 30.0f};
  std::vector<float> y(x.size());
  vmath::map(Fn::Exp, x.data(), y.data(), 0);  // nothing to do
  vmath::map(Fn::Exp, x.data(), y.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_LE(ulps(y[i], std::exp(double(x[i]))), 2.0);
  vmath::map2(Fn2::ErfGrad, x.data(), x.data(), y.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(y[1], 0.0f);
  // max_of (Softmax's line maximum): every length and position of the largest element
  for (int64_t n = 1; n <= 40; ++n)
    for (int64_t at = 0; at < n; ++at) {
      std::vector<float> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::sin(i * 2.3) - 3);
      v[at] = 1.5f;
      ASSERT_EQ(vmath::max_of(v.data(), n), 1.5f) << "n = " << n << " at " << at;
    }
}

// The row kernels (Note [row sums in double]): lengths 0 .. 70, 197 and 1000, against float64
// sums of the same float32 values; the elementwise parts equal map / plain float arithmetic; both
// ISAs give the same bits.
TEST(VMath, RowKernelsSumInDoubleAndIsasAgree) {
#ifdef GRAFT_VMATH_X86
  std::vector<int> levels;
  if (__builtin_cpu_supports("avx512f")) levels.push_back(2);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) levels.push_back(1);
  if (levels.empty()) GTEST_SKIP() << "no AVX2+FMA or AVX-512F on this CPU";
  for (int64_t n : {0, 1, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 64, 70, 197, 1000}) {
    std::vector<float> x(n), p(n), d(n);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(std::sin(i * 0.77) * 6);
      p[i] = static_cast<float>(0.5 + 0.5 * std::cos(i * 0.41));
      d[i] = static_cast<float>(std::sin(i * 1.3) * 3);
    }
    const float c = 2.5f;
    std::vector<float> ref_y(n);
    double ref_sum = 0, ref_pd = 0, ref_ps = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float t = x[i] - c;
      vmath::map_at(levels[0], Fn::Exp, &t, &ref_y[i], 1);
      ref_sum += ref_y[i];
      ref_pd += double(p[i]) * double(d[i]);
      ref_ps += p[i];
    }
    std::vector<std::vector<float>> first;
    double first_sum = 0, first_pd = 0, first_ps = 0;
    for (int lv : levels) {
      SCOPED_TRACE("level " + std::to_string(lv) + ", n = " + std::to_string(n));
      // e: one guard element past n that the masked tail must leave alone
      std::vector<float> y = x, s = x, dm = d, e(n + 1, 7.0f);
      double sum, pd, ps;
      if (lv == 2) {
        sum = vmath::avx512::exp_shift_sum(y.data(), c, y.data(), n);  // in place
        vmath::avx512::exp_shift_n(x.data(), c, e.data(), n);
        vmath::avx512::dot_and_sum(p.data(), d.data(), n, &pd, &ps);
        vmath::avx512::scale_n(s.data(), 0.3f, n);
        vmath::avx512::sub_mul_n(p.data(), 0.7f, dm.data(), n);
      } else {
        sum = vmath::avx2::exp_shift_sum(y.data(), c, y.data(), n);
        vmath::avx2::exp_shift_n(x.data(), c, e.data(), n);
        vmath::avx2::dot_and_sum(p.data(), d.data(), n, &pd, &ps);
        vmath::avx2::scale_n(s.data(), 0.3f, n);
        vmath::avx2::sub_mul_n(p.data(), 0.7f, dm.data(), n);
      }
      ASSERT_EQ(y, ref_y);  // exp(x - c), element by element as map computes it
      ASSERT_EQ(e[n], 7.0f) << "exp_shift wrote past n";
      e.pop_back();
      ASSERT_EQ(e, ref_y);  // the same without the sum
      EXPECT_NEAR(sum, ref_sum, 1e-12 * (1 + ref_sum));
      EXPECT_NEAR(pd, ref_pd, 1e-12 * (1 + std::fabs(ref_pd)));
      EXPECT_NEAR(ps, ref_ps, 1e-12 * (1 + ref_ps));
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(s[i], x[i] * 0.3f);
        ASSERT_EQ(dm[i], p[i] * (d[i] - 0.7f));
      }
      if (lv == levels[0]) {
        first = {y, s, dm};
        first_sum = sum, first_pd = pd, first_ps = ps;
      } else {
        EXPECT_EQ(sum, first_sum);
        EXPECT_EQ(pd, first_pd);
        EXPECT_EQ(ps, first_ps);
        EXPECT_EQ(y, first[0]);
      }
    }
  }
#else
  GTEST_SKIP() << "not x86";
#endif
}

}  // namespace
