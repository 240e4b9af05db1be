// Reductions: ReduceSum, ReduceMean, and graft's SumToShape (un-broadcasting for gradients).
#include <numeric>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// Which axes a Reduce* node reduces (sorted, unique); empty result with `noop` means identity.
std::vector<int> reduce_axes(const Node& n, const std::vector<int64_t>& axes_in, int rank,
                             bool& noop) {
  noop = false;
  std::vector<int> axes;
  if (axes_in.empty()) {
    if (n.attrs.get_int("noop_with_empty_axes", 0, n.label())) {
      noop = true;
      return axes;
    }
    for (int i = 0; i < rank; ++i) axes.push_back(i);
    return axes;
  }
  for (int64_t a : axes_in) {
    GRAFT_CHECK(a >= -rank && a < std::max(rank, 1), ErrorKind::InvalidModel,
                n.label() + ": axis " + std::to_string(a) + " is out of range for rank " +
                    std::to_string(rank));
    int ax = static_cast<int>(a < 0 ? a + rank : a);
    GRAFT_CHECK(std::find(axes.begin(), axes.end(), ax) == axes.end(), ErrorKind::InvalidModel,
                n.label() + ": axis " + std::to_string(a) + " is listed twice");
    axes.push_back(ax);
  }
  std::sort(axes.begin(), axes.end());
  return axes;
}

// Axes come from input 1 (ReduceSum-13) or the `axes` attribute (ReduceMean before opset 18).
std::vector<int64_t> axes_of_infer(InferCtx& c) {
  if (c.node().op == "ReduceSum") return c.has_in(1) ? c.ints_in(1) : std::vector<int64_t>{};
  return c.attrs().get_ints("axes", {}, c.node().label());
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
  bool noop;
  auto axes = reduce_axes(c.node(), axes_of_infer(c), static_cast<int>(c.shape(0).size()), noop);
  bool keep = c.attr_int("keepdims", 1);
  c.set_out(0, c.dtype(0), noop ? c.shape(0) : reduced_shape(c.shape(0), axes, keep));
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
    for (int64_t o = 0; o < outer; ++o) {
      if (inner == 1) {
        const T* p = x + o * mid;
        double acc = 0;
        for (int64_t m = 0; m < mid; ++m) acc += p[m];
        y[o] = static_cast<T>(mean ? acc / (mid ? mid : 1) : acc);
      } else {
        T* q = y + o * inner;
        std::fill(q, q + inner, T(0));
        for (int64_t m = 0; m < mid; ++m) {
          const T* p = x + (o * mid + m) * inner;
          for (int64_t i = 0; i < inner; ++i) q[i] += p[i];
        }
        if (mean)
          for (int64_t i = 0; i < inner; ++i) q[i] /= static_cast<T>(mid ? mid : 1);
      }
    }
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
    std::vector<int64_t> ax;
    if (c.node.op == "ReduceSum") {
      if (c.has_in(1))
        ax.assign(c.in(1).data<int64_t>(), c.in(1).data<int64_t>() + c.in(1).numel());
    } else {
      ax = c.attr_ints("axes");
    }
    bool noop;
    auto axes = reduce_axes(c.node, ax, x.rank(), noop);
    if (noop) {
      std::copy(x.data<T>(), x.data<T>() + x.numel(), c.out(0).data<T>());
      return;
    }
    reduce_sum<T>(x.data<T>(), x.shape(), axes, c.out(0).data<T>(), c.node.op == "ReduceMean");
  });
}

// dX = expand(reshape(dY, keepdims shape), X.shape) [/ count for the mean].
void grad_reduce(GradBuilder& g) {
  const Node& n = g.node();
  const Shape& xs = g.shape(g.x(0));
  std::vector<int64_t> ax;
  if (n.op == "ReduceSum") {
    if (n.inputs.size() > 1 && n.inputs[1] >= 0) {
      const Tensor& t = g.val(n.inputs[1]).data;
      ax.assign(t.data<int64_t>(), t.data<int64_t>() + t.numel());
    }
  } else {
    ax = n.attrs.get_ints("axes", {}, n.label());
  }
  bool noop;
  auto axes = reduce_axes(n, ax, static_cast<int>(xs.size()), noop);
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

const OpDef kOps[] = {
    {.name = "ReduceSum",
     .max_in = 2,
     .infer = infer_reduce,
     .kernel = reduce_kernel,
     .grad = grad_reduce,
     .nondiff_inputs = {1}},
    {.name = "ReduceMean", .infer = infer_reduce, .kernel = reduce_kernel, .grad = grad_reduce},
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
