// Neural-network ops: Softmax, LogSoftmax, LayerNormalization, BatchNormalization,
// SoftmaxCrossEntropyLoss, Dropout,
// with graft's fused gradient kernels. Statistics are accumulated in double.
#include <atomic>
#include <cmath>
#include <functional>
#include <random>
#include <type_traits>

#include "util.h"
#include "vmath.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- Softmax / LogSoftmax (opset 13: one axis) --------------------------------------------------
// The attributes of Softmax, LogSoftmax, LayerNormalization and their gradients.
struct NormAttrs {
  int64_t axis = -1;      // as given (normalize_axis_scalar_ok for the input's rank)
  double epsilon = 1e-5;  // LayerNormalization
};
NormAttrs norm_attrs(const Node& n) {
  return {n.attrs.get_int("axis", -1, n.label()), n.attrs.get_float("epsilon", 1e-5, n.label())};
}
std::shared_ptr<const void> prepare_norm(const Node& n) { return prepared(norm_attrs(n)); }
void infer_softmax(InferCtx& c) {
  require_float(c, 0);
  normalize_axis_scalar_ok(norm_attrs(c.node()).axis, static_cast<int>(c.shape(0).size()),
                           c.node());
  infer_same(c);
}
template <bool kLog>
void softmax_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  const int ax = normalize_axis_scalar_ok(c.attrs<NormAttrs>().axis, x.rank(), c.node);
  int64_t outer, n, inner;
  split3(x.shape(), ax, ax + 1, outer, n, inner);
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    T* py = c.out(0).data<T>();
    // float32 with vmath: exp(x - max) by the vector exp into a float line buffer, summed in
    // double in 8 fixed partial sums. Otherwise (float64 too) libm's exp in double.
    const bool vec = std::is_same_v<T, float> && vmath::active();
    // Parallel over the (outer, inner) lines; each line's sums run in a fixed order.
    parallel_for(outer * inner, (vec ? 8 : 24) * n, [&](int, int64_t l0, int64_t l1) {
      std::vector<double> e(kLog || vec ? 0 : n);  // exp(x - max), computed once per element
      std::vector<float> ef(vec ? n : 0);
      for (int64_t l = l0; l < l1; ++l) {
        const int64_t o = l / inner, i = l % inner;
        const T* p = px + o * n * inner + i;
        T* q = py + o * n * inner + i;
        T mx = n ? p[0] : T(0);
        if (!vec || inner != 1)
          for (int64_t k = 1; k < n; ++k) mx = std::max(mx, p[k * inner]);
        double sum = 0;
        if (vec) {
          if (inner == 1) {  // contiguous: a vector max, a plain loop
            const float* pf = reinterpret_cast<const float*>(p);
            const float m = n ? vmath::max_of(pf, n) : 0.0f;
            mx = static_cast<T>(m);
            for (int64_t k = 0; k < n; ++k) ef[k] = pf[k] - m;
          } else {
            for (int64_t k = 0; k < n; ++k) ef[k] = static_cast<float>(p[k * inner] - mx);
          }
          vmath::map(vmath::Fn::Exp, ef.data(), ef.data(), n);
          sum = sum8(n, [&](int64_t k) { return static_cast<double>(ef[k]); });
          if constexpr (kLog) {
            T lse = static_cast<T>(std::log(sum)) + mx;
            for (int64_t k = 0; k < n; ++k) q[k * inner] = p[k * inner] - lse;
          } else {
            for (int64_t k = 0; k < n; ++k) q[k * inner] = static_cast<T>(ef[k] / sum);
          }
          continue;
        }
        if constexpr (kLog) {
          for (int64_t k = 0; k < n; ++k) sum += std::exp(static_cast<double>(p[k * inner] - mx));
          T lse = static_cast<T>(std::log(sum)) + mx;
          for (int64_t k = 0; k < n; ++k) q[k * inner] = p[k * inner] - lse;
        } else {
          for (int64_t k = 0; k < n; ++k) {
            e[k] = std::exp(static_cast<double>(p[k * inner] - mx));
            sum += e[k];
          }
          for (int64_t k = 0; k < n; ++k) q[k * inner] = static_cast<T>(e[k] / sum);
        }
      }
    });
  });
}
// SoftmaxGrad: dx = y * (dy - sum(dy*y)); LogSoftmaxGrad: dx = dy - exp(y) * sum(dy).
template <bool kLog>
void softmax_grad_kernel(KernelCtx& c) {
  const Tensor& dy = c.in(0);
  const int ax = normalize_axis_scalar_ok(c.attrs<NormAttrs>().axis, dy.rank(), c.node);
  int64_t outer, n, inner;
  split3(dy.shape(), ax, ax + 1, outer, n, inner);
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    const T *pd = dy.data<T>(), *py = c.in(1).data<T>();
    T* px = c.out(0).data<T>();
    // LogSoftmaxGrad in float32 with vmath: exp(y) by the vector exp into a line buffer.
    const bool vec = kLog && std::is_same_v<T, float> && vmath::active();
    parallel_for(outer * inner, (kLog ? (vec ? 6 : 20) : 4) * n, [&](int, int64_t l0, int64_t l1) {
      std::vector<float> ef(vec ? n : 0);
      for (int64_t l = l0; l < l1; ++l) {
        const int64_t b = (l / inner) * n * inner + l % inner;
        double s = 0;
        for (int64_t k = 0; k < n; ++k)
          s += kLog ? static_cast<double>(pd[b + k * inner])
                    : static_cast<double>(pd[b + k * inner]) * py[b + k * inner];
        if (vec) {
          for (int64_t k = 0; k < n; ++k) ef[k] = static_cast<float>(py[b + k * inner]);
          vmath::map(vmath::Fn::Exp, ef.data(), ef.data(), n);
          for (int64_t k = 0; k < n; ++k)
            px[b + k * inner] = static_cast<T>(pd[b + k * inner] - ef[k] * s);
          continue;
        }
        if (inner == 1) {  // contiguous: a plain loop
          const T *d = pd + b, *y = py + b;
          T* o = px + b;
          if constexpr (kLog)
            for (int64_t k = 0; k < n; ++k)
              o[k] = static_cast<T>(d[k] - std::exp(static_cast<double>(y[k])) * s);
          else
            for (int64_t k = 0; k < n; ++k) o[k] = static_cast<T>(y[k] * (d[k] - s));
          continue;
        }
        for (int64_t k = 0; k < n; ++k) {
          const int64_t j = b + k * inner;
          if constexpr (kLog)
            px[j] = static_cast<T>(pd[j] - std::exp(static_cast<double>(py[j])) * s);
          else
            px[j] = static_cast<T>(py[j] * (pd[j] - s));
        }
      }
    });
  });
}
void infer_softmax_grad(InferCtx& c) {
  c.check(c.shape(0) == c.shape(1), "dy and y differ in shape");
  infer_same(c);
}
void grad_softmax(GradBuilder& g) {
  Attrs a;
  a.set_int("axis", normalize_axis_scalar_ok(norm_attrs(g.node()).axis,
                                             static_cast<int>(g.shape(g.x(0)).size()), g.node()));
  g.set_dx(0, g.emit1("SoftmaxGrad", {g.dy(0), g.y(0)}, a, "graft"));
}
void grad_log_softmax(GradBuilder& g) {
  Attrs a;
  a.set_int("axis", normalize_axis_scalar_ok(norm_attrs(g.node()).axis,
                                             static_cast<int>(g.shape(g.x(0)).size()), g.node()));
  g.set_dx(0, g.emit1("LogSoftmaxGrad", {g.dy(0), g.y(0)}, a, "graft"));
}

// ---- LayerNormalization (opset 17) --------------------------------------------------------------
// Normalizes over dims [axis, rank). Mean / InvStdDev outputs have the normalized dims set to 1
// and the stash dtype (float32 unless stash_type says otherwise).
void infer_layernorm(InferCtx& c) {
  require_float(c, 0);
  const Shape& s = c.shape(0);
  const int ax =
      normalize_axis_scalar_ok(norm_attrs(c.node()).axis, static_cast<int>(s.size()), c.node());
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
  const int ax = normalize_axis_scalar_ok(c.attrs<NormAttrs>().axis, x.rank(), c.node);
  int64_t outer, n, inner;
  split3(x.shape(), ax, x.rank(), outer, n, inner);
  const double eps = c.attrs<NormAttrs>().epsilon;
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
  const int ax = normalize_axis_scalar_ok(c.attrs<NormAttrs>().axis, x.rank(), c.node);
  int64_t outer, n, inner;
  split3(x.shape(), ax, x.rank(), outer, n, inner);
  const double eps = c.attrs<NormAttrs>().epsilon;
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
  const NormAttrs na = norm_attrs(n);
  a.set_int("axis", normalize_axis_scalar_ok(na.axis, static_cast<int>(g.shape(g.x(0)).size()), n));
  a.set_float("epsilon", na.epsilon);
  auto outs = g.emit("LayerNormGrad", {g.dy(0), g.x(0), g.x(1)}, a, 3, "graft");
  if (g.needs(0)) g.set_dx(0, outs[0]);
  if (g.needs(1)) g.set_dx(1, outs[1]);
  if (n.inputs.size() > 2 && n.inputs[2] >= 0 && g.needs(2)) g.set_dx(2, outs[2]);
}

// ---- SoftmaxCrossEntropyLoss ------------------------------------------------------------------
// scores [N, C, d...], labels [N, d...]; loss over the class axis 1.
enum class Reduction { Mean, Sum, None, Other };
struct SceAttrs {
  Reduction reduction = Reduction::Mean;
  std::string reduction_name = "mean";  // as given (for the error on an unknown one)
  bool has_ignore = false;
  int64_t ignore_index = 0;
};
SceAttrs sce_attrs(const Node& n) {
  SceAttrs a;
  a.reduction_name = n.attrs.get_string("reduction", "mean", n.label());
  a.reduction = a.reduction_name == "mean"   ? Reduction::Mean
                : a.reduction_name == "sum"  ? Reduction::Sum
                : a.reduction_name == "none" ? Reduction::None
                                             : Reduction::Other;
  a.has_ignore = n.attrs.has("ignore_index");
  a.ignore_index = n.attrs.get_int("ignore_index", 0, n.label());
  return a;
}
std::shared_ptr<const void> prepare_sce(const Node& n) { return prepared(sce_attrs(n)); }
void infer_sce(InferCtx& c) {
  require_float(c, 0);
  const Shape& s = c.shape(0);
  c.check(s.size() >= 2, "scores must have rank >= 2 ([N, C, ...])");
  if (c.dtype(1) != DType::I64) c.error(ErrorKind::Unsupported, "labels must be int64");
  Shape ls = s;
  ls.erase(ls.begin() + 1);
  c.check(c.shape(1) == ls,
          "labels have shape " + shape_str(c.shape(1)) + ", expected " + shape_str(ls));
  if (c.has_in(2)) {
    c.check(c.shape(2) == Shape{s[1]}, "weights must have shape [C]");
    if (c.dtype(2) != c.dtype(0))
      c.error(ErrorKind::InvalidModel, "weights and scores differ in dtype");
  }
  const SceAttrs a = sce_attrs(c.node());
  if (a.reduction == Reduction::Other)
    c.error(ErrorKind::Unsupported,
            "reduction '" + a.reduction_name + "' (expected mean, sum or none)");
  c.set_out(0, c.dtype(0), a.reduction == Reduction::None ? ls : Shape{});
  c.set_out(1, c.dtype(0), s);
}
struct SceView {
  int64_t N, C, D;  // scores [N, C, D] after flattening trailing dims
};
SceView sce_view(const Shape& s) {
  SceView v{s[0], s[1], 1};
  for (size_t i = 2; i < s.size(); ++i) v.D *= s[i];
  return v;
}
// Per-position log-softmax over C into `lp` (may be null), loss terms and weights.
template <class T>
void sce_forward(const KernelCtx& c, const T* x, const int64_t* lab, const T* w, SceView v,
                 int64_t ignore, bool has_ignore, T* lp, std::vector<double>& term,
                 std::vector<double>& wt) {
  term.assign(v.N * v.D, 0.0);
  wt.assign(v.N * v.D, 0.0);
  for (int64_t nn = 0; nn < v.N; ++nn)
    for (int64_t d = 0; d < v.D; ++d) {
      const T* p = x + nn * v.C * v.D + d;
      double mx = p[0];
      for (int64_t k = 1; k < v.C; ++k) mx = std::max<double>(mx, p[k * v.D]);
      double s = 0;
      for (int64_t k = 0; k < v.C; ++k) s += std::exp(p[k * v.D] - mx);
      double lse = std::log(s) + mx;
      if (lp)
        for (int64_t k = 0; k < v.C; ++k)
          lp[nn * v.C * v.D + k * v.D + d] = static_cast<T>(p[k * v.D] - lse);
      int64_t y = lab[nn * v.D + d];
      if (has_ignore && y == ignore) continue;
      if (y < 0 || y >= v.C)
        c.error(ErrorKind::InvalidArgument,
                "label " + std::to_string(y) + " is out of range [0, " + std::to_string(v.C) + ")");
      double ww = w ? static_cast<double>(w[y]) : 1.0;
      term[nn * v.D + d] = -ww * (p[y * v.D] - lse);
      wt[nn * v.D + d] = ww;
    }
}
void sce_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  SceView v = sce_view(x.shape());
  const SceAttrs& a = c.attrs<SceAttrs>();
  const bool has_ignore = a.has_ignore;
  const int64_t ignore = a.ignore_index;
  const Reduction red = a.reduction;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    std::vector<double> term, wt;
    sce_forward<T>(c, x.data<T>(), c.in(1).data<int64_t>(),
                   c.has_in(2) ? c.in(2).data<T>() : nullptr, v, ignore, has_ignore,
                   c.has_out(1) ? c.out(1).data<T>() : nullptr, term, wt);
    T* loss = c.out(0).data<T>();
    if (red == Reduction::None) {
      for (size_t i = 0; i < term.size(); ++i) loss[i] = static_cast<T>(term[i]);
      return;
    }
    double s = 0, sw = 0;
    for (size_t i = 0; i < term.size(); ++i) {
      s += term[i];
      sw += wt[i];
    }
    loss[0] = static_cast<T>(red == Reduction::Sum ? s : (sw != 0 ? s / sw : 0.0));
  });
}
// SoftmaxCrossEntropyLossGrad(dloss, scores, labels[, weights]) -> dscores.
void infer_sce_grad(InferCtx& c) { c.set_out(0, c.dtype(1), c.shape(1)); }
void sce_grad_kernel(KernelCtx& c) {
  const Tensor& x = c.in(1);
  SceView v = sce_view(x.shape());
  const SceAttrs& a = c.attrs<SceAttrs>();
  const bool has_ignore = a.has_ignore;
  const int64_t ignore = a.ignore_index;
  const Reduction red = a.reduction;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    const int64_t* lab = c.in(2).data<int64_t>();
    const T* w = c.has_in(3) ? c.in(3).data<T>() : nullptr;
    const T* dl = c.in(0).data<T>();
    T* dx = c.out(0).data<T>();
    std::vector<double> term, wt;
    sce_forward<T>(c, px, lab, w, v, ignore, has_ignore, nullptr, term, wt);
    double sw = 0;
    for (double z : wt) sw += z;
    for (int64_t nn = 0; nn < v.N; ++nn)
      for (int64_t d = 0; d < v.D; ++d) {
        const int64_t pos = nn * v.D + d;
        const T* p = px + nn * v.C * v.D + d;
        T* q = dx + nn * v.C * v.D + d;
        double coef = red == Reduction::None  ? dl[pos]
                      : red == Reduction::Sum ? dl[0]
                                              : (sw != 0 ? dl[0] / sw : 0.0);
        coef *= wt[pos];
        if (coef == 0) {
          for (int64_t k = 0; k < v.C; ++k) q[k * v.D] = T(0);
          continue;
        }
        double mx = p[0];
        for (int64_t k = 1; k < v.C; ++k) mx = std::max<double>(mx, p[k * v.D]);
        double s = 0;
        for (int64_t k = 0; k < v.C; ++k) s += std::exp(p[k * v.D] - mx);
        int64_t y = lab[pos];
        for (int64_t k = 0; k < v.C; ++k)
          q[k * v.D] =
              static_cast<T>(coef * (std::exp(p[k * v.D] - mx) / s - (k == y ? 1.0 : 0.0)));
      }
  });
}
void grad_sce(GradBuilder& g) {
  const Node& n = g.node();
  if (n.outputs.size() > 1 && n.outputs[1] >= 0 && g.dy(1) >= 0)
    fail(ErrorKind::Unsupported,
         n.label() + ": a gradient through the log_prob output is not supported");
  std::vector<int> ins{g.dy(0), g.x(0), g.x(1)};
  if (n.inputs.size() > 2 && n.inputs[2] >= 0) ins.push_back(n.inputs[2]);
  g.set_dx(0, g.emit1("SoftmaxCrossEntropyLossGrad", ins, n.attrs, "graft"));
}

// ---- Dropout ------------------------------------------------------------------------------------
// Identity unless training_mode is true and ratio > 0; then a Bernoulli mask scaled by 1/(1-p).
bool dropout_active(const Tensor* ratio, const Tensor* training, double& p) {
  p = ratio ? ratio->at(0) : 0.5;
  bool train = training && training->at(0) != 0;
  return train && p > 0;
}
// ratio and training_mode do not change the output shapes: they may be graph inputs, read by the
// kernel at run time (the gradient rule needs them constant).
void infer_dropout(InferCtx& c) {
  require_float(c, 0);
  if (c.has_in(1)) {
    if (!is_float(c.dtype(1))) c.error(ErrorKind::Unsupported, "ratio must be float32 or float64");
    c.check(numel(c.shape(1)) == 1, "ratio must be a scalar, got shape " + shape_str(c.shape(1)));
  }
  if (c.has_in(2)) {
    if (c.dtype(2) != DType::Bool) c.error(ErrorKind::InvalidModel, "training_mode must be bool");
    c.check(numel(c.shape(2)) == 1,
            "training_mode must be a scalar, got shape " + shape_str(c.shape(2)));
  }
  c.set_out(0, c.dtype(0), c.shape(0));
  c.set_out(1, DType::Bool, c.shape(0));
  double p = c.const_in(1) ? c.const_in(1)->at(0) : 0.5;
  if (p < 0 || p >= 1)
    c.error(ErrorKind::InvalidModel, "ratio " + std::to_string(p) + " is not in [0, 1)");
}
struct DropoutAttrs {
  int64_t seed = 0;  // mixed into the generator's seed with the run's seed and the node's name
};
std::shared_ptr<const void> prepare_dropout(const Node& n) {
  return prepared(DropoutAttrs{n.attrs.get_int("seed", 0, n.label())});
}
std::atomic<uint64_t>& dropout_counter() {
  static std::atomic<uint64_t> n{0};
  return n;
}
void dropout_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  double p;
  bool active =
      dropout_active(c.has_in(1) ? &c.in(1) : nullptr, c.has_in(2) ? &c.in(2) : nullptr, p);
  if (c.has_in(1) && !(p >= 0 && p < 1))
    c.error(ErrorKind::InvalidArgument, "ratio " + std::to_string(p) + " is not in [0, 1)");
  bool* mask = c.has_out(1) ? c.out(1).data<bool>() : nullptr;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    T* py = c.out(0).data<T>();
    if (!active) {
      if (py != px) std::copy(px, px + x.numel(), py);
      if (mask) std::fill(mask, mask + x.numel(), true);
      return;
    }
    std::mt19937_64 rng(static_cast<uint64_t>(c.attrs<DropoutAttrs>().seed) * 1000003u +
                        c.seed * 7919u + std::hash<std::string>{}(c.node.name));
    std::bernoulli_distribution keep(1.0 - p);
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    for (int64_t i = 0; i < x.numel(); ++i) {
      bool k = keep(rng);
      if (mask) mask[i] = k;
      py[i] = k ? px[i] * scale : T(0);
    }
  });
}
void grad_dropout(GradBuilder& g) {
  const Node& n = g.node();
  auto in_t = [&](int i) -> const Tensor* {
    if (i >= static_cast<int>(n.inputs.size()) || n.inputs[i] < 0) return nullptr;
    const Value& v = g.val(n.inputs[i]);
    if (v.kind != ValueKind::Constant || !v.data.defined())
      fail(ErrorKind::Unsupported, n.label() + ": the gradient of Dropout needs a constant " +
                                       (i == 1 ? "ratio" : "training_mode") + "; '" + v.name +
                                       "' is computed at run time");
    return &v.data;
  };
  double p;
  if (!dropout_active(in_t(1), in_t(2), p)) {
    g.set_dx(0, g.dy(0));
    return;
  }
  int mask = g.y(1);
  DType dt = g.val(g.dy(0)).dtype;
  Attrs a;
  a.set_int("to", onnx_dtype_code_of(dt));
  int m = g.emit1("Cast", {mask}, a);
  g.set_dx(0, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), m}), g.scalar(1.0 / (1.0 - p), dt)}));
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
};
BnAttrs bn_attrs(const Node& n) {
  const std::string where = n.label();
  return {n.attrs.get_float("epsilon", 1e-5, where), n.attrs.get_float("momentum", 0.9, where),
          n.attrs.get_int("training_mode", 0, where) != 0,
          n.attrs.get_int("batch_stats", 0, where) != 0};
}
std::shared_ptr<const void> prepare_bn(const Node& n) { return prepared(bn_attrs(n)); }
void infer_batchnorm(InferCtx& c) {
  require_float(c, 0);
  const Shape& s = c.shape(0);
  c.check(s.size() >= 2, "X must be [N, C, ...]");
  for (int i = 1; i < 5; ++i) {
    c.check(c.shape(i) == Shape{s[1]}, "scale, B, mean and var must have shape [C]");
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::Unsupported, "mixed dtypes are not supported");
  }
  const bool train = bn_attrs(c.node()).training;
  if (!train && (c.has_out(1) || c.has_out(2) || c.has_out(3) || c.has_out(4)))
    c.error(ErrorKind::InvalidModel, "running statistics are outputs in training mode only");
  c.set_out(0, c.dtype(0), s);
  for (int i = 1; i < 5; ++i) c.set_out(i, c.dtype(0), {s[1]});
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
template <class T>
void bn_batch_stats(const T* x, BnView v, std::vector<double>& mean, std::vector<double>& var) {
  mean.assign(v.C, 0.0);
  var.assign(v.C, 0.0);
  const double n = static_cast<double>(v.N * v.S);
  parallel_for(v.C, 2 * v.N * v.S, [&](int, int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch) {
      double m = 0, q = 0;
      for (int64_t b = 0; b < v.N; ++b) {
        const T* xp = x + (b * v.C + ch) * v.S;
        m += sum8(v.S, [&](int64_t i) { return static_cast<double>(xp[i]); });
      }
      m /= n ? n : 1;
      for (int64_t b = 0; b < v.N; ++b) {
        const T* xp = x + (b * v.C + ch) * v.S;
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
// y = (x - mean) * a + B per channel, a = scale / sqrt(var + eps) (in T: vectorizable; x - mean
// first, so a large mean does not cost precision).
void batchnorm_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    BnView v = bn_view(x.shape());
    const BnAttrs& ba = c.attrs<BnAttrs>();
    const double eps = ba.epsilon, mom = ba.momentum;
    const bool train = ba.training;
    const T *px = x.data<T>(), *sc = c.in(1).data<T>(), *bi = c.in(2).data<T>();
    const T *rm = c.in(3).data<T>(), *rv = c.in(4).data<T>();
    std::vector<double> mean(v.C), var(v.C);
    if (train) {
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
    T* y = c.out(0).data<T>();
    parallel_for(v.N * v.C, v.S, [&](int, int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t ch = p % v.C;
        const T ac = a[ch], mc = mu[ch], bc = bi[ch], *xp = px + p * v.S;
        T* yp = y + p * v.S;
        for (int64_t i = 0; i < v.S; ++i) yp[i] = (xp[i] - mc) * ac + bc;
      }
    });
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
  c.set_out(0, c.dtype(1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), c.shape(2));
}
// Per channel, with xh = (x - mean) * inv: dB = sum dy, dscale = sum dy * xh, and
// dx = scale * inv / n * (n * dy - dB - xh * dscale) (training) or dy * scale * inv, written as
// dx = k1 * dy + k2 * (x - mean) + k0 with per-channel constants (in T: vectorizable). Parallel
// over channels; the sums are in double.
// One channel's sums sum dy and sum dy * (x - m) over the batch, and its dX (Note [ISA clones]).
template <class T>
GRAFT_INLINE void bn_grad_sums_impl(const T* dy, const T* px, BnView v, int64_t ch, double m,
                                    double& sdy, double& sdyx) {
  for (int64_t b = 0; b < v.N; ++b) {
    const T *d = dy + (b * v.C + ch) * v.S, *xp = px + (b * v.C + ch) * v.S;
    sdy += sum8(v.S, [&](int64_t i) { return static_cast<double>(d[i]); });
    sdyx += sum8(v.S, [&](int64_t i) { return d[i] * (xp[i] - m); });
  }
}
template <class T>
GRAFT_INLINE void bn_grad_dx_impl(const T* dy, const T* px, BnView v, int64_t ch, T t1, T t2, T t0,
                                  T tm, T* dx) {
  for (int64_t b = 0; b < v.N; ++b) {
    const T *d = dy + (b * v.C + ch) * v.S, *xp = px + (b * v.C + ch) * v.S;
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
template <class T>
void bn_grad_dx(const T* dy, const T* px, BnView v, int64_t ch, T t1, T t2, T t0, T tm, T* dx) {
  bn_grad_dx_impl(dy, px, v, ch, t1, t2, t0, tm, dx);
}
GRAFT_ISA_CLONES void bn_grad_dx(const float* dy, const float* px, BnView v, int64_t ch, float t1,
                                 float t2, float t0, float tm, float* dx) {
  bn_grad_dx_impl(dy, px, v, ch, t1, t2, t0, tm, dx);
}
void batchnorm_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(1).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(1);
    BnView v = bn_view(x.shape());
    const BnAttrs& ba = c.attrs<BnAttrs>();
    const double eps = ba.epsilon;
    const bool train = ba.training;
    const T *dy = c.in(0).data<T>(), *px = x.data<T>(), *sc = c.in(2).data<T>();
    std::vector<double> mean(v.C), var(v.C);
    if (train && !ba.batch_stats) {
      bn_batch_stats(px, v, mean, var);
    } else {
      for (int64_t ch = 0; ch < v.C; ++ch) {
        mean[ch] = c.in(3).data<T>()[ch];
        var[ch] = c.in(4).data<T>()[ch];
      }
    }
    const double n = static_cast<double>(v.N * v.S);
    T* dx = c.has_out(0) ? c.out(0).data<T>() : nullptr;
    parallel_for(v.C, 3 * v.N * v.S, [&](int, int64_t c0, int64_t c1) {
      for (int64_t ch = c0; ch < c1; ++ch) {
        const double inv = 1.0 / std::sqrt(var[ch] + eps), m = mean[ch];
        double sdy = 0, sdyx = 0;
        bn_grad_sums(dy, px, v, ch, m, sdy, sdyx);
        sdyx *= inv;
        if (c.has_out(1)) c.out(1).data<T>()[ch] = static_cast<T>(sdyx);
        if (c.has_out(2)) c.out(2).data<T>()[ch] = static_cast<T>(sdy);
        if (!dx) continue;
        const double k1 = sc[ch] * inv;
        const double k2 = train && n ? -k1 * inv * sdyx / n : 0.0;
        const double k0 = train && n ? -k1 * sdy / n : 0.0;
        const T t1 = static_cast<T>(k1), t2 = static_cast<T>(k2), t0 = static_cast<T>(k0);
        bn_grad_dx(dy, px, v, ch, t1, t2, t0, static_cast<T>(m), dx);
      }
    });
  });
}
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
     .nondiff_inputs = {3, 4}},
    {.name = "BatchNormGrad",
     .domain = "graft",
     .min_in = 5,
     .max_in = 5,
     .max_out = 3,
     .infer = infer_batchnorm_grad,
     .prepare = prepare_bn,
     .kernel = batchnorm_grad_kernel,
     .nondiff_inputs = {3, 4}},
    // In place: the kernel reads a whole line before writing it.
    {.name = "Softmax",
     .infer = infer_softmax,
     .prepare = prepare_norm,
     .kernel = softmax_kernel<false>,
     .grad = grad_softmax,
     .inplace_input = 0},
    {.name = "LogSoftmax",
     .infer = infer_softmax,
     .prepare = prepare_norm,
     .kernel = softmax_kernel<true>,
     .grad = grad_log_softmax,
     .inplace_input = 0},
    {.name = "LayerNormalization",
     .min_in = 2,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_layernorm,
     .prepare = prepare_norm,
     .kernel = layernorm_kernel,
     .grad = grad_layernorm},
    {.name = "SoftmaxCrossEntropyLoss",
     .min_in = 2,
     .max_in = 3,
     .max_out = 2,
     .infer = infer_sce,
     .prepare = prepare_sce,
     .kernel = sce_kernel,
     .grad = grad_sce,
     .nondiff_inputs = {1, 2}},
    {.name = "Dropout",
     .max_in = 3,
     .max_out = 2,
     .infer = infer_dropout,
     .prepare = prepare_dropout,
     .kernel = dropout_kernel,
     .grad = grad_dropout,
     .foldable = false,
     .nondiff_inputs = {1, 2},
     .random = true,
     .recompute = false},
    {.name = "SoftmaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_softmax_grad,
     .prepare = prepare_norm,
     .kernel = softmax_grad_kernel<false>,
     .inplace_input = 0},
    {.name = "LogSoftmaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_softmax_grad,
     .prepare = prepare_norm,
     .kernel = softmax_grad_kernel<true>,
     .inplace_input = 0},
    {.name = "LayerNormGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_layernorm_grad,
     .prepare = prepare_norm,
     .kernel = layernorm_grad_kernel},
    {.name = "SoftmaxCrossEntropyLossGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 4,
     .infer = infer_sce_grad,
     .prepare = prepare_sce,
     .kernel = sce_grad_kernel,
     .nondiff_inputs = {2}},
};

}  // namespace

uint64_t dropout_rng_state() { return dropout_counter().load(); }
void set_dropout_rng_state(uint64_t state) { dropout_counter() = state; }
uint64_t next_dropout_seed() { return dropout_counter()++; }

void register_nn_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
