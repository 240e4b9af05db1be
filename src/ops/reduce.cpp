// Reductions: ReduceSum, ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL2, ArgMax, ArgMin,
// TopK, CumSum, and graft's SumToShape (un-broadcasting for gradients), ReduceGrad and TopKGrad.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// The attributes of the reductions (ReduceSum, ReduceMean, ReduceMax, ..., and ReduceGrad).
struct ReduceAttrs {
  std::vector<int64_t> axes;  // the attribute; ReduceSum (opset 13) takes its axes as input 1
  bool axes_input = false;    // ReduceSum: axes from input 1
  bool mean = false;          // ReduceMean
  bool keepdims = true, noop_with_empty_axes = false;
  int64_t kind = 0;  // ReduceGrad: 0 max / min, 1 L2, 2 prod
};
ReduceAttrs reduce_attrs(const Node& n) {
  const std::string where = n.label();
  ReduceAttrs a;
  a.axes = n.attrs.get_ints("axes", {}, where);
  a.axes_input = n.op == "ReduceSum";
  a.mean = n.op == "ReduceMean";
  a.keepdims = n.attrs.get_int("keepdims", 1, where) != 0;
  a.noop_with_empty_axes = n.attrs.get_int("noop_with_empty_axes", 0, where) != 0;
  a.kind = n.attrs.get_int("kind", 0, where);
  return a;
}
std::shared_ptr<const void> prepare_reduce(const Node& n) { return prepared(reduce_attrs(n)); }

// Which axes a Reduce* node reduces (sorted, unique); empty result with `noop` means identity.
std::vector<int> reduce_axes(const Node& n, const ReduceAttrs& a,
                             const std::vector<int64_t>& axes_in, int rank, bool& noop) {
  noop = false;
  std::vector<int> axes;
  if (axes_in.empty()) {
    if (a.noop_with_empty_axes) {
      noop = true;
      return axes;
    }
    for (int i = 0; i < rank; ++i) axes.push_back(i);
    return axes;
  }
  for (int64_t a : axes_in) {
    const int ax = normalize_axis_scalar_ok(a, rank, n);
    GRAFT_CHECK(std::find(axes.begin(), axes.end(), ax) == axes.end(), ErrorKind::InvalidModel,
                n.label() + ": axis " + std::to_string(a) + " is listed twice");
    axes.push_back(ax);
  }
  std::sort(axes.begin(), axes.end());
  return axes;
}

// Axes come from input 1 (ReduceSum-13) or the `axes` attribute (ReduceMean before opset 18).
std::vector<int64_t> axes_of_infer(InferCtx& c, const ReduceAttrs& a) {
  if (a.axes_input) return c.has_in(1) ? c.ints_in(1) : std::vector<int64_t>{};
  return a.axes;
}

Shape reduced_shape(const Shape& s, const std::vector<int>& axes, bool keep) {
  Shape out;
  for (int i = 0; i < static_cast<int>(s.size()); ++i) {
    bool red = std::find(axes.begin(), axes.end(), i) != axes.end();
    if (!red)
      out.push_back(s[i]);
    else if (keep)
      out.push_back(1);
  }
  return out;
}

void infer_reduce(InferCtx& c) {
  require_float(c, 0);
  const ReduceAttrs a = reduce_attrs(c.node());
  bool noop;
  auto axes =
      reduce_axes(c.node(), a, axes_of_infer(c, a), static_cast<int>(c.shape(0).size()), noop);
  c.set_out(0, c.dtype(0), noop ? c.shape(0) : reduced_shape(c.shape(0), axes, a.keepdims));
}

template <class T>
void reduce_sum(const T* x, const Shape& s, const std::vector<int>& axes, T* y, bool mean) {
  const int64_t n_out = [&] {
    int64_t n = 1;
    for (int i = 0; i < static_cast<int>(s.size()); ++i)
      if (std::find(axes.begin(), axes.end(), i) == axes.end()) n *= s[i];
    return n;
  }();
  const int64_t n_in = numel(s);
  const int64_t count = n_out ? n_in / n_out : 0;
  bool contiguous =
      !axes.empty() && axes.back() - axes.front() + 1 == static_cast<int>(axes.size());
  if (contiguous) {
    int64_t outer, mid, inner;
    split3(s, axes.front(), axes.back() + 1, outer, mid, inner);
    if (inner == 1) {  // over the last axes: parallel over rows
      parallel_for(outer, mid, [&](int, int64_t o0, int64_t o1) {
        for (int64_t o = o0; o < o1; ++o) {
          const T* p = x + o * mid;
          double acc = 0;
          for (int64_t m = 0; m < mid; ++m) acc += p[m];
          y[o] = static_cast<T>(mean ? acc / (mid ? mid : 1) : acc);
        }
      });
      return;
    }
    // Parallel over (outer, column block); each output sums its mid values in order.
    const int64_t nb = (inner + 63) / 64;
    parallel_for(outer * nb, mid * 64, [&](int, int64_t q0, int64_t q1) {
      for (int64_t qb = q0; qb < q1; ++qb) {
        const int64_t o = qb / nb, i0 = (qb % nb) * 64, i1 = std::min(inner, i0 + 64);
        T* q = y + o * inner;
        std::fill(q + i0, q + i1, T(0));
        for (int64_t m = 0; m < mid; ++m) {
          const T* p = x + (o * mid + m) * inner;
          for (int64_t i = i0; i < i1; ++i) q[i] += p[i];
        }
        if (mean)
          for (int64_t i = i0; i < i1; ++i) q[i] /= static_cast<T>(mid ? mid : 1);
      }
    });
    return;
  }
  Shape kept = reduced_shape(s, axes, true);
  sum_to_shape<T>(x, s, y, kept, false);
  if (mean && count)
    for (int64_t i = 0; i < n_out; ++i) y[i] /= static_cast<T>(count);
}

void reduce_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    const ReduceAttrs& a = c.attrs<ReduceAttrs>();
    std::vector<int64_t> ax;
    if (a.axes_input) {
      if (c.has_in(1))
        ax.assign(c.in(1).data<int64_t>(), c.in(1).data<int64_t>() + c.in(1).numel());
    } else {
      ax = a.axes;
    }
    bool noop;
    auto axes = reduce_axes(c.node, a, ax, x.rank(), noop);
    if (noop) {
      std::copy(x.data<T>(), x.data<T>() + x.numel(), c.out(0).data<T>());
      return;
    }
    reduce_sum<T>(x.data<T>(), x.shape(), axes, c.out(0).data<T>(), a.mean);
  });
}

// dX = expand(reshape(dY, keepdims shape), X.shape) [/ count for the mean].
void grad_reduce(GradBuilder& g) {
  const Node& n = g.node();
  const Shape& xs = g.shape(g.x(0));
  const ReduceAttrs a = reduce_attrs(n);
  std::vector<int64_t> ax;
  if (a.axes_input) {
    if (n.inputs.size() > 1 && n.inputs[1] >= 0) {
      const Tensor& t = g.val(n.inputs[1]).data;
      ax.assign(t.data<int64_t>(), t.data<int64_t>() + t.numel());
    }
  } else {
    ax = a.axes;
  }
  bool noop;
  auto axes = reduce_axes(n, a, ax, static_cast<int>(xs.size()), noop);
  if (noop) {
    g.set_dx(0, g.dy(0));
    return;
  }
  int d = g.emit1("Reshape", {g.dy(0), g.ints(reduced_shape(xs, axes, true))});
  d = g.emit1("Expand", {d, g.ints(xs)});
  if (n.op == "ReduceMean") {
    int64_t count = 1;
    for (int a : axes) count *= xs[a];
    d = g.emit1("Mul", {d, g.scalar(1.0 / static_cast<double>(count ? count : 1), g.val(d).dtype)});
  }
  g.set_dx(0, d);
}

// ---- SumToShape: reduce a broadcast gradient back to `shape` (right-aligned numpy rules)
// ----------
void infer_sum_to_shape(InferCtx& c) {
  require_float(c, 0);
  Shape to = c.attrs().get_ints("shape", {}, c.node().label());
  Shape b;
  c.check(broadcast_shape(c.shape(0), to, b) && b == c.shape(0),
          "shape " + shape_str(to) + " does not broadcast to " + shape_str(c.shape(0)));
  c.set_out(0, c.dtype(0), to);
}
void sum_to_shape_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    sum_to_shape<T>(c.in(0).data<T>(), c.in(0).shape(), c.out(0).data<T>(), c.out(0).shape(),
                    false);
  });
}
void grad_sum_to_shape(GradBuilder& g) {
  g.set_dx(0, g.emit1("Expand", {g.dy(0), g.ints(g.shape(g.x(0)))}));
}

// ---- ReduceMax / ReduceMin / ReduceProd / ReduceL2 (axes as an attribute, opset <= 17)
// -----------
enum class Red { Max, Min, Prod, L2 };
void infer_reduce_any(InferCtx& c) {
  require_numeric(c, 0);
  const ReduceAttrs a = reduce_attrs(c.node());
  bool noop;
  auto axes =
      reduce_axes(c.node(), a, axes_of_infer(c, a), static_cast<int>(c.shape(0).size()), noop);
  c.set_out(0, c.dtype(0), noop ? c.shape(0) : reduced_shape(c.shape(0), axes, a.keepdims));
}
template <Red op>
void reduce_any_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    const Tensor& x = c.in(0);
    const ReduceAttrs& a = c.attrs<ReduceAttrs>();
    bool noop;
    auto axes = reduce_axes(c.node, a, a.axes, x.rank(), noop);
    T* y = c.out(0).data<T>();
    const T* px = x.data<T>();
    if (noop) {
      std::copy(px, px + x.numel(), y);
      return;
    }
    Shape kept = reduced_shape(x.shape(), axes, true);
    const int64_t n_out = numel(kept);
    std::vector<double> acc(n_out, op == Red::Max    ? -std::numeric_limits<double>::infinity()
                                   : op == Red::Min  ? std::numeric_limits<double>::infinity()
                                   : op == Red::Prod ? 1.0
                                                     : 0.0);
    std::vector<T> ext(n_out);
    std::vector<char> seen(n_out, 0);
    auto st = bcast_strides(kept, x.shape());
    for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
      const T v = px[i];
      if constexpr (op == Red::Max || op == Red::Min) {  // exact in T (int64 too); NaN propagates
        if (!seen[o[0]] || (op == Red::Max ? v > ext[o[0]] : v < ext[o[0]]) || v != v)
          ext[o[0]] = v;
        seen[o[0]] = 1;
      } else if constexpr (op == Red::Prod) {
        acc[o[0]] *= static_cast<double>(v);
      } else {
        acc[o[0]] += static_cast<double>(v) * static_cast<double>(v);
      }
    });
    for (int64_t i = 0; i < n_out; ++i) {
      if constexpr (op == Red::Max || op == Red::Min)
        y[i] = ext[i];
      else if constexpr (op == Red::Prod)
        y[i] = static_cast<T>(acc[i]);
      else
        y[i] = static_cast<T>(std::sqrt(acc[i]));
    }
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
// ReduceGrad(dy, x, y; axes, kind = 0 max/min | 1 l2 | 2 prod) -> dx: max / min split dy evenly
// between the elements that tie for the extreme (PyTorch's amax / amin); l2: dy * x / y; prod: dy
// times the product of the slice's other elements, exact where the slice holds zeros (as PyTorch's
// prod_backward: with one zero only that element gets a gradient, with two none does), the product
// of the nonzero elements taken in double.
void infer_reduce_grad(InferCtx& c) { c.set_out(0, c.dtype(1), c.shape(1)); }
void reduce_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(1).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(1);
    const ReduceAttrs& a = c.attrs<ReduceAttrs>();
    const std::vector<int> axes(a.axes.begin(), a.axes.end());
    Shape kept = reduced_shape(x.shape(), axes, true);
    auto st = bcast_strides(kept, x.shape());
    const T *dy = c.in(0).data<T>(), *px = x.data<T>(), *y = c.in(2).data<T>();
    T* dx = c.out(0).data<T>();
    if (a.kind == 1) {
      for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        dx[i] = y[o[0]] != T(0) ? dy[o[0]] * px[i] / y[o[0]] : T(0);
      });
      return;
    }
    if (a.kind == 2) {
      std::vector<double> nonzero(numel(kept), 1.0);
      std::vector<int64_t> zeros(numel(kept), 0);
      for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        if (px[i] == T(0))
          ++zeros[o[0]];
        else
          nonzero[o[0]] *= static_cast<double>(px[i]);
      });
      for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        const int64_t z = zeros[o[0]];
        const double others = z == 0                    ? nonzero[o[0]] / static_cast<double>(px[i])
                              : z == 1 && px[i] == T(0) ? nonzero[o[0]]
                                                        : 0.0;
        dx[i] = static_cast<T>(static_cast<double>(dy[o[0]]) * others);
      });
      return;
    }
    std::vector<int64_t> ties(numel(kept), 0);
    for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
      ties[o[0]] += px[i] == y[o[0]];
    });
    for_each_bcast<1>(x.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
      dx[i] = px[i] == y[o[0]] ? dy[o[0]] / static_cast<T>(ties[o[0]]) : T(0);
    });
  });
}
void grad_reduce_any(GradBuilder& g) {
  const Node& n = g.node();
  const Shape& xs = g.shape(g.x(0));
  const ReduceAttrs ra = reduce_attrs(n);
  bool noop;
  auto axes = reduce_axes(n, ra, ra.axes, static_cast<int>(xs.size()), noop);
  if (noop) {
    g.set_dx(0, g.dy(0));
    return;
  }
  Shape kept = reduced_shape(xs, axes, true);
  int dy = g.emit1("Reshape", {g.dy(0), g.ints(kept)});
  int y = g.emit1("Reshape", {g.y(0), g.ints(kept)});
  Attrs a;
  a.set_ints("axes", std::vector<int64_t>(axes.begin(), axes.end()));
  a.set_int("kind", n.op == "ReduceL2" ? 1 : n.op == "ReduceProd" ? 2 : 0);
  g.set_dx(0, g.emit1("ReduceGrad", {dy, g.x(0), y}, a, "graft"));
}

// ---- ArgMax / ArgMin (int64 indices; not differentiable)
// -----------------------------------------
struct ArgAttrs {
  int64_t axis = 0;
  bool keepdims = true, select_last_index = false;
};
ArgAttrs arg_attrs(const Node& n) {
  const std::string where = n.label();
  return {n.attrs.get_int("axis", 0, where), n.attrs.get_int("keepdims", 1, where) != 0,
          n.attrs.get_int("select_last_index", 0, where) != 0};
}
std::shared_ptr<const void> prepare_arg(const Node& n) { return prepared(arg_attrs(n)); }
void infer_arg(InferCtx& c) {
  require_numeric(c, 0);
  Shape s = c.shape(0);
  const ArgAttrs a = arg_attrs(c.node());
  int ax = normalize_axis(a.axis, static_cast<int>(s.size()), c.node());
  if (a.keepdims)
    s[ax] = 1;
  else
    s.erase(s.begin() + ax);
  c.set_out(0, DType::I64, s);
}
template <bool kMax>
void arg_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    const Tensor& x = c.in(0);
    const ArgAttrs& a = c.attrs<ArgAttrs>();
    const int ax = normalize_axis(a.axis, x.rank(), c.node);
    const bool last = a.select_last_index;
    int64_t outer, n, inner;
    split3(x.shape(), ax, ax + 1, outer, n, inner);
    const T* px = x.data<T>();
    int64_t* y = c.out(0).data<int64_t>();
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        int64_t best = 0;
        for (int64_t k = 1; k < n; ++k) {
          T v = px[(o * n + k) * inner + i], b = px[(o * n + best) * inner + i];
          if (kMax ? (v > b || (last && v == b)) : (v < b || (last && v == b))) best = k;
        }
        y[o * inner + i] = best;
      }
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}

// ---- TopK(X, K; axis, largest, sorted) -> Values, Indices
// ---------------------------------------------
// The K largest (smallest) elements along axis, in order; among equal values the lower index
// first (ONNX's rule); NaN counts as larger than every number (PyTorch's). sorted=0 is served
// sorted, which ONNX allows. Its gradient (TopKGrad) puts dValues back at the indices.
int64_t topk_k(const Tensor& k, const std::string& where) {
  GRAFT_CHECK(k.numel() == 1 && is_int(k.dtype()), ErrorKind::InvalidModel,
              where + ": K must be a one-element integer tensor");
  return static_cast<int64_t>(k.at(0));
}
struct TopKAttrs {
  int64_t axis = -1;
  bool largest = true;
};
TopKAttrs topk_attrs(const Node& n) {
  return {n.attrs.get_int("axis", -1, n.label()), n.attrs.get_int("largest", 1, n.label()) != 0};
}
std::shared_ptr<const void> prepare_topk(const Node& n) { return prepared(topk_attrs(n)); }
// TopK's and TopKGrad's axis, non-negative.
int topk_axis(const KernelCtx& c, int rank) {
  return normalize_axis(c.attrs<TopKAttrs>().axis, rank, c.node);
}
void infer_topk(InferCtx& c) {
  require_numeric(c, 0);
  Shape s = c.shape(0);
  if (s.empty()) c.error(ErrorKind::ShapeMismatch, "X must have at least one dim");
  const int ax = normalize_axis(topk_attrs(c.node()).axis, static_cast<int>(s.size()), c.node());
  const std::vector<int64_t> k = c.ints_in(1);
  c.check(k.size() == 1, "K must hold one value");
  if (k[0] < 0 || k[0] > s[ax])
    c.error(ErrorKind::ShapeMismatch, "K = " + std::to_string(k[0]) + " is outside [0, " +
                                          std::to_string(s[ax]) + "], the size of axis " +
                                          std::to_string(ax));
  s[ax] = k[0];
  c.set_out(0, c.dtype(0), s);
  if (c.has_out(1)) c.set_out(1, DType::I64, s);
}
void topk_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    const Tensor& x = c.in(0);
    const int ax = topk_axis(c, x.rank());
    const bool largest = c.attrs<TopKAttrs>().largest;
    const int64_t K = topk_k(c.in(1), c.node.label());
    int64_t outer, n, inner;
    split3(x.shape(), ax, ax + 1, outer, n, inner);
    const T* px = x.data<T>();
    T* vals = c.has_out(0) ? c.out(0).data<T>() : nullptr;
    int64_t* idx = c.has_out(1) ? c.out(1).data<int64_t>() : nullptr;
    parallel_for(outer * inner, n * 8, [&](int, int64_t r0, int64_t r1) {
      std::vector<int64_t> order(n);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t o = r / inner, i = r % inner;
        const T* row = px + o * n * inner + i;     // element k at row[k * inner]
        auto before = [&](int64_t a, int64_t b) {  // a comes first
          const T va = row[a * inner], vb = row[b * inner];
          if constexpr (std::is_floating_point_v<T>) {
            const bool na = std::isnan(va), nb = std::isnan(vb);
            if (na || nb) return na != nb ? (largest ? na : nb) : a < b;
          }
          if (va != vb) return largest ? va > vb : va < vb;
          return a < b;
        };
        std::iota(order.begin(), order.end(), int64_t{0});
        std::partial_sort(order.begin(), order.begin() + K, order.end(), before);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t at = (o * K + k) * inner + i;
          if (vals) vals[at] = row[order[k] * inner];
          if (idx) idx[at] = order[k];
        }
      }
    });
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
void grad_topk(GradBuilder& g) {
  if (g.dy(0) < 0 || !g.needs(0)) return;
  Attrs a;
  a.set_int("axis", topk_attrs(g.node()).axis);
  g.set_dx(0, g.emit1("TopKGrad", {g.dy(0), g.y(1), g.ints(g.shape(g.x(0)))}, a, "graft"));
}
// TopKGrad(dValues, Indices, X's shape; axis) -> dX: zeros, with dValues at the indices along
// axis (the indices of one slice are distinct, so each place gets at most one value). X itself is
// not kept for backward.
void infer_topk_grad(InferCtx& c) { c.set_out(0, c.dtype(0), c.ints_in(2)); }
void topk_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &dv = c.in(0), &ix = c.in(1);
    Tensor& dx = c.out(0);
    const int ax = topk_axis(c, dx.rank());
    int64_t outer, n, inner, K = dv.dim(ax);
    split3(dx.shape(), ax, ax + 1, outer, n, inner);
    T* pdx = dx.data<T>();
    std::fill(pdx, pdx + dx.numel(), T(0));
    const T* pdv = dv.data<T>();
    const int64_t* pix = ix.data<int64_t>();
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < inner; ++i) {
          const int64_t at = (o * K + k) * inner + i, j = pix[at];
          if (j < 0 || j >= n) c.error(ErrorKind::InvalidArgument, "an index is out of range");
          pdx[(o * n + j) * inner + i] = pdv[at];
        }
  });
}

// ---- CumSum(x, axis; exclusive, reverse)
// ------------------------------------------------------------
// CumSum's axis: its input 1, read at run time (it may be a graph input).
int cumsum_axis(const Tensor& t, int rank, const Node& n) {
  GRAFT_CHECK(t.numel() == 1 && is_int(t.dtype()), ErrorKind::InvalidModel,
              n.label() + ": axis must be an integer scalar");
  return normalize_axis(static_cast<int64_t>(t.at(0)), rank, n);
}
struct CumSumAttrs {
  bool exclusive = false, reverse = false;
};
std::shared_ptr<const void> prepare_cumsum(const Node& n) {
  return prepared(CumSumAttrs{n.attrs.get_int("exclusive", 0, n.label()) != 0,
                              n.attrs.get_int("reverse", 0, n.label()) != 0});
}
void infer_cumsum(InferCtx& c) {
  require_numeric(c, 0);
  c.check(numel(c.shape(1)) == 1, "axis must be a scalar");
  if (!is_int(c.dtype(1))) c.error(ErrorKind::InvalidModel, "axis must be an integer");
  infer_same(c);
}
void cumsum_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    const Tensor& x = c.in(0);
    int ax = cumsum_axis(c.in(1), x.rank(), c.node);
    const bool excl = c.attrs<CumSumAttrs>().exclusive, rev = c.attrs<CumSumAttrs>().reverse;
    int64_t outer, n, inner;
    split3(x.shape(), ax, ax + 1, outer, n, inner);
    const T* px = x.data<T>();
    T* y = c.out(0).data<T>();
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        T acc = T(0);
        for (int64_t kk = 0; kk < n; ++kk) {
          int64_t k = rev ? n - 1 - kk : kk;
          int64_t j = (o * n + k) * inner + i;
          T v = px[j];
          if (excl) {
            y[j] = acc;
            acc += v;
          } else {
            acc += v;
            y[j] = acc;
          }
        }
      }
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
void grad_cumsum(GradBuilder& g) {
  Attrs a = g.node().attrs;
  a.set_int("reverse", !g.node().attrs.get_int("reverse", 0, g.node().label()));
  g.set_dx(0, g.emit1("CumSum", {g.dy(0), g.x(1)}, a));
}

const OpDef kOps[] = {
    {.name = "ReduceMax",
     .infer = infer_reduce_any,
     .prepare = prepare_reduce,
     .kernel = reduce_any_kernel<Red::Max>,
     .grad = grad_reduce_any},
    {.name = "ReduceMin",
     .infer = infer_reduce_any,
     .prepare = prepare_reduce,
     .kernel = reduce_any_kernel<Red::Min>,
     .grad = grad_reduce_any},
    {.name = "ReduceProd",
     .infer = infer_reduce_any,
     .prepare = prepare_reduce,
     .kernel = reduce_any_kernel<Red::Prod>,
     .grad = grad_reduce_any},
    {.name = "ReduceL2",
     .infer = infer_reduce_any,
     .prepare = prepare_reduce,
     .kernel = reduce_any_kernel<Red::L2>,
     .grad = grad_reduce_any},
    {.name = "ArgMax", .infer = infer_arg, .prepare = prepare_arg, .kernel = arg_kernel<true>},
    {.name = "ArgMin", .infer = infer_arg, .prepare = prepare_arg, .kernel = arg_kernel<false>},
    {.name = "TopK",
     .min_in = 2,
     .max_in = 2,
     .max_out = 2,
     .infer = infer_topk,
     .prepare = prepare_topk,
     .kernel = topk_kernel,
     .grad = grad_topk,
     .nondiff_inputs = {1}},
    {.name = "TopKGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .infer = infer_topk_grad,
     .prepare = prepare_topk,
     .kernel = topk_grad_kernel},
    {.name = "CumSum",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_cumsum,
     .prepare = prepare_cumsum,
     .kernel = cumsum_kernel,
     .grad = grad_cumsum,
     .nondiff_inputs = {1}},
    {.name = "ReduceGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .infer = infer_reduce_grad,
     .prepare = prepare_reduce,
     .kernel = reduce_grad_kernel},
    {.name = "ReduceSum",
     .max_in = 2,
     .infer = infer_reduce,
     .prepare = prepare_reduce,
     .kernel = reduce_kernel,
     .grad = grad_reduce,
     .nondiff_inputs = {1}},
    {.name = "ReduceMean",
     .infer = infer_reduce,
     .prepare = prepare_reduce,
     .kernel = reduce_kernel,
     .grad = grad_reduce},
    {.name = "SumToShape",
     .domain = "graft",
     .infer = infer_sum_to_shape,
     .kernel = sum_to_shape_kernel,
     .grad = grad_sum_to_shape},
};

}  // namespace

void register_reduce_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
