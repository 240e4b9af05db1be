// Normalizations: LayerNormalization and BatchNormalization, with graft's fused gradient kernels
// LayerNormGrad and BatchNormGrad. Statistics are accumulated in double.
#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- LayerNormalization (opset 17) --------------------------------------------------------------
// The attributes of LayerNormalization and its gradient.
struct LayerNormAttrs {
  int64_t axis = -1;  // as given (normalize_axis_scalar_ok for the input's rank)
  double epsilon = 1e-5;
};
LayerNormAttrs layernorm_attrs(const Node& n) {
  return {n.attrs.get_int("axis", -1, n.label()), n.attrs.get_float("epsilon", 1e-5, n.label())};
}
std::shared_ptr<const void> prepare_layernorm(const Node& n) {
  return prepared(layernorm_attrs(n));
}
// Normalizes over dims [axis, rank). Mean / InvStdDev outputs have the normalized dims set to 1
// and the stash dtype (float32 unless stash_type says otherwise).
void infer_layernorm(InferCtx& c) {
  require_float(c, 0);
  const Shape& s = c.shape(0);
  const int ax = normalize_axis_scalar_ok(layernorm_attrs(c.node()).axis,
                                          static_cast<int>(s.size()), c.node());
  int64_t outer, n, inner;
  split3(s, ax, static_cast<int>(s.size()), outer, n, inner);
  c.check(numel(c.shape(1)) == n, "Scale has " + std::to_string(numel(c.shape(1))) +
                                      " elements but the normalized size is " + std::to_string(n));
  if (c.has_in(2)) c.check(numel(c.shape(2)) == n, "B does not match the normalized size");
  for (int i = 1; i < 3; ++i)
    if (c.has_in(i) && c.dtype(i) != c.dtype(0))
      c.error(ErrorKind::InvalidModel, std::string(i == 1 ? "Scale" : "B") + " has dtype " +
                                           dtype_name(c.dtype(i)) + " but X has " +
                                           dtype_name(c.dtype(0)));
  c.set_out(0, c.dtype(0), s);
  Shape st = s;
  for (size_t i = ax; i < st.size(); ++i) st[i] = 1;
  int64_t stash = c.attr_int("stash_type", 1);
  DType sd = stash == 1 ? DType::F32 : stash == 11 ? DType::F64 : c.dtype(0);
  c.set_out(1, sd, st);
  c.set_out(2, sd, st);
}
template <class T>
void ln_stats(const T* x, int64_t n, double eps, double& mean, double& inv) {
  // 8 partial sums in a fixed order (sum8): vectorizable, and the same for any thread count.
  double m = sum8(n, [&](int64_t k) { return static_cast<double>(x[k]); });
  m /= static_cast<double>(n ? n : 1);
  double v = sum8(n, [&](int64_t k) {
    const double d = x[k] - m;
    return d * d;
  });
  v /= static_cast<double>(n ? n : 1);
  mean = m;
  inv = 1.0 / std::sqrt(v + eps);
}
void layernorm_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  const int ax = normalize_axis_scalar_ok(c.attrs<LayerNormAttrs>().axis, x.rank(), c.node);
  int64_t outer, n, inner;
  split3(x.shape(), ax, x.rank(), outer, n, inner);
  const double eps = c.attrs<LayerNormAttrs>().epsilon;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    const T* sc = c.in(1).data<T>();
    const T* bi = c.has_in(2) ? c.in(2).data<T>() : nullptr;
    T* py = c.out(0).data<T>();
    Tensor* stat[3] = {nullptr, c.has_out(1) ? &c.out(1) : nullptr,
                       c.has_out(2) ? &c.out(2) : nullptr};
    parallel_for(outer, 8 * n, [&](int, int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        double m, inv;
        ln_stats(px + o * n, n, eps, m, inv);
        const T* xr = px + o * n;
        T* yr = py + o * n;
        if (bi)
          for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>((xr[k] - m) * inv * sc[k] + bi[k]);
        else
          for (int64_t k = 0; k < n; ++k) yr[k] = static_cast<T>((xr[k] - m) * inv * sc[k]);
        for (int j = 1; j <= 2; ++j)
          if (stat[j]) {
            double v = j == 1 ? m : inv;
            if (stat[j]->dtype() == DType::F32)
              stat[j]->data<float>()[o] = static_cast<float>(v);
            else
              stat[j]->data<double>()[o] = v;
          }
      }
    });
  });
}
// LayerNormGrad(dy, x, scale) -> dx, dscale, dbias. Statistics are recomputed from x (cheaper in
// memory than stashing them, and exact in float64).
void infer_layernorm_grad(InferCtx& c) {
  c.set_out(0, c.dtype(1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), c.shape(2));
}
void layernorm_grad_kernel(KernelCtx& c) {
  const Tensor& x = c.in(1);
  const int ax = normalize_axis_scalar_ok(c.attrs<LayerNormAttrs>().axis, x.rank(), c.node);
  int64_t outer, n, inner;
  split3(x.shape(), ax, x.rank(), outer, n, inner);
  const double eps = c.attrs<LayerNormAttrs>().epsilon;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T *pd = c.in(0).data<T>(), *px = x.data<T>(), *sc = c.in(2).data<T>();
    T* dx = c.has_out(0) ? c.out(0).data<T>() : nullptr;
    // Pass 1, parallel over rows: each row's statistics and dx. Pass 2, parallel over columns:
    // dscale and dbias, each column summed over the rows in row order (as a single thread would).
    std::vector<double> stats(2 * outer);
    parallel_for(outer, 12 * n, [&](int, int64_t o0, int64_t o1) {
      for (int64_t o = o0; o < o1; ++o) {
        const T* xr = px + o * n;
        const T* dr = pd + o * n;
        double m, inv;
        ln_stats(xr, n, eps, m, inv);
        stats[2 * o] = m;
        stats[2 * o + 1] = inv;
        if (!dx) continue;
        double a = 0, b = 0;  // mean(dy*scale), mean(dy*scale*xhat)
        for (int64_t k = 0; k < n; ++k) {
          double xh = (xr[k] - m) * inv, g = static_cast<double>(dr[k]) * sc[k];
          a += g;
          b += g * xh;
        }
        a /= static_cast<double>(n);
        b /= static_cast<double>(n);
        T* dxr = dx + o * n;
        for (int64_t k = 0; k < n; ++k) {
          double xh = (xr[k] - m) * inv;
          dxr[k] = static_cast<T>(inv * (static_cast<double>(dr[k]) * sc[k] - a - xh * b));
        }
      }
    });
    T* ds = c.has_out(1) ? c.out(1).data<T>() : nullptr;
    T* db = c.has_out(2) ? c.out(2).data<T>() : nullptr;
    if (!ds && !db) return;
    parallel_blocks(
        n, 4 * outer,
        [&](int, int64_t k0, int64_t k1) {
          std::vector<double> s(k1 - k0, 0.0), b(k1 - k0, 0.0);
          for (int64_t o = 0; o < outer; ++o) {
            const T* xr = px + o * n;
            const T* dr = pd + o * n;
            const double m = stats[2 * o], inv = stats[2 * o + 1];
            for (int64_t k = k0; k < k1; ++k) {
              s[k - k0] += dr[k] * ((xr[k] - m) * inv);
              b[k - k0] += dr[k];
            }
          }
          for (int64_t k = k0; k < k1; ++k) {
            if (ds) ds[k] = static_cast<T>(s[k - k0]);
            if (db) db[k] = static_cast<T>(b[k - k0]);
          }
        },
        16);
  });
}
void grad_layernorm(GradBuilder& g) {
  const Node& n = g.node();
  Attrs a;
  const LayerNormAttrs na = layernorm_attrs(n);
  a.set_int("axis", normalize_axis_scalar_ok(na.axis, static_cast<int>(g.shape(g.x(0)).size()), n));
  a.set_float("epsilon", na.epsilon);
  auto outs = g.emit("LayerNormGrad", {g.dy(0), g.x(0), g.x(1)}, a, 3, "graft");
  if (g.needs(0)) g.set_dx(0, outs[0]);
  if (g.needs(1)) g.set_dx(1, outs[1]);
  if (n.inputs.size() > 2 && n.inputs[2] >= 0 && g.needs(2)) g.set_dx(2, outs[2]);
}

// ---- BatchNormalization (opset 15)
// ----------------------------------------------------------------- X [N, C, D...]; scale, B,
// input_mean, input_var [C]. training_mode = 0: normalize with the given statistics. training_mode
// = 1: with the batch's (biased variance), and outputs 1 and 2 are the updated running statistics,
// as PyTorch updates them: running * momentum + batch * (1 - momentum) with the batch's unbiased
// variance (ONNX's momentum is 1 - PyTorch's). Outputs 3 and 4 are graft's own, training mode
// only: the batch mean and biased variance, [C], which the gradient reads instead of recomputing
// them from X (as PyTorch saves save_mean / save_invstd); the gradient rule adds them.
struct BnAttrs {
  double epsilon = 1e-5, momentum = 0.9;
  bool training = false;     // training_mode
  bool batch_stats = false;  // BatchNormGrad: mean and var are the batch's (the forward's 3, 4)
  // Channel-blocked operands (kBlockedAttr, Note [channel-blocked values]): bit i input i,
  // bit 16 + j output j.
  uint32_t blocked = 0;
};
BnAttrs bn_attrs(const Node& n) {
  const std::string where = n.label();
  return {n.attrs.get_float("epsilon", 1e-5, where), n.attrs.get_float("momentum", 0.9, where),
          n.attrs.get_int("training_mode", 0, where) != 0,
          n.attrs.get_int("batch_stats", 0, where) != 0,
          static_cast<uint32_t>(n.attrs.get_int(kBlockedAttr, 0, where))};
}
std::shared_ptr<const void> prepare_bn(const Node& n) { return prepared(bn_attrs(n)); }
void infer_batchnorm(InferCtx& c) {
  const DType dt = float_or_bf16(c, 0);  // Note [bf16 activations]: then the rest is float32
  const Shape& s = c.shape(0);
  c.check(s.size() >= 2, "X must be [N, C, ...]");
  for (int i = 1; i < 5; ++i) {
    c.check(c.shape(i) == Shape{s[1]}, "scale, B, mean and var must have shape [C]");
    if (c.dtype(i) != dt) c.error(ErrorKind::Unsupported, "mixed dtypes are not supported");
  }
  const bool train = bn_attrs(c.node()).training;
  if (!train && (c.has_out(1) || c.has_out(2) || c.has_out(3) || c.has_out(4)))
    c.error(ErrorKind::InvalidModel, "running statistics are outputs in training mode only");
  c.set_out(0, dt, s);
  for (int i = 1; i < 5; ++i) c.set_out(i, dt, {s[1]});
}
struct BnView {
  int64_t N, C, S;  // batch, channels, spatial elements per channel and image
};
BnView bn_view(const Shape& s) {
  BnView v{s[0], s[1], 1};
  for (size_t i = 2; i < s.size(); ++i) v.S *= s[i];
  return v;
}
// Per channel: the batch mean and biased variance (two passes, in double). Parallel over channels.
// X: `const T*`, or Bf16Ptr (Note [bf16 activations]) here and below.
template <class X>
void bn_batch_stats(X x, BnView v, std::vector<double>& mean, std::vector<double>& var) {
  mean.assign(v.C, 0.0);
  var.assign(v.C, 0.0);
  const double n = static_cast<double>(v.N * v.S);
  parallel_for(v.C, 2 * v.N * v.S, [&](int, int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      double m = 0, q = 0;
      for (int64_t b = 0; b < v.N; ++b) {
        const auto xp = x + (b * v.C + ch) * v.S;
        m += sum8(v.S, [&](int64_t i) { return static_cast<double>(xp[i]); });
      }
      m /= n ? n : 1;
      for (int64_t b = 0; b < v.N; ++b) {
        const auto xp = x + (b * v.C + ch) * v.S;
        q += sum8(v.S, [&](int64_t i) {
          const double d = xp[i] - m;
          return d * d;
        });
      }
      mean[ch] = m;
      var[ch] = q / (n ? n : 1);
    }
  });
}
// ---- channel-blocked operands (Note [channel-blocked values], src/plan/layout.cpp)
// float32 [N, C, S] stored as [N, C/16, S, 16]: the loops below walk a block of 16 channels with
// its lanes innermost (contiguous when blocked; a plain operand beside a blocked one is read with
// a stride of S between lanes). The statistics are the same sums in double as above, each lane's
// summed in order.
template <bool B>
GRAFT_INLINE int64_t at16(int64_t b, int64_t cb, int64_t s, int64_t l, int64_t CB, int64_t S) {
  if constexpr (B)
    return ((b * CB + cb) * S + s) * 16 + l;
  else
    return ((b * CB + cb) * 16 + l) * S + s;
}
// Calls f.template operator()<A, B, C>() with the three flags as constants.
template <class F>
void with_layouts(bool a, bool b, bool c, F&& f) {
  auto two = [&]<bool A>() {
    auto one = [&]<bool B>() {
      if (c)
        f.template operator()<A, B, true>();
      else
        f.template operator()<A, B, false>();
    };
    if (b)
      one.template operator()<true>();
    else
      one.template operator()<false>();
  };
  if (a)
    two.template operator()<true>();
  else
    two.template operator()<false>();
}
// One block's batch mean and biased variance, x blocked.
template <class X>
GRAFT_INLINE void bn_stats16_impl(X x, BnView v, int64_t cb, double* m, double* q) {
  const int64_t CB = v.C / 16;
  const double n = static_cast<double>(v.N * v.S);
  for (int l = 0; l < 16; ++l) m[l] = q[l] = 0;
  for (int64_t b = 0; b < v.N; ++b) {
    const auto xb = x + (b * CB + cb) * v.S * 16;
    for (int64_t s = 0; s < v.S; ++s)
      for (int l = 0; l < 16; ++l) m[l] += xb[s * 16 + l];
  }
  for (int l = 0; l < 16; ++l) m[l] /= n ? n : 1;
  for (int64_t b = 0; b < v.N; ++b) {
    const auto xb = x + (b * CB + cb) * v.S * 16;
    for (int64_t s = 0; s < v.S; ++s)
      for (int l = 0; l < 16; ++l) {
        const double d = xb[s * 16 + l] - m[l];
        q[l] += d * d;
      }
  }
  for (int l = 0; l < 16; ++l) q[l] /= n ? n : 1;
}
GRAFT_ISA_CLONES void bn_stats16(const float* x, BnView v, int64_t cb, double* m, double* q) {
  bn_stats16_impl(x, v, cb, m, q);
}
GRAFT_ISA_CLONES void bn_stats16(Bf16Ptr x, BnView v, int64_t cb, double* m, double* q) {
  bn_stats16_impl(x, v, cb, m, q);
}
template <class X>
void bn_batch_stats16(X x, BnView v, std::vector<double>& mean, std::vector<double>& var) {
  mean.assign(v.C, 0.0);
  var.assign(v.C, 0.0);
  parallel_for(v.C / 16, 2 * 16 * v.N * v.S, [&](int, int64_t c0, int64_t c1) {
    for (int64_t cb = c0; cb < c1; ++cb) bn_stats16(x, v, cb, &mean[cb * 16], &var[cb * 16]);
  });
}
// y = (x - mu) * a + bi per channel, for images and blocks [p0, p1) of N * C/16.
template <bool XB, bool YB, class X>
GRAFT_INLINE void bn_apply16_impl(X x, BnView v, int64_t p0, int64_t p1, const float* a,
                                  const float* mu, const float* bi, float* y) {
  const int64_t CB = v.C / 16;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = p / CB, cb = p % CB;
    const float *ac = a + cb * 16, *mc = mu + cb * 16, *bc = bi + cb * 16;
    for (int64_t s = 0; s < v.S; ++s)
      for (int l = 0; l < 16; ++l)
        y[at16<YB>(b, cb, s, l, CB, v.S)] =
            (x[at16<XB>(b, cb, s, l, CB, v.S)] - mc[l]) * ac[l] + bc[l];
  }
}
GRAFT_ISA_CLONES void bn_apply16_bb(const float* x, BnView v, int64_t p0, int64_t p1,
                                    const float* a, const float* mu, const float* bi, float* y) {
  bn_apply16_impl<true, true>(x, v, p0, p1, a, mu, bi, y);
}
GRAFT_ISA_CLONES void bn_apply16_bb(Bf16Ptr x, BnView v, int64_t p0, int64_t p1, const float* a,
                                    const float* mu, const float* bi, float* y) {
  bn_apply16_impl<true, true>(x, v, p0, p1, a, mu, bi, y);
}
// A channel's dX = k1 * dY + k2 * (X - mean) + k0 (BatchNormGrad, below), from its sums over n
// elements: sdy = sum dY, sdyx = inv * sum dY * (X - mean).
struct BnDx {
  double k1, k2, k0;
};
BnDx bn_dx_coefficients(double scale, double inv, double sdy, double sdyx, double n, bool train) {
  const double k1 = scale * inv;
  return {k1, train && n ? -k1 * inv * sdyx / n : 0.0, train && n ? -k1 * sdy / n : 0.0};
}
// BatchNormGrad for the channels of blocks [c0, c1): sums, then dX (when wanted).
struct BnGrad16 {
  BnView v;
  const float *dy, *sc;  // X is passed beside it: const float* or Bf16Ptr
  const double *mean, *var;
  double eps;
  bool train;
  float *dx, *dscale, *dbias;  // each may be null
  // Note [bf16 writers]: dX in bfloat16 instead of dx (channel-blocked dY, X and dX only), or null
  uint16_t* dx16 = nullptr;
};
// dX's value at one element: the one expression of every layout and output type.
GRAFT_INLINE float bn_dx_value(float t1, float dy, float t2, float x, float tm, float t0) {
  return t1 * dy + t2 * (x - tm) + t0;
}
template <bool DB, bool XB, bool OB, class X>
GRAFT_INLINE void bn_grad16_impl(const BnGrad16& k, X x, int64_t c0, int64_t c1) {
  const BnView v = k.v;
  const int64_t CB = v.C / 16;
  const double n = static_cast<double>(v.N * v.S);
  for (int64_t cb = c0; cb < c1; ++cb) {
    double m[16], sdy[16] = {}, sdyx[16] = {};
    for (int l = 0; l < 16; ++l) m[l] = k.mean[cb * 16 + l];
    for (int64_t b = 0; b < v.N; ++b)
      for (int64_t s = 0; s < v.S; ++s)
        for (int l = 0; l < 16; ++l) {
          const double d = k.dy[at16<DB>(b, cb, s, l, CB, v.S)];
          sdy[l] += d;
          sdyx[l] += d * (x[at16<XB>(b, cb, s, l, CB, v.S)] - m[l]);
        }
    float t1[16], t2[16], t0[16], tm[16];
    for (int l = 0; l < 16; ++l) {
      const int64_t ch = cb * 16 + l;
      const double inv = 1.0 / std::sqrt(k.var[ch] + k.eps);
      sdyx[l] *= inv;
      if (k.dscale) k.dscale[ch] = static_cast<float>(sdyx[l]);
      if (k.dbias) k.dbias[ch] = static_cast<float>(sdy[l]);
      const BnDx d = bn_dx_coefficients(k.sc[ch], inv, sdy[l], sdyx[l], n, k.train);
      t1[l] = static_cast<float>(d.k1);
      t2[l] = static_cast<float>(d.k2);
      t0[l] = static_cast<float>(d.k0);
      tm[l] = static_cast<float>(m[l]);
    }
    if constexpr (DB && XB && OB) {
      if (k.dx16) {  // a block of positions at a time, rounded as it is stored
        constexpr int64_t kPos = 64;
        float buf[kPos * 16];
        for (int64_t b = 0; b < v.N; ++b)
          for (int64_t s0 = 0; s0 < v.S; s0 += kPos) {
            const int64_t m = std::min(kPos, v.S - s0);
            for (int64_t s = 0; s < m; ++s)
              for (int l = 0; l < 16; ++l)
                buf[s * 16 + l] =
                    bn_dx_value(t1[l], k.dy[at16<true>(b, cb, s0 + s, l, CB, v.S)], t2[l],
                                x[at16<true>(b, cb, s0 + s, l, CB, v.S)], tm[l], t0[l]);
            round_to_bf16_here(buf, m * 16, k.dx16 + at16<true>(b, cb, s0, 0, CB, v.S));
          }
        continue;
      }
    }
    if (!k.dx) continue;
    for (int64_t b = 0; b < v.N; ++b)
      for (int64_t s = 0; s < v.S; ++s)
        for (int l = 0; l < 16; ++l)
          k.dx[at16<OB>(b, cb, s, l, CB, v.S)] =
              bn_dx_value(t1[l], k.dy[at16<DB>(b, cb, s, l, CB, v.S)], t2[l],
                          x[at16<XB>(b, cb, s, l, CB, v.S)], tm[l], t0[l]);
  }
}
GRAFT_ISA_CLONES void bn_grad16_bbb(const BnGrad16& k, const float* x, int64_t c0, int64_t c1) {
  bn_grad16_impl<true, true, true>(k, x, c0, c1);
}
GRAFT_ISA_CLONES void bn_grad16_bbb(const BnGrad16& k, Bf16Ptr x, int64_t c0, int64_t c1) {
  bn_grad16_impl<true, true, true>(k, x, c0, c1);
}
template <class X>
void bn_grad16(const BnGrad16& k, X x, bool dy_blk, bool x_blk, bool dx_blk) {
  parallel_for(k.v.C / 16, 3 * 16 * k.v.N * k.v.S, [&](int, int64_t c0, int64_t c1) {
    if (dy_blk && x_blk && (dx_blk || (!k.dx && !k.dx16))) return bn_grad16_bbb(k, x, c0, c1);
    with_layouts(dy_blk, x_blk, dx_blk,
                 [&]<bool DB, bool XB, bool OB>() { bn_grad16_impl<DB, XB, OB>(k, x, c0, c1); });
  });
}

// y = (x - mean) * a + B per channel, a = scale / sqrt(var + eps) (in T: vectorizable; x - mean
// first, so a large mean does not cost precision).
void batchnorm_kernel(KernelCtx& c) {
  dispatch_float(c.in(1).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    BnView v = bn_view(x.shape());
    const BnAttrs& ba = c.attrs<BnAttrs>();
    const double eps = ba.epsilon, mom = ba.momentum;
    const bool train = ba.training;
    const T *sc = c.in(1).data<T>(), *bi = c.in(2).data<T>();
    const T *rm = c.in(3).data<T>(), *rv = c.in(4).data<T>();
    const bool x_blk = ba.blocked & 1u, y_blk = ba.blocked & (1u << 16);
    if (ba.blocked && (!std::is_same_v<T, float> || v.C % 16))
      c.error(ErrorKind::Internal, "a channel-blocked operand that is not float32 [N, 16k, ...]");
    T* y = c.out(0).data<T>();
    std::vector<double> mean(v.C), var(v.C);
    // px: const T*, or Bf16Ptr over a bfloat16 X (Note [bf16 activations]).
    auto normalize = [&](auto px) {
      if (train && x_blk) {
        if constexpr (std::is_same_v<T, float>) bn_batch_stats16(px, v, mean, var);
      } else if (train) {
        bn_batch_stats(px, v, mean, var);
      } else {
        for (int64_t ch = 0; ch < v.C; ++ch) {
          mean[ch] = rm[ch];
          var[ch] = rv[ch];
        }
      }
      std::vector<T> a(v.C), mu(v.C);
      for (int64_t ch = 0; ch < v.C; ++ch) {
        a[ch] = static_cast<T>(sc[ch] / std::sqrt(var[ch] + eps));
        mu[ch] = static_cast<T>(mean[ch]);
      }
      if constexpr (std::is_same_v<T, float>) {
        if (ba.blocked) {
          parallel_for(v.N * v.C / 16, 16 * v.S, [&](int, int64_t p0, int64_t p1) {
            if (x_blk && y_blk) return bn_apply16_bb(px, v, p0, p1, a.data(), mu.data(), bi, y);
            with_layouts(x_blk, y_blk, false, [&]<bool XB, bool YB, bool>() {
              bn_apply16_impl<XB, YB>(px, v, p0, p1, a.data(), mu.data(), bi, y);
            });
          });
        }
      }
      if (!ba.blocked)
        parallel_for(v.N * v.C, v.S, [&](int, int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t ch = p % v.C;
            const T ac = a[ch], mc = mu[ch], bc = bi[ch];
            const auto xp = px + p * v.S;
            T* yp = y + p * v.S;
            for (int64_t i = 0; i < v.S; ++i) yp[i] = (xp[i] - mc) * ac + bc;
          }
        });
    };
    with_x_reader<T>(c, x, normalize);
    if (!train) return;
    const double n = static_cast<double>(v.N * v.S), unbias = n > 1 ? n / (n - 1) : 1.0;
    for (int64_t ch = 0; ch < v.C; ++ch) {
      if (c.has_out(3)) c.out(3).data<T>()[ch] = static_cast<T>(mean[ch]);
      if (c.has_out(4)) c.out(4).data<T>()[ch] = static_cast<T>(var[ch]);
      if (c.has_out(1))
        c.out(1).data<T>()[ch] = static_cast<T>(rm[ch] * mom + mean[ch] * (1 - mom));
      if (c.has_out(2))
        c.out(2).data<T>()[ch] = static_cast<T>(rv[ch] * mom + var[ch] * unbias * (1 - mom));
    }
  });
}
// BatchNormGrad(dY, X, scale, mean, var; epsilon, training_mode, batch_stats) -> dX, dscale, dB.
// mean and var are the running statistics (inference mode), or with batch_stats = 1 the batch's,
// saved by the forward (its outputs 3 and 4); training mode without them recomputes them from X.
void infer_batchnorm_grad(InferCtx& c) {
  c.set_out(0, float_or_bf16(c, 1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), c.shape(2));
}
// Per channel, with xh = (x - mean) * inv: dB = sum dy, dscale = sum dy * xh, and
// dx = scale * inv / n * (n * dy - dB - xh * dscale) (training) or dy * scale * inv, written as
// dx = k1 * dy + k2 * (x - mean) + k0 with per-channel constants (in T: vectorizable). Parallel
// over channels; the sums are in double.
// One channel's sums sum dy and sum dy * (x - m) over the batch, and its dX (Note [ISA clones]).
template <class T, class X>
GRAFT_INLINE void bn_grad_sums_impl(const T* dy, X px, BnView v, int64_t ch, double m, double& sdy,
                                    double& sdyx) {
  for (int64_t b = 0; b < v.N; ++b) {
    const T* d = dy + (b * v.C + ch) * v.S;
    const auto xp = px + (b * v.C + ch) * v.S;
    sdy += sum8(v.S, [&](int64_t i) { return static_cast<double>(d[i]); });
    sdyx += sum8(v.S, [&](int64_t i) { return d[i] * (xp[i] - m); });
  }
}
template <class T, class X>
GRAFT_INLINE void bn_grad_dx_impl(const T* dy, X px, BnView v, int64_t ch, T t1, T t2, T t0, T tm,
                                  T* dx) {
  for (int64_t b = 0; b < v.N; ++b) {
    const T* d = dy + (b * v.C + ch) * v.S;
    const auto xp = px + (b * v.C + ch) * v.S;
    T* o = dx + (b * v.C + ch) * v.S;
    for (int64_t i = 0; i < v.S; ++i) o[i] = t1 * d[i] + t2 * (xp[i] - tm) + t0;
  }
}
template <class T>
void bn_grad_sums(const T* dy, const T* px, BnView v, int64_t ch, double m, double& sdy,
                  double& sdyx) {
  bn_grad_sums_impl(dy, px, v, ch, m, sdy, sdyx);
}
GRAFT_ISA_CLONES void bn_grad_sums(const float* dy, const float* px, BnView v, int64_t ch, double m,
                                   double& sdy, double& sdyx) {
  bn_grad_sums_impl(dy, px, v, ch, m, sdy, sdyx);
}
GRAFT_ISA_CLONES void bn_grad_sums(const float* dy, Bf16Ptr px, BnView v, int64_t ch, double m,
                                   double& sdy, double& sdyx) {
  bn_grad_sums_impl(dy, px, v, ch, m, sdy, sdyx);
}
template <class T>
void bn_grad_dx(const T* dy, const T* px, BnView v, int64_t ch, T t1, T t2, T t0, T tm, T* dx) {
  bn_grad_dx_impl(dy, px, v, ch, t1, t2, t0, tm, dx);
}
GRAFT_ISA_CLONES void bn_grad_dx(const float* dy, const float* px, BnView v, int64_t ch, float t1,
                                 float t2, float t0, float tm, float* dx) {
  bn_grad_dx_impl(dy, px, v, ch, t1, t2, t0, tm, dx);
}
GRAFT_ISA_CLONES void bn_grad_dx(const float* dy, Bf16Ptr px, BnView v, int64_t ch, float t1,
                                 float t2, float t0, float tm, float* dx) {
  bn_grad_dx_impl(dy, px, v, ch, t1, t2, t0, tm, dx);
}
void batchnorm_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(1);
    BnView v = bn_view(x.shape());
    const BnAttrs& ba = c.attrs<BnAttrs>();
    const double eps = ba.epsilon;
    const bool train = ba.training;
    const T *dy = c.in(0).data<T>(), *sc = c.in(2).data<T>();
    const bool dy_blk = ba.blocked & 1u, x_blk = ba.blocked & 2u, dx_blk = ba.blocked & (1u << 16);
    if (ba.blocked && (!std::is_same_v<T, float> || v.C % 16))
      c.error(ErrorKind::Internal, "a channel-blocked operand that is not float32 [N, 16k, ...]");
    const double n = static_cast<double>(v.N * v.S);
    // Note [bf16 writers]: a bfloat16 dX is rounded as it is stored where dY, X and dX are all
    // channel-blocked; elsewhere computed in float32 scratch and rounded after.
    const bool dx16 = c.has_out(0) && c.out(0).dtype() == DType::BF16;
    const bool dx16_direct = dx16 && std::is_same_v<T, float> && dy_blk && x_blk && dx_blk;
    Tensor dx_wide;
    if (dx16 && !dx16_direct)
      dx_wide = Tensor::empty(x.shape(), DType::F32, c.alloc, Category::Workspace, "float32 dX");
    T* dx = !c.has_out(0) || dx16_direct ? nullptr : dx16 ? dx_wide.data<T>() : c.out(0).data<T>();
    // px: const T*, or Bf16Ptr over a bfloat16 X (Note [bf16 activations]).
    auto grad = [&](auto px) {
      std::vector<double> mean(v.C), var(v.C);
      if (train && !ba.batch_stats && x_blk) {
        if constexpr (std::is_same_v<T, float>) bn_batch_stats16(px, v, mean, var);
      } else if (train && !ba.batch_stats) {
        bn_batch_stats(px, v, mean, var);
      } else {
        for (int64_t ch = 0; ch < v.C; ++ch) {
          mean[ch] = c.in(3).data<T>()[ch];
          var[ch] = c.in(4).data<T>()[ch];
        }
      }
      if constexpr (std::is_same_v<T, float>) {
        if (ba.blocked) {
          const BnGrad16 k{v,
                           dy,
                           sc,
                           mean.data(),
                           var.data(),
                           eps,
                           train,
                           dx,
                           c.has_out(1) ? c.out(1).data<float>() : nullptr,
                           c.has_out(2) ? c.out(2).data<float>() : nullptr,
                           dx16_direct ? c.out(0).data<uint16_t>() : nullptr};
          return bn_grad16(k, px, dy_blk, x_blk, dx_blk);
        }
      }
      parallel_for(v.C, 3 * v.N * v.S, [&](int, int64_t c0, int64_t c1) {
        for (int64_t ch = c0; ch < c1; ++ch) {
          const double inv = 1.0 / std::sqrt(var[ch] + eps), m = mean[ch];
          double sdy = 0, sdyx = 0;
          bn_grad_sums(dy, px, v, ch, m, sdy, sdyx);
          sdyx *= inv;
          if (c.has_out(1)) c.out(1).data<T>()[ch] = static_cast<T>(sdyx);
          if (c.has_out(2)) c.out(2).data<T>()[ch] = static_cast<T>(sdy);
          if (!dx) continue;
          const BnDx d = bn_dx_coefficients(sc[ch], inv, sdy, sdyx, n, train);
          const T t1 = static_cast<T>(d.k1), t2 = static_cast<T>(d.k2), t0 = static_cast<T>(d.k0);
          bn_grad_dx(dy, px, v, ch, t1, t2, t0, static_cast<T>(m), dx);
        }
      });
    };
    with_x_reader<T>(c, x, grad);
    if (dx16 && !dx16_direct)
      round_to_bf16(dx_wide.data<float>(), dx_wide.numel(), c.out(0).data<uint16_t>());
  });
}
// Note [channel-blocked values]: X and Y (BatchNormGrad: dY, X and dX) may be channel-blocked;
// the pass checks their dtype and channel count.
BlockedUse blocked_bn(const Graph&, const Node&) { return {1u, 1u, false}; }
BlockedUse blocked_bn_grad(const Graph&, const Node&) { return {3u, 1u, false}; }

void grad_batchnorm(GradBuilder& g) {
  const Node& n = g.node();
  if ((n.outputs.size() > 1 && n.outputs[1] >= 0 && g.dy(1) >= 0) ||
      (n.outputs.size() > 2 && n.outputs[2] >= 0 && g.dy(2) >= 0))
    fail(ErrorKind::Unsupported,
         n.label() + ": a gradient through the running statistics is not supported");
  Attrs a;
  const BnAttrs na = bn_attrs(n);
  a.set_float("epsilon", na.epsilon);
  const bool train = na.training;
  a.set_int("training_mode", train);
  a.set_int("batch_stats", train);
  // Training: the batch statistics the forward computed (its outputs 3, 4), not the running ones.
  const int mean = train ? g.y(3) : g.x(3), var = train ? g.y(4) : g.x(4);
  auto outs = g.emit("BatchNormGrad", {g.dy(0), g.x(0), g.x(1), mean, var}, a, 3, "graft");
  if (g.needs(0)) g.set_dx(0, outs[0]);
  if (g.needs(1)) g.set_dx(1, outs[1]);
  if (g.needs(2)) g.set_dx(2, outs[2]);
}

const OpDef kOps[] = {
    {.name = "BatchNormalization",
     .min_in = 5,
     .max_in = 5,
     .max_out = 5,
     .infer = infer_batchnorm,
     .prepare = prepare_bn,
     .kernel = batchnorm_kernel,
     .grad = grad_batchnorm,
     .nondiff_inputs = {3, 4},
     .blocked = blocked_bn},
    {.name = "BatchNormGrad",
     .domain = "graft",
     .min_in = 5,
     .max_in = 5,
     .max_out = 3,
     .infer = infer_batchnorm_grad,
     .prepare = prepare_bn,
     .kernel = batchnorm_grad_kernel,
     .nondiff_inputs = {3, 4},
     .blocked = blocked_bn_grad,
     .bf16_out = true},
    {.name = "LayerNormalization",
     .min_in = 2,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_layernorm,
     .prepare = prepare_layernorm,
     .kernel = layernorm_kernel,
     .grad = grad_layernorm},
    {.name = "LayerNormGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_layernorm_grad,
     .prepare = prepare_layernorm,
     .kernel = layernorm_grad_kernel},
};

}  // namespace

void register_norm_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
