// Softmax and LogSoftmax (one axis), and SoftmaxCrossEntropyLoss, with graft's fused gradient
// kernels SoftmaxGrad, LogSoftmaxGrad and SoftmaxCrossEntropyLossGrad. Sums are accumulated in
// double.
#include <cmath>
#include <type_traits>

#include "util.h"
#include "vmath.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- Softmax / LogSoftmax (opset 13: one axis) --------------------------------------------------
// The attributes of Softmax, LogSoftmax and their gradients.
struct SoftmaxAttrs {
  int64_t axis = -1;  // as given (normalize_axis_scalar_ok for the input's rank)
};
SoftmaxAttrs softmax_attrs(const Node& n) { return {n.attrs.get_int("axis", -1, n.label())}; }
std::shared_ptr<const void> prepare_softmax(const Node& n) { return prepared(softmax_attrs(n)); }
void infer_softmax(InferCtx& c) {
  require_float(c, 0);
  normalize_axis_scalar_ok(softmax_attrs(c.node()).axis, static_cast<int>(c.shape(0).size()),
                           c.node());
  infer_same(c);
}
template <bool kLog>
void softmax_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  const int ax = normalize_axis_scalar_ok(c.attrs<SoftmaxAttrs>().axis, x.rank(), c.node);
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
  const int ax = normalize_axis_scalar_ok(c.attrs<SoftmaxAttrs>().axis, dy.rank(), c.node);
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
  a.set_int("axis", normalize_axis_scalar_ok(softmax_attrs(g.node()).axis,
                                             static_cast<int>(g.shape(g.x(0)).size()), g.node()));
  g.set_dx(0, g.emit1("SoftmaxGrad", {g.dy(0), g.y(0)}, a, "graft"));
}
void grad_log_softmax(GradBuilder& g) {
  Attrs a;
  a.set_int("axis", normalize_axis_scalar_ok(softmax_attrs(g.node()).axis,
                                             static_cast<int>(g.shape(g.x(0)).size()), g.node()));
  g.set_dx(0, g.emit1("LogSoftmaxGrad", {g.dy(0), g.y(0)}, a, "graft"));
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
// Every label is a class or the ignored index (checked before the parallel loops, which cannot
// throw); returns the sum of the weights of the positions that count (the mean's divisor).
template <class T>
double sce_check_labels(const KernelCtx& c, const int64_t* lab, const T* w, int64_t positions,
                        int64_t C, int64_t ignore, bool has_ignore) {
  double sw = 0;
  for (int64_t i = 0; i < positions; ++i) {
    const int64_t y = lab[i];
    if (has_ignore && y == ignore) continue;
    if (y < 0 || y >= C)
      c.error(ErrorKind::InvalidArgument,
              "label " + std::to_string(y) + " is out of range [0, " + std::to_string(C) + ")");
    sw += w ? static_cast<double>(w[y]) : 1.0;
  }
  return sw;
}
// One position's line of C scores (stride st): its max, and the sum of exp(x - max) in double.
// float32 contiguous lines with vmath: the exps by the vector exp into `e` (left there for the
// caller), summed in 8 fixed partial sums; otherwise libm's exp in double.
template <class T>
GRAFT_INLINE void sce_line(const T* p, int64_t C, int64_t st, float* e, double& mx, double& sum) {
  if constexpr (std::is_same_v<T, float>) {
    if (e) {
      const float m = vmath::max_of(p, C);
      for (int64_t k = 0; k < C; ++k) e[k] = p[k] - m;
      vmath::map(vmath::Fn::Exp, e, e, C);
      mx = m;
      sum = sum8(C, [&](int64_t k) { return static_cast<double>(e[k]); });
      return;
    }
  }
  mx = p[0];
  for (int64_t k = 1; k < C; ++k) mx = std::max<double>(mx, p[k * st]);
  sum = 0;
  for (int64_t k = 0; k < C; ++k) sum += std::exp(p[k * st] - mx);
}
// Positions in parallel (a language model's head: B*T lines of the vocabulary); each position's
// sums run in a fixed order, so results do not depend on the thread count.
void sce_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  SceView v = sce_view(x.shape());
  const SceAttrs& a = c.attrs<SceAttrs>();
  const bool has_ignore = a.has_ignore;
  const int64_t ignore = a.ignore_index;
  const Reduction red = a.reduction;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    const int64_t* lab = c.in(1).data<int64_t>();
    const T* w = c.has_in(2) ? c.in(2).data<T>() : nullptr;
    T* lp = c.has_out(1) ? c.out(1).data<T>() : nullptr;
    const int64_t P = v.N * v.D;
    const double sw = sce_check_labels<T>(c, lab, w, P, v.C, ignore, has_ignore);
    std::vector<double> term(P, 0.0);
    const bool vec = std::is_same_v<T, float> && vmath::active() && v.D == 1;
    parallel_for(P, (vec ? 8 : 24) * v.C, [&](int, int64_t l0, int64_t l1) {
      std::vector<float> e(vec ? v.C : 0);
      for (int64_t pos = l0; pos < l1; ++pos) {
        const int64_t nn = pos / v.D, d = pos % v.D;
        const T* p = px + nn * v.C * v.D + d;
        double mx, sum;
        sce_line<T>(p, v.C, v.D, vec ? e.data() : nullptr, mx, sum);
        const double lse = std::log(sum) + mx;
        if (lp)
          for (int64_t k = 0; k < v.C; ++k)
            lp[nn * v.C * v.D + k * v.D + d] = static_cast<T>(p[k * v.D] - lse);
        const int64_t y = lab[pos];
        if (has_ignore && y == ignore) continue;
        term[pos] = -(w ? static_cast<double>(w[y]) : 1.0) * (p[y * v.D] - lse);
      }
    });
    T* loss = c.out(0).data<T>();
    if (red == Reduction::None) {
      for (int64_t i = 0; i < P; ++i) loss[i] = static_cast<T>(term[i]);
      return;
    }
    double s = 0;
    for (int64_t i = 0; i < P; ++i) s += term[i];
    loss[0] = static_cast<T>(red == Reduction::Sum ? s : (sw != 0 ? s / sw : 0.0));
  });
}
// SoftmaxCrossEntropyLossGrad(dloss, scores, labels[, weights]) -> dscores
//   = coef * (softmax(scores) - onehot(label)), coef = dloss * weight (/ the weights' sum for the
// mean). One pass per position: float32 contiguous lines write the exps straight into dscores and
// scale them there.
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
    const int64_t P = v.N * v.D;
    const double sw = sce_check_labels<T>(c, lab, w, P, v.C, ignore, has_ignore);
    const bool vec = std::is_same_v<T, float> && vmath::active() && v.D == 1;
    parallel_for(P, (vec ? 6 : 40) * v.C, [&](int, int64_t l0, int64_t l1) {
      for (int64_t pos = l0; pos < l1; ++pos) {
        const int64_t nn = pos / v.D, d = pos % v.D, y = lab[pos];
        const T* p = px + nn * v.C * v.D + d;
        T* q = dx + nn * v.C * v.D + d;
        double coef = 0;
        if (!(has_ignore && y == ignore)) {
          coef = red == Reduction::None  ? dl[pos]
                 : red == Reduction::Sum ? dl[0]
                                         : (sw != 0 ? dl[0] / sw : 0.0);
          coef *= w ? static_cast<double>(w[y]) : 1.0;
        }
        if (coef == 0) {
          for (int64_t k = 0; k < v.C; ++k) q[k * v.D] = T(0);
          continue;
        }
        double mx, sum;
        if (vec) {
          float* e = reinterpret_cast<float*>(q);
          sce_line<T>(p, v.C, 1, e, mx, sum);
          const double ey = e[y];
          const float scale = static_cast<float>(coef / sum);
          for (int64_t k = 0; k < v.C; ++k) e[k] *= scale;
          e[y] = static_cast<float>(coef * (ey / sum - 1.0));
          continue;
        }
        sce_line<T>(p, v.C, v.D, nullptr, mx, sum);
        for (int64_t k = 0; k < v.C; ++k)
          q[k * v.D] =
              static_cast<T>(coef * (std::exp(p[k * v.D] - mx) / sum - (k == y ? 1.0 : 0.0)));
      }
    });
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

const OpDef kOps[] = {
    // In place: the kernel reads a whole line before writing it.
    {.name = "Softmax",
     .infer = infer_softmax,
     .prepare = prepare_softmax,
     .kernel = softmax_kernel<false>,
     .grad = grad_softmax,
     .inplace_input = 0},
    {.name = "LogSoftmax",
     .infer = infer_softmax,
     .prepare = prepare_softmax,
     .kernel = softmax_kernel<true>,
     .grad = grad_log_softmax,
     .inplace_input = 0},
    {.name = "SoftmaxCrossEntropyLoss",
     .min_in = 2,
     .max_in = 3,
     .max_out = 2,
     .infer = infer_sce,
     .prepare = prepare_sce,
     .kernel = sce_kernel,
     .grad = grad_sce,
     .nondiff_inputs = {1, 2}},
    {.name = "SoftmaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_softmax_grad,
     .prepare = prepare_softmax,
     .kernel = softmax_grad_kernel<false>,
     .inplace_input = 0},
    {.name = "LogSoftmaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_softmax_grad,
     .prepare = prepare_softmax,
     .kernel = softmax_grad_kernel<true>,
     .inplace_input = 0},
    {.name = "SoftmaxCrossEntropyLossGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 4,
     .infer = infer_sce_grad,
     .prepare = prepare_sce,
     .kernel = sce_grad_kernel,
     // dscores over the scores: each position reads its own line before writing it (the exps
     // go straight into the output), so the language models' largest backward value (GPT-2's
     // 2048 x 50257 logits, 393 MiB) is not held twice at the loss.
     .inplace_input = 1,
     .nondiff_inputs = {2}},
};

}  // namespace

void register_softmax_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
