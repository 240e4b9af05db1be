// Ops that read or write their data at computed indices, and their gradients: Slice, Gather,
// GatherND, ScatterND, Pad, and graft's SliceGrad, GatherGrad (embedding gradients), GatherNDGrad
// and PadGrad. The other shape and data-movement ops are in shape_ops.cpp.
#include <functional>
#include <optional>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- Slice ------------------------------------------------------------------------------------
// Normalized per-dimension start and step for data of shape `s`; fills the output shape.
struct SliceSpec {
  std::vector<int64_t> start, step;
  Shape out;
};
SliceSpec slice_spec(const Node& n, const Shape& s, std::vector<int64_t> starts,
                     std::vector<int64_t> ends, std::vector<int64_t> axes,
                     std::vector<int64_t> steps,
                     const std::function<void(const std::string&)>& err) {
  const int r = static_cast<int>(s.size());
  if (starts.size() != ends.size()) err("starts and ends differ in length");
  if (axes.empty())
    for (size_t i = 0; i < starts.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  if (steps.empty()) steps.assign(starts.size(), 1);
  if (axes.size() != starts.size() || steps.size() != starts.size())
    err("starts, ends, axes and steps differ in length");
  SliceSpec sp;
  sp.start.assign(r, 0);
  sp.step.assign(r, 1);
  sp.out = s;
  std::vector<bool> seen(r, false);
  for (size_t i = 0; i < axes.size(); ++i) {
    const int a = normalize_axis(axes[i], r, n);
    if (seen[a]) err("axis repeated");
    seen[a] = true;
    int64_t dim = s[a], st = steps[i], b = starts[i], e = ends[i];
    if (st == 0 || st == INT64_MIN) err("step " + std::to_string(st) + " is not allowed");
    if (dim == 0) {  // nothing to take (and the clamping below needs dim >= 1)
      sp.step[a] = st;
      sp.out[a] = 0;
      continue;
    }
    if (b < 0) b += dim;
    if (e < 0 && e > INT64_MIN / 2) e += dim;
    int64_t len;
    if (st > 0) {
      b = std::clamp<int64_t>(b, 0, dim);
      e = std::clamp<int64_t>(e, 0, dim);
      len = e > b ? (e - b - 1) / st + 1 : 0;
    } else {
      b = std::clamp<int64_t>(b, 0, dim - 1);
      e = std::clamp<int64_t>(e, -1, dim - 1);
      len = b > e ? (b - e - 1) / (-st) + 1 : 0;
    }
    sp.start[a] = b;
    sp.step[a] = st;
    sp.out[a] = len;
  }
  return sp;
}
SliceSpec slice_spec_infer(InferCtx& c) {
  auto opt = [&](int i) { return c.has_in(i) ? c.ints_in(i) : std::vector<int64_t>{}; };
  return slice_spec(c.node(), c.shape(0), c.ints_in(1), c.ints_in(2), opt(3), opt(4),
                    [&](const std::string& m) { c.error(ErrorKind::InvalidModel, m); });
}
void infer_slice(InferCtx& c) { c.set_out(0, c.dtype(0), slice_spec_infer(c).out); }

// Copies between a strided window of `big` (shape bs) and dense `small` (shape ss).
template <class T>
void window_copy(T* big, const Shape& bs, T* small, const Shape& ss,
                 const std::vector<int64_t>& start, const std::vector<int64_t>& step,
                 bool to_small) {
  const int r = static_cast<int>(bs.size());
  std::vector<int64_t> st(r), wst(r);
  int64_t s = 1, base = 0;
  for (int i = r - 1; i >= 0; --i) {
    st[i] = s;
    s *= bs[i];
  }
  for (int i = 0; i < r; ++i) {
    wst[i] = st[i] * step[i];
    base += start[i] * st[i];
  }
  for_each_bcast<1>(ss, {wst}, [&](int64_t i, const std::array<int64_t, 1>& o) {
    if (to_small)
      small[i] = big[base + o[0]];
    else
      big[base + o[0]] = small[i];
  });
}
std::vector<int64_t> tensor_ints(const Tensor& t) {
  return std::vector<int64_t>(t.data<int64_t>(), t.data<int64_t>() + t.numel());
}
void slice_kernel(KernelCtx& c) {
  auto opt = [&](int i) { return c.has_in(i) ? tensor_ints(c.in(i)) : std::vector<int64_t>{}; };
  auto sp = slice_spec(c.node, c.in(0).shape(), tensor_ints(c.in(1)), tensor_ints(c.in(2)), opt(3),
                       opt(4), [&](const std::string& m) { c.error(ErrorKind::InvalidModel, m); });
  dispatch(c.in(0).dtype(), [&]<class T>() {
    window_copy<T>(c.in(0).data<T>(), c.in(0).shape(), c.out(0).data<T>(), sp.out, sp.start,
                   sp.step, true);
  });
}
void grad_slice(GradBuilder& g) {
  const Node& n = g.node();
  auto ints_of = [&](int i) {
    return i < static_cast<int>(n.inputs.size()) && n.inputs[i] >= 0
               ? tensor_ints(g.val(n.inputs[i]).data)
               : std::vector<int64_t>{};
  };
  auto sp = slice_spec(
      n, g.shape(g.x(0)), ints_of(1), ints_of(2), ints_of(3), ints_of(4),
      [&](const std::string& m) { fail(ErrorKind::InvalidModel, n.label() + ": " + m); });
  Attrs a;
  a.set_ints("shape", g.shape(g.x(0)));
  a.set_ints("starts", sp.start);
  a.set_ints("steps", sp.step);
  g.set_dx(0, g.emit1("SliceGrad", {g.dy(0)}, a, "graft"));
}
void infer_slice_grad(InferCtx& c) {
  c.set_out(0, c.dtype(0), c.attrs().get_ints("shape", {}, c.node().label()));
}
struct SliceGradAttrs {
  std::vector<int64_t> starts, steps;  // per dim of dx, normalized by grad_slice
};
std::shared_ptr<const void> prepare_slice_grad(const Node& n) {
  return prepared(SliceGradAttrs{n.attrs.get_ints("starts", {}, n.label()),
                                 n.attrs.get_ints("steps", {}, n.label())});
}
void slice_grad_kernel(KernelCtx& c) {
  Tensor& dx = c.out(0);
  std::memset(dx.raw(), 0, dx.nbytes());
  dispatch_float(dx.dtype(), c, [&]<class T>() {
    window_copy<T>(dx.data<T>(), dx.shape(), c.in(0).data<T>(), c.in(0).shape(),
                   c.attrs<SliceGradAttrs>().starts, c.attrs<SliceGradAttrs>().steps, false);
  });
}

// ---- Gather -----------------------------------------------------------------------------------
// The axis of Gather and GatherGrad (as given: normalized for the input's rank where used), and
// GatherGrad's padding_idx.
struct GatherAttrs {
  int64_t axis = 0;
  std::optional<int64_t> padding_idx;
};
GatherAttrs gather_attrs(const Node& n) {
  GatherAttrs a;
  a.axis = n.attrs.get_int("axis", 0, n.label());
  if (n.attrs.has("padding_idx")) a.padding_idx = n.attrs.get_int("padding_idx", 0, n.label());
  return a;
}
std::shared_ptr<const void> prepare_gather(const Node& n) { return prepared(gather_attrs(n)); }
void infer_gather(InferCtx& c) {
  const Shape& s = c.shape(0);
  int ax = normalize_axis(gather_attrs(c.node()).axis, static_cast<int>(s.size()), c.node());
  if (c.dtype(1) != DType::I64)
    c.error(ErrorKind::Unsupported,
            std::string("indices have dtype ") + dtype_name(c.dtype(1)) + "; graft supports int64");
  Shape out(s.begin(), s.begin() + ax);
  for (int64_t d : c.shape(1)) out.push_back(d);
  out.insert(out.end(), s.begin() + ax + 1, s.end());
  c.set_out(0, c.dtype(0), out);
}
// (outer, n_idx, inner) view shared by Gather and GatherGrad; checks indices.
template <class T, bool kScatter>
void gather_impl(const KernelCtx& c, const Tensor& idx, T* data, const Shape& ds, T* small,
                 int ax) {
  int64_t outer, mid, inner;
  split3(ds, ax, ax + 1, outer, mid, inner);
  const int64_t ni = idx.numel();
  const int64_t* pi = idx.data<int64_t>();
  for (int64_t j = 0; j < ni; ++j)
    if (pi[j] < -mid || pi[j] >= mid)
      c.error(ErrorKind::InvalidArgument, "index " + std::to_string(pi[j]) +
                                              " is out of range for axis " + std::to_string(ax) +
                                              " of size " + std::to_string(mid));
  if constexpr (kScatter) {
    // Rows may repeat (the same token twice): parallel over column blocks, each adding its rows
    // in index order, so the sums do not depend on the thread count.
    parallel_blocks(
        inner, outer * ni,
        [&](int, int64_t i0, int64_t i1) {
          for (int64_t o = 0; o < outer; ++o)
            for (int64_t j = 0; j < ni; ++j) {
              const int64_t k = pi[j] < 0 ? pi[j] + mid : pi[j];
              T* d = data + (o * mid + k) * inner;
              const T* s = small + (o * ni + j) * inner;
              for (int64_t i = i0; i < i1; ++i) d[i] += s[i];
            }
        },
        16);
  } else {
    parallel_for(outer * ni, inner, [&](int, int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t o = row / ni, j = row % ni;
        const int64_t k = pi[j] < 0 ? pi[j] + mid : pi[j];
        std::memcpy(small + row * inner, data + (o * mid + k) * inner, inner * sizeof(T));
      }
    });
  }
}
void gather_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  const int ax = normalize_axis(c.attrs<GatherAttrs>().axis, x.rank(), c.node);
  dispatch(x.dtype(), [&]<class T>() {
    gather_impl<T, false>(c, c.in(1), x.data<T>(), x.shape(), c.out(0).data<T>(), ax);
  });
}
void grad_gather(GradBuilder& g) {
  Attrs a;
  a.set_int("axis", normalize_axis(gather_attrs(g.node()).axis,
                                   static_cast<int>(g.shape(g.x(0)).size()), g.node()));
  a.set_ints("shape", g.shape(g.x(0)));
  // graft's own attribute, set by the PyTorch front end on an nn.Embedding's lookup (the exporter
  // drops padding_idx): that row gets no gradient from the lookup, as in eager.
  if (const Attr* p = g.node().attrs.find("padding_idx")) a.set("padding_idx", *p);
  g.set_dx(0, g.emit1("GatherGrad", {g.dy(0), g.x(1)}, a, "graft"));
}
void infer_gather_grad(InferCtx& c) {
  c.set_out(0, c.dtype(0), c.attrs().get_ints("shape", {}, c.node().label()));
}
// Scatter-add of dy rows into a zeroed dx (embedding gradients).
void gather_grad_kernel(KernelCtx& c) {
  Tensor& dx = c.out(0);
  char* raw = static_cast<char*>(dx.raw());
  parallel_blocks(
      static_cast<int64_t>(dx.nbytes()), 1,
      [&](int, int64_t b, int64_t e) { std::memset(raw + b, 0, e - b); }, 4096);
  dispatch_float(dx.dtype(), c, [&]<class T>() {
    const GatherAttrs& a = c.attrs<GatherAttrs>();
    const int axis = static_cast<int>(a.axis);  // non-negative: grad_gather normalized it
    gather_impl<T, true>(c, c.in(1), dx.data<T>(), dx.shape(), c.in(0).data<T>(), axis);
    if (a.padding_idx && axis == 0 && dx.rank() >= 1) {
      int64_t p = *a.padding_idx, rows = dx.dim(0);
      if (p < 0) p += rows;
      if (p >= 0 && p < rows) {
        const int64_t row = dx.numel() / std::max<int64_t>(rows, 1);
        std::fill(dx.data<T>() + p * row, dx.data<T>() + (p + 1) * row, T(0));
      }
    }
  });
}

// ---- ScatterND(data, indices, updates; reduction = none) and GatherND(data, indices)
// --------------- indices [..., k] address slices of data's last rank-k dims; negative indices
// count from the end.
struct NdIndex {
  int64_t n, k, slice;  // index tuples, tuple length, elements per addressed slice
};
NdIndex nd_index(const Shape& data, const Shape& idx,
                 const std::function<void(const std::string&)>& err) {
  if (idx.empty()) err("indices must have rank >= 1");
  NdIndex r{1, idx.back(), 1};
  if (r.k < 1 || r.k > static_cast<int64_t>(data.size()))
    err("the last dimension of indices is out of range");
  for (size_t i = 0; i + 1 < idx.size(); ++i) r.n *= idx[i];
  for (size_t i = r.k; i < data.size(); ++i) r.slice *= data[i];
  return r;
}
int64_t nd_offset(const int64_t* t, const Shape& data, int64_t k, int64_t slice,
                  const KernelCtx& c) {
  int64_t off = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t v = t[j], d = data[j];
    if (v < -d || v >= d)
      c.error(ErrorKind::InvalidArgument, "index " + std::to_string(v) + " is out of range");
    off = off * d + (v < 0 ? v + d : v);
  }
  return off * slice;
}
void infer_scatter_nd(InferCtx& c) {
  if (c.dtype(1) != DType::I64) c.error(ErrorKind::Unsupported, "indices must be int64");
  if (c.dtype(2) != c.dtype(0))
    c.error(ErrorKind::InvalidModel, "updates differ in dtype from data");
  std::string red = c.attrs().get_string("reduction", "none", c.node().label());
  if (red != "none") c.error(ErrorKind::Unsupported, "reduction '" + red + "' (only 'none')");
  auto ix = nd_index(c.shape(0), c.shape(1),
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  Shape want(c.shape(1).begin(), c.shape(1).end() - 1);
  want.insert(want.end(), c.shape(0).begin() + ix.k, c.shape(0).end());
  c.check(c.shape(2) == want,
          "updates have shape " + shape_str(c.shape(2)) + ", expected " + shape_str(want));
  infer_same(c);
}
void scatter_nd_kernel(KernelCtx& c) {
  const Tensor &x = c.in(0), &ind = c.in(1), &up = c.in(2);
  auto ix = nd_index(x.shape(), ind.shape(),
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  dispatch(x.dtype(), [&]<class T>() {
    T* py = c.out(0).data<T>();
    if (py != x.data<T>()) std::copy(x.data<T>(), x.data<T>() + x.numel(), py);
    const T* pu = up.data<T>();
    for (int64_t i = 0; i < ix.n; ++i) {
      int64_t off = nd_offset(ind.data<int64_t>() + i * ix.k, x.shape(), ix.k, ix.slice, c);
      std::copy(pu + i * ix.slice, pu + (i + 1) * ix.slice, py + off);
    }
  });
}
void infer_gather_nd(InferCtx& c) {
  if (c.dtype(1) != DType::I64) c.error(ErrorKind::Unsupported, "indices must be int64");
  if (c.attr_int("batch_dims", 0) != 0) c.error(ErrorKind::Unsupported, "batch_dims other than 0");
  auto ix = nd_index(c.shape(0), c.shape(1),
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  Shape out(c.shape(1).begin(), c.shape(1).end() - 1);
  out.insert(out.end(), c.shape(0).begin() + ix.k, c.shape(0).end());
  c.set_out(0, c.dtype(0), out);
}
void gather_nd_kernel(KernelCtx& c) {
  const Tensor &x = c.in(0), &ind = c.in(1);
  auto ix = nd_index(x.shape(), ind.shape(),
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  dispatch(x.dtype(), [&]<class T>() {
    T* py = c.out(0).data<T>();
    const T* px = x.data<T>();
    for (int64_t i = 0; i < ix.n; ++i) {
      int64_t off = nd_offset(ind.data<int64_t>() + i * ix.k, x.shape(), ix.k, ix.slice, c);
      std::copy(px + off, px + off + ix.slice, py + i * ix.slice);
    }
  });
}
// ScatterND: d data = dy with the written slices zeroed; d updates = GatherND(dy, indices).
// (Like PyTorch's index_put_ with duplicate indices, the last write wins in forward.)
void grad_scatter_nd(GradBuilder& g) {
  if (g.needs(0)) {
    DType dt = g.val(g.dy(0)).dtype;
    int zeros = g.emit1("Mul", {g.x(2), g.scalar(0, dt)});
    g.set_dx(0, g.emit1("ScatterND", {g.dy(0), g.x(1), zeros}));
  }
  if (g.needs(2)) g.set_dx(2, g.emit1("GatherND", {g.dy(0), g.x(1)}));
}
// GatherND: d data = ScatterND-add of dy into zeros (GatherNDGrad).
void infer_gather_nd_grad(InferCtx& c) {
  c.set_out(0, c.dtype(0), c.attrs().get_ints("shape", {}, c.node().label()));
}
void gather_nd_grad_kernel(KernelCtx& c) {
  const Tensor &dy = c.in(0), &ind = c.in(1);
  Tensor& dx = c.out(0);
  auto ix = nd_index(dx.shape(), ind.shape(),
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    T* px = dx.data<T>();
    std::fill(px, px + dx.numel(), T(0));
    const T* pd = dy.data<T>();
    for (int64_t i = 0; i < ix.n; ++i) {
      int64_t off = nd_offset(ind.data<int64_t>() + i * ix.k, dx.shape(), ix.k, ix.slice, c);
      for (int64_t j = 0; j < ix.slice; ++j) px[off + j] += pd[i * ix.slice + j];
    }
  });
}
void grad_gather_nd(GradBuilder& g) {
  Attrs a;
  a.set_ints("shape", g.shape(g.x(0)));
  g.set_dx(0, g.emit1("GatherNDGrad", {g.dy(0), g.x(1)}, a, "graft"));
}

// ---- Pad(data, pads, constant_value?; mode = constant | reflect | edge)
// ------------------------------ pads = [x1_begin, x2_begin, ..., x1_end, x2_end, ...]; negative
// pads crop. Each output element reads one input element (or the constant): pad_source gives it,
// for the kernel and the gradient.
std::vector<int64_t> pad_amounts(const std::vector<int64_t>& pads, int rank,
                                 const std::function<void(const std::string&)>& err) {
  if (static_cast<int>(pads.size()) != 2 * rank)
    err("pads has " + std::to_string(pads.size()) + " entries for rank " + std::to_string(rank));
  return pads;
}
// Flat input index read by output element `o` (-1: the constant), for input shape `in`.
int64_t pad_source(int64_t o, const Shape& out, const Shape& in, const std::vector<int64_t>& pads,
                   int mode) {  // mode 0 constant, 1 reflect, 2 edge
  const int r = static_cast<int>(in.size());
  int64_t src = 0;
  std::vector<int64_t> idx(r);
  for (int d = r - 1; d >= 0; --d) {
    idx[d] = o % out[d];
    o /= out[d];
  }
  for (int d = 0; d < r; ++d) {
    int64_t i = idx[d] - pads[d];
    const int64_t n = in[d];
    if (i < 0 || i >= n) {
      if (mode == 0 || n == 0) return -1;
      if (mode == 2) {
        i = i < 0 ? 0 : n - 1;
      } else {  // reflect (without repeating the edge); n == 1 reflects onto itself
        if (n == 1)
          i = 0;
        else {
          const int64_t period = 2 * (n - 1);
          i = ((i % period) + period) % period;
          if (i >= n) i = period - i;
        }
      }
    }
    src = src * n + i;
  }
  return src;
}
struct PadAttrs {
  std::string mode = "constant";  // pad_mode checks it
  std::vector<int64_t> pads;      // PadGrad (Pad's pads are its input 1)
};
PadAttrs pad_attrs(const Node& n) {
  return {n.attrs.get_string("mode", "constant", n.label()),
          n.attrs.get_ints("pads", {}, n.label())};
}
std::shared_ptr<const void> prepare_pad(const Node& n) { return prepared(pad_attrs(n)); }
// 0 constant, 1 reflect, 2 edge.
int pad_mode(const PadAttrs& a, const std::function<void(const std::string&)>& err) {
  if (a.mode == "constant") return 0;
  if (a.mode == "reflect") return 1;
  if (a.mode == "edge") return 2;
  err("mode '" + a.mode + "' is not supported (constant, reflect, edge)");
  return 0;
}
void infer_pad(InferCtx& c) {
  auto err = [&](const std::string& m) { c.error(ErrorKind::InvalidModel, m); };
  const Shape& s = c.shape(0);
  auto pads = pad_amounts(c.ints_in(1), static_cast<int>(s.size()), err);
  int mode = pad_mode(pad_attrs(c.node()), err);
  Shape out(s.size());
  for (size_t d = 0; d < s.size(); ++d) {
    out[d] = s[d] + pads[d] + pads[d + s.size()];
    if (out[d] < 0) err("pads crop dimension " + std::to_string(d) + " below zero");
    if (mode == 1 && (pads[d] >= s[d] || pads[d + s.size()] >= s[d]) &&
        (pads[d] > 0 || pads[d + s.size()] > 0))
      c.error(ErrorKind::Unsupported, "reflect padding of at least the dimension's size");
  }
  if (c.has_in(2)) {
    c.check(numel(c.shape(2)) == 1, "constant_value must be a scalar");
    if (c.dtype(2) != c.dtype(0))
      c.error(ErrorKind::InvalidModel, "constant_value differs in dtype");
  }
  c.set_out(0, c.dtype(0), out);
}
void pad_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  auto err = [&](const std::string& m) { c.error(ErrorKind::InvalidModel, m); };
  std::vector<int64_t> pads(c.in(1).data<int64_t>(), c.in(1).data<int64_t>() + c.in(1).numel());
  pads = pad_amounts(pads, x.rank(), err);
  const int mode = pad_mode(c.attrs<PadAttrs>(), err);
  dispatch(x.dtype(), [&]<class T>() {
    const T v = c.has_in(2) ? c.in(2).data<T>()[0] : T(0);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    for (int64_t o = 0; o < y.numel(); ++o) {
      int64_t s = pad_source(o, y.shape(), x.shape(), pads, mode);
      py[o] = s < 0 ? v : px[s];
    }
  });
}
// PadGrad(dy; pads, mode, shape = x's shape) -> dx: each output element's gradient added to the
// input element it read.
void infer_pad_grad(InferCtx& c) {
  c.set_out(0, c.dtype(0), c.attrs().get_ints("shape", {}, c.node().label()));
}
void pad_grad_kernel(KernelCtx& c) {
  const Tensor& dy = c.in(0);
  Tensor& dx = c.out(0);
  auto err = [&](const std::string& m) { c.error(ErrorKind::InvalidModel, m); };
  std::vector<int64_t> pads = pad_amounts(c.attrs<PadAttrs>().pads, dx.rank(), err);
  const int mode = pad_mode(c.attrs<PadAttrs>(), err);
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    T* px = dx.data<T>();
    std::fill(px, px + dx.numel(), T(0));
    const T* pd = dy.data<T>();
    for (int64_t o = 0; o < dy.numel(); ++o) {
      int64_t s = pad_source(o, dy.shape(), dx.shape(), pads, mode);
      if (s >= 0) px[s] += pd[o];
    }
  });
}
void grad_pad(GradBuilder& g) {
  const Value& pv = g.val(g.x(1));
  GRAFT_CHECK(pv.data.defined(), ErrorKind::Unsupported,
              g.node().label() + ": pads must be constant");
  Attrs a;
  a.set_ints("pads", std::vector<int64_t>(pv.data.data<int64_t>(),
                                          pv.data.data<int64_t>() + pv.data.numel()));
  a.set_string("mode", pad_attrs(g.node()).mode);
  a.set_ints("shape", g.shape(g.x(0)));
  g.set_dx(0, g.emit1("PadGrad", {g.dy(0)}, a, "graft"));
}

const OpDef kOps[] = {
    {.name = "Pad",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_pad,
     .prepare = prepare_pad,
     .kernel = pad_kernel,
     .grad = grad_pad,
     .nondiff_inputs = {1, 2}},
    {.name = "PadGrad",
     .domain = "graft",
     .infer = infer_pad_grad,
     .prepare = prepare_pad,
     .kernel = pad_grad_kernel},
    {.name = "ScatterND",
     .min_in = 3,
     .max_in = 3,
     .infer = infer_scatter_nd,
     .kernel = scatter_nd_kernel,
     .grad = grad_scatter_nd,
     .nondiff_inputs = {1}},
    {.name = "GatherND",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_gather_nd,
     .kernel = gather_nd_kernel,
     .grad = grad_gather_nd,
     .nondiff_inputs = {1}},
    {.name = "GatherNDGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_gather_nd_grad,
     .kernel = gather_nd_grad_kernel,
     .nondiff_inputs = {1}},
    {.name = "Slice",
     .min_in = 3,
     .max_in = 5,
     .infer = infer_slice,
     .kernel = slice_kernel,
     .grad = grad_slice,
     .nondiff_inputs = {1, 2, 3, 4},
     .copy_like = true},
    {.name = "Gather",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_gather,
     .prepare = prepare_gather,
     .kernel = gather_kernel,
     .grad = grad_gather,
     .nondiff_inputs = {1}},
    {.name = "SliceGrad",
     .domain = "graft",
     .infer = infer_slice_grad,
     .prepare = prepare_slice_grad,
     .kernel = slice_grad_kernel},
    {.name = "GatherGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_gather_grad,
     .prepare = prepare_gather,
     .kernel = gather_grad_kernel,
     .nondiff_inputs = {1}},
};

}  // namespace

void register_index_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
