// The float32 vector math of vmath.h, written once over a lane type: included (twice) by vmath.h
// inside a namespace that defines V (the float vector), M (its comparison mask), kLanes, the
// attribute macro GRAFT_VM (target ISA + inline) and the primitives set1, load, store, add, sub,
// mul, div, fma (a * b + c, one rounding), min, max (both return the second operand when either is
// NaN, as x86 does), lt, ge (ordered: false on NaN), sel (m ? t : f), abs, xor_sign (x with the
// sign bit of s flipped in), round (to nearest even) and ldexp2 (x * 2^n for an integral float n
// in [-150, 128] and x in [0.7, 1.5], rounded once), load_n / store_n / keep_n (the first k <
// kLanes lanes; the others not read or written / zero), and for double sums VD (kLanes / 2 doubles)
// with zero_d, add_d, mul_d, lo_d / hi_d (a V's low / high half widened) and store_d. No #pragma
// once: each inclusion makes its own namespace's copy.
//
// Every function is a fixed sequence of IEEE operations, so the AVX-512 and AVX2 copies give the
// same bits, and an element's value does not depend on its position (the tails go through the
// same code on a masked vector).

// exp(x): x = n ln2 + r, |r| <= ln2/2 (Cody-Waite with FMA), exp(r) by Cephes' degree-7
// polynomial, scaled by 2^n as two exact-or-once-rounded halves so that results in the denormal
// range (x down to -103.97) round once and n = 128 does not overflow the exponent field. x is
// clamped to [-104, 88.8] first (min/max keep NaN, which then propagates through the polynomial).
GRAFT_VM V v_exp(V x) {
  x = min(set1(88.8f), max(set1(-104.0f), x));
  const V n = round(mul(x, set1(1.44269504088896341f)));
  V r = fma(n, set1(-0.693145751953125f), x);
  r = fma(n, set1(-1.428606765330187045e-06f), r);
  V p = set1(1.9875691500E-4f);
  p = fma(p, r, set1(1.3981999507E-3f));
  p = fma(p, r, set1(8.3334519073E-3f));
  p = fma(p, r, set1(4.1665795894E-2f));
  p = fma(p, r, set1(1.6666665459E-1f));
  p = fma(p, r, set1(5.0000001201E-1f));
  p = add(fma(p, mul(r, r), r), set1(1.0f));  // 1 + (r + r^2 P(r)): one rounding near 1
  return ldexp2(p, n);
}

// tanh(x), computed for |x| and given x's sign: |x| < 0.625: Cephes' odd polynomial
// x + x^3 P(x^2); else 1 - 2 / (exp(2|x|) + 1) (exp overflows to inf for |x| > 44, giving exactly
// 1; NaN propagates through exp).
GRAFT_VM V v_tanh(V x) {
  const V a = abs(x);
  const V z = mul(a, a);
  V p = set1(-5.70498872745E-3f);
  p = fma(p, z, set1(2.06390887954E-2f));
  p = fma(p, z, set1(-5.37397155531E-2f));
  p = fma(p, z, set1(1.33314422036E-1f));
  p = fma(p, z, set1(-3.33332819422E-1f));
  const V small = fma(mul(p, z), a, a);
  const V e = v_exp(add(a, a));
  const V big = sub(set1(1.0f), div(set1(2.0f), add(e, set1(1.0f))));
  return xor_sign(sel(lt(a, set1(0.625f)), small, big), x);  // tanh(-0) = -0
}

// erf(x): |x| < 0.875: x + x P(x^2) (degree 5); else 1 - exp(-x^2) R(|x|), R a degree-9 fit of
// erfcx on [0.875, 4] (|x| clamped to 4: erf rounds to 1 in float from 3.92 on), with x's sign.
// Both fits were made for this file (weighted least squares, numpy); errors in the test.
GRAFT_VM V v_erf(V x) {
  const V a = abs(x);
  const V z = mul(x, x);
  V p = set1(-6.235155743e-04f);
  p = fma(p, z, set1(5.038737785e-03f));
  p = fma(p, z, set1(-2.679630555e-02f));
  p = fma(p, z, set1(1.128260791e-01f));
  p = fma(p, z, set1(-3.761256933e-01f));
  p = fma(p, z, set1(1.283791661e-01f));
  const V small = fma(x, p, x);    // x + x (2/sqrt(pi) - 1 + ...): one rounding of a sum near x
  const V b = min(set1(4.0f), a);  // NaN: the comparison below is false and picks small (NaN)
  const V t = sub(b, set1(2.4375f));
  V q = set1(-3.691327220e-05f);
  q = fma(q, t, set1(-8.540890121e-05f));
  q = fma(q, t, set1(-1.801942853e-04f));
  q = fma(q, t, set1(2.606878406e-04f));
  q = fma(q, t, set1(-6.813412765e-04f));
  q = fma(q, t, set1(2.797249705e-03f));
  q = fma(q, t, set1(-8.647208102e-03f));
  q = fma(q, t, set1(2.648237161e-02f));
  q = fma(q, t, set1(-7.756455243e-02f));
  q = fma(q, t, set1(2.155524492e-01f));
  const V big = sub(set1(1.0f), mul(v_exp(mul(b, sub(set1(0.0f), b))), q));
  return sel(ge(a, set1(0.875f)), xor_sign(big, x), small);
}

// sigmoid(x) = 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below (no overflow, and tiny results
// for very negative x keep their precision): one exp(-|x|) and one division either way. The
// rounding of 1 + e (up to 1 ulp of the result) is corrected: h + l = 1 + e exactly (Fast2Sum),
// q = num / h, and num / (h + l) = q (1 - l / h), with 1 / h = q (x >= 0) or 1 - q (x < 0).
GRAFT_VM V v_sigmoid(V x) {
  const V one = set1(1.0f);
  const V e = v_exp(sub(set1(0.0f), abs(x)));
  const V h = add(one, e);
  const V l = sub(e, sub(h, one));
  const M pos = ge(x, set1(0.0f));
  const V q = div(sel(pos, one, e), h);
  const V inv_h = sel(pos, q, sub(one, q));
  return fma(sub(set1(0.0f), mul(q, l)), inv_h, q);
}

// The fused kernels, with the formulas of unary.cpp's scalar versions.
GRAFT_VM V v_gelu_erf(V x) {
  const V h = mul(set1(0.5f), x);
  return mul(h, add(set1(1.0f), v_erf(mul(x, set1(0.70710678118654752f)))));
}
GRAFT_VM V v_gelu_tanh_inner(V x) {  // sqrt(2/pi) (x + 0.044715 x^3)
  return mul(set1(0.7978845608028654f), add(x, mul(mul(mul(set1(0.044715f), x), x), x)));
}
GRAFT_VM V v_gelu_tanh(V x) {
  const V h = mul(set1(0.5f), x);
  return mul(h, add(set1(1.0f), v_tanh(v_gelu_tanh_inner(x))));
}
GRAFT_VM V v_gelu_erf_grad(V g, V x) {
  const V cdf = mul(set1(0.5f), add(set1(1.0f), v_erf(mul(x, set1(0.70710678118654752f)))));
  const V pdf = mul(v_exp(mul(mul(set1(-0.5f), x), x)), set1(0.3989422804014327f));
  return mul(g, add(cdf, mul(x, pdf)));
}
GRAFT_VM V v_gelu_tanh_grad(V g, V x) {
  const V t = v_tanh(v_gelu_tanh_inner(x));
  const V one = set1(1.0f);
  const V a = mul(set1(0.5f), add(one, t));
  V b = mul(mul(mul(set1(0.5f), x), sub(one, mul(t, t))), set1(0.7978845608028654f));
  b = mul(b, add(one, mul(mul(set1(3 * 0.044715f), x), x)));
  return mul(g, add(a, b));
}
GRAFT_VM V v_silu(V x) { return mul(x, v_sigmoid(x)); }
GRAFT_VM V v_silu_grad(V g, V x) {
  const V s = v_sigmoid(x);
  return mul(mul(g, s), add(set1(1.0f), mul(x, sub(set1(1.0f), s))));
}
GRAFT_VM V v_erf_grad(V g, V x) {
  return mul(mul(g, set1(1.1283791670955126f)), v_exp(mul(sub(set1(0.0f), x), x)));
}

GRAFT_VM V apply1(Fn f, V x) {
  switch (f) {
    case Fn::Exp:
      return v_exp(x);
    case Fn::Tanh:
      return v_tanh(x);
    case Fn::Erf:
      return v_erf(x);
    case Fn::Sigmoid:
      return v_sigmoid(x);
    case Fn::Silu:
      return v_silu(x);
    case Fn::GeluErf:
      return v_gelu_erf(x);
    case Fn::GeluTanh:
      return v_gelu_tanh(x);
  }
  return x;
}
GRAFT_VM V apply2(Fn2 f, V g, V x) {
  switch (f) {
    case Fn2::GeluErfGrad:
      return v_gelu_erf_grad(g, x);
    case Fn2::GeluTanhGrad:
      return v_gelu_tanh_grad(g, x);
    case Fn2::SiluGrad:
      return v_silu_grad(g, x);
    case Fn2::ErfGrad:
      return v_erf_grad(g, x);
  }
  return x;
}

// y[i] = f(x[i]); the last n % kLanes elements through a masked vector (zeros past n).
template <Fn f>
GRAFT_VM_LOOP void map1(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, apply1(f, load(x + i)));
  if (i < n) store_n(y + i, apply1(f, load_n(x + i, n - i)), n - i);
}
template <Fn2 f>
GRAFT_VM_LOOP void map2(const float* g, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, apply2(f, load(g + i), load(x + i)));
  if (i < n) store_n(y + i, apply2(f, load_n(g + i, n - i), load_n(x + i, n - i)), n - i);
}

// max over x[0, n) (n >= 1); NaN elements may or may not win (the Softmax that uses it turns any
// NaN of a line into NaN outputs either way). Order-independent otherwise.
GRAFT_VM_LOOP float max_n(const float* x, int64_t n) {
  V m = set1(x[0]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) m = max(m, load(x + i));
  float b[kLanes];
  store(b, m);
  float r = b[0];
  for (int64_t k = 1; k < kLanes; ++k) r = b[k] > r ? b[k] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// Note [row sums in double]
// A row's sums (softmax's normalizer, attention's rowsum(P * dP)) are taken in double, as the
// scalar loops did, in 16 partial sums: element i goes to partial i % 16 (the row's last, partial
// vector through masked loads, its missing lanes adding +0), and the partials are added at the end
// in a fixed tree, ((p0 + p1) + (p2 + p3)) + ..., shorter than a chain of 15 dependent adds (each
// row pays it once, a real share of a 197-key row). Both ISAs keep the same 16 partials (AVX-512:
// two 8-double vectors per 16 elements; AVX2: four 4-double vectors), so they give the same bits,
// and a row's result does not depend on which thread ran it.
constexpr int kSumLanes = 16;
constexpr int kSumVecs = 2 * kSumLanes / static_cast<int>(kLanes);  // VDs per 16 elements
GRAFT_VM_LOOP double sum_partials(const VD* acc) {
  double p[kSumLanes];
  for (int v = 0; v < kSumVecs; ++v) store_d(p + v * (kLanes / 2), acc[v]);
  for (int w = 1; w < kSumLanes; w *= 2)
    for (int l = 0; l < kSumLanes; l += 2 * w) p[l] += p[l + w];
  return p[0];
}
// acc's two VDs for the 16-element group at row offset i (i a multiple of kLanes) += e's halves.
GRAFT_VM void add_halves(VD* acc, int64_t i, V e) {
  const int h = static_cast<int>(i % kSumLanes / kLanes);
  acc[2 * h] = add_d(acc[2 * h], lo_d(e));
  acc[2 * h + 1] = add_d(acc[2 * h + 1], hi_d(e));
}

GRAFT_VM_LOOP double exp_shift_sum(const float* x, float c, float* y, int64_t n) {
  VD acc[kSumVecs];
  for (VD& a : acc) a = zero_d();
  const V vc = set1(c);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const V e = v_exp(sub(load(x + i), vc));
    store(y + i, e);
    add_halves(acc, i, e);
  }
  if (i < n) {  // the rest: the same exp on a masked vector, its missing lanes adding +0
    const V e = keep_n(v_exp(sub(load_n(x + i, n - i), vc)), n - i);
    store_n(y + i, e, n - i);
    add_halves(acc, i, e);
  }
  return sum_partials(acc);
}

// y[i] = exp(x[i] - c) without the sum (attention's backward, which recomputes P from the saved
// log-sum-exp and sums it with dot_and_sum).
GRAFT_VM_LOOP void exp_shift_n(const float* x, float c, float* y, int64_t n) {
  const V vc = set1(c);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, v_exp(sub(load(x + i), vc)));
  if (i < n) store_n(y + i, v_exp(sub(load_n(x + i, n - i), vc)), n - i);
}

// ad / as (dot_and_sum's partials) for the 16-element group at row offset i += vp * vd / vp.
GRAFT_VM void add_dot(VD* ad, VD* as, int64_t i, V vp, V vd) {
  const int h = static_cast<int>(i % kSumLanes / kLanes);
  ad[2 * h] = add_d(ad[2 * h], mul_d(lo_d(vp), lo_d(vd)));
  ad[2 * h + 1] = add_d(ad[2 * h + 1], mul_d(hi_d(vp), hi_d(vd)));
  add_halves(as, i, vp);
}
GRAFT_VM_LOOP void dot_and_sum(const float* p, const float* d, int64_t n, double* pd, double* ps) {
  VD ad[kSumVecs], as[kSumVecs];
  for (int v = 0; v < kSumVecs; ++v) ad[v] = as[v] = zero_d();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) add_dot(ad, as, i, load(p + i), load(d + i));
  if (i < n)  // missing lanes: +0 * +0
    add_dot(ad, as, i, load_n(p + i, n - i), load_n(d + i, n - i));
  *pd = sum_partials(ad);
  *ps = sum_partials(as);
}

GRAFT_VM_LOOP void scale_n(float* y, float a, int64_t n) {
  const V va = set1(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, mul(load(y + i), va));
  for (; i < n; ++i) y[i] *= a;
}

GRAFT_VM_LOOP void sub_mul_n(const float* p, float c, float* d, int64_t n) {
  const V vc = set1(c);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(d + i, mul(load(p + i), sub(load(d + i), vc)));
  for (; i < n; ++i) d[i] = p[i] * (d[i] - c);
}
