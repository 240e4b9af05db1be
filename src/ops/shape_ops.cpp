// Shape and data-movement ops: Reshape, Flatten, Squeeze, Unsqueeze (aliases: no copy),
// Transpose, Concat, Split, Slice, Gather, GatherND, ScatterND, Shape, Expand, Tile, Trilu, Pad,
// ConstantOfShape, Range, and graft's Zeros, SliceGrad, GatherGrad, GatherNDGrad, TileGrad,
// PadGrad.
#include <cmath>
#include <functional>
#include <optional>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- aliases --------------------------------------------------------------------------------
void infer_reshape(InferCtx& c) {
  auto spec = c.ints_in(1);
  const Shape& in = c.shape(0);
  bool allowzero = c.attr_int("allowzero", 0);
  Shape out(spec.size());
  int infer_at = -1;
  int64_t known = 1;
  for (size_t i = 0; i < spec.size(); ++i) {
    int64_t d = spec[i];
    if (d == 0 && !allowzero) {
      c.check(i < in.size(),
              "shape entry 0 at position " + std::to_string(i) + " has no input dim to copy");
      d = in[i];
    }
    if (d == -1) {
      c.check(infer_at < 0, "shape " + shape_str(spec) + " has more than one -1");
      infer_at = static_cast<int>(i);
      continue;
    }
    c.check(d >= 0, "shape " + shape_str(spec) + " has a negative entry");
    out[i] = d;
    c.check(d == 0 || known <= INT64_MAX / d, "shape " + shape_str(spec) + " overflows int64");
    known *= d;
  }
  int64_t n = numel(in);
  if (infer_at >= 0) {
    c.check(known != 0 && n % known == 0,
            "cannot reshape " + shape_str(in) + " to " + shape_str(spec));
    out[infer_at] = n / known;
  }
  c.check(numel(out) == n, "cannot reshape " + shape_str(in) + " (" + std::to_string(n) +
                               " elements) to " + shape_str(out));
  c.set_out(0, c.dtype(0), out);
}
void infer_flatten(InferCtx& c) {
  const Shape& s = c.shape(0);
  int r = static_cast<int>(s.size());
  const int64_t a = c.attr_int("axis", 1);
  const int ax = a == r ? r : normalize_axis(a, r, c.node());  // Flatten's axis may be the rank
  int64_t o = 1, i = 1;
  for (int k = 0; k < r; ++k) (k < ax ? o : i) *= s[k];
  c.set_out(0, c.dtype(0), {o, i});
}
void infer_squeeze(InferCtx& c) {
  const Shape& s = c.shape(0);
  int r = static_cast<int>(s.size());
  std::vector<bool> drop(r, false);
  if (c.has_in(1)) {
    for (int64_t a : c.ints_in(1)) {
      int ax = normalize_axis(a, r, c.node());
      c.check(s[ax] == 1,
              "cannot squeeze axis " + std::to_string(a) + " of size " + std::to_string(s[ax]));
      drop[ax] = true;
    }
  } else {
    for (int k = 0; k < r; ++k) drop[k] = s[k] == 1;
  }
  Shape out;
  for (int k = 0; k < r; ++k)
    if (!drop[k]) out.push_back(s[k]);
  c.set_out(0, c.dtype(0), out);
}
void infer_unsqueeze(InferCtx& c) {
  const Shape& s = c.shape(0);
  auto axes = c.ints_in(1);
  int r = static_cast<int>(s.size() + axes.size());
  std::vector<bool> ins(r, false);
  for (int64_t a : axes) {
    int ax = normalize_axis(a, r, c.node());
    c.check(!ins[ax], "axis " + std::to_string(a) + " listed twice");
    ins[ax] = true;
  }
  Shape out;
  size_t j = 0;
  for (int k = 0; k < r; ++k) out.push_back(ins[k] ? 1 : s[j++]);
  c.set_out(0, c.dtype(0), out);
}
// The driver reshapes a same-size gradient back to the input's shape.
void grad_alias(GradBuilder& g) { g.set_dx(0, g.dy(0)); }

// ---- Transpose --------------------------------------------------------------------------------
struct TransposeAttrs {
  std::vector<int64_t> perm;  // as given (empty: reverse the dims); perm_of checks it for a rank
};
TransposeAttrs transpose_attrs(const Node& n) { return {n.attrs.get_ints("perm", {}, n.label())}; }
std::shared_ptr<const void> prepare_transpose(const Node& n) {
  return prepared(transpose_attrs(n));
}
// The permutation for an input of rank `rank`, normalized and checked.
std::vector<int64_t> perm_of(const TransposeAttrs& a, int rank, const Node& n) {
  std::vector<int64_t> p = a.perm;
  if (p.empty())
    for (int i = rank - 1; i >= 0; --i) p.push_back(i);
  if (static_cast<int>(p.size()) != rank)
    fail_at(ErrorKind::InvalidModel, n.name,
            n.label() + ": perm has " + std::to_string(p.size()) + " entries for rank " +
                std::to_string(rank));
  std::vector<bool> seen(rank, false);
  for (int64_t& a : p) {
    a = normalize_axis(a, rank, n, "perm entry");
    if (seen[a])
      fail_at(ErrorKind::InvalidModel, n.name, n.label() + ": perm is not a permutation");
    seen[a] = true;
  }
  return p;
}
void infer_transpose(InferCtx& c) {
  const Shape& s = c.shape(0);
  auto p = perm_of(transpose_attrs(c.node()), static_cast<int>(s.size()), c.node());
  Shape out;
  for (int64_t a : p) out.push_back(s[a]);
  c.set_out(0, c.dtype(0), out);
}
// y (dense, shape ys) = x read at input strides xst per output dim. Dims are collapsed first (size
// 1 dropped, neighbours merged where the input is contiguous across them). When the output's inner
// dim is the input's, rows are copied; else 32x32 tiles transpose between the output's inner dim
// and the one the input is contiguous along (reads and writes both stay in a few cache lines).
// Parallel over (batch, tile row): every output element is written once, by one thread.
template <class T>
void transpose_copy(const T* x, T* y, const Shape& ys, const std::vector<int64_t>& xst) {
  std::vector<int64_t> dims, st;  // innermost first while collecting
  for (int d = static_cast<int>(ys.size()) - 1; d >= 0; --d) {
    if (ys[d] == 1) continue;
    if (!dims.empty() && xst[d] == st.back() * dims.back()) {
      dims.back() *= ys[d];
    } else {
      dims.push_back(ys[d]);
      st.push_back(xst[d]);
    }
  }
  std::reverse(dims.begin(), dims.end());
  std::reverse(st.begin(), st.end());
  const int r = static_cast<int>(dims.size());
  int64_t total = 1;
  for (int64_t d : dims) total *= d;
  if (r == 0) {
    if (total) y[0] = x[0];
    return;
  }
  std::vector<int64_t> yst(r);  // output strides of the collapsed dims
  for (int64_t d = r - 1, s = 1; d >= 0; --d) {
    yst[d] = s;
    s *= dims[d];
  }
  if (st[r - 1] == 1) {  // rows of the inner dim are contiguous in both
    const int64_t L = dims[r - 1], rows = total / L;
    parallel_for(rows, L, [&](int, int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        int64_t off = 0;
        for (int64_t d = r - 2, q = row; d >= 0; --d) {
          off += (q % dims[d]) * st[d];
          q /= dims[d];
        }
        std::memcpy(y + row * L, x + off, L * sizeof(T));
      }
    });
    return;
  }
  int a = 0;  // the output dim along which the input is contiguous
  while (st[a] != 1) ++a;
  const int b = r - 1;  // the output's inner dim
  const int64_t A = dims[a], B = dims[b], xb = st[b], ya = yst[a];
  constexpr int64_t kTile = 32;
  const int64_t ta = (A + kTile - 1) / kTile;
  const int64_t batches = total / (A * B);
  parallel_for(batches * ta, kTile * B, [&](int, int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t a0 = (q % ta) * kTile, a1 = std::min(A, a0 + kTile);
      int64_t xo = 0, yo = 0;
      for (int64_t d = r - 1, rest = q / ta; d >= 0; --d) {
        if (d == a || d == b) continue;
        const int64_t i = rest % dims[d];
        rest /= dims[d];
        xo += i * st[d];
        yo += i * yst[d];
      }
      for (int64_t b0 = 0; b0 < B; b0 += kTile) {
        const int64_t b1 = std::min(B, b0 + kTile);
        for (int64_t i = a0; i < a1; ++i) {
          const T* src = x + xo + i;
          T* dst = y + yo + i * ya;
          for (int64_t j = b0; j < b1; ++j) dst[j] = src[j * xb];
        }
      }
    }
  });
}
void transpose_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  auto p = perm_of(c.attrs<TransposeAttrs>(), x.rank(), c.node);
  std::vector<int64_t> st(x.rank()), pst(x.rank());
  int64_t s = 1;
  for (int i = x.rank() - 1; i >= 0; --i) {
    st[i] = s;
    s *= x.dim(i);
  }
  for (int i = 0; i < x.rank(); ++i) pst[i] = st[p[i]];
  dispatch(x.dtype(), [&]<class T>() {
    transpose_copy<T>(x.data<T>(), c.out(0).data<T>(), c.out(0).shape(), pst);
  });
}
void grad_transpose(GradBuilder& g) {
  auto p = perm_of(transpose_attrs(g.node()), static_cast<int>(g.shape(g.x(0)).size()), g.node());
  std::vector<int64_t> inv(p.size());
  for (size_t i = 0; i < p.size(); ++i) inv[p[i]] = static_cast<int64_t>(i);
  Attrs a;
  a.set_ints("perm", inv);
  g.set_dx(0, g.emit1("Transpose", {g.dy(0)}, a));
}

// ---- Concat / Split ---------------------------------------------------------------------------
// The axis of Concat, Split, Gather and GatherGrad (as given: normalized for a rank where used),
// and GatherGrad's padding_idx.
struct AxisAttrs {
  int64_t axis = 0;
  std::optional<int64_t> padding_idx;
};
AxisAttrs axis_attrs(const Node& n) {
  AxisAttrs a;
  a.axis = n.attrs.get_int("axis", 0, n.label());
  if (n.attrs.has("padding_idx")) a.padding_idx = n.attrs.get_int("padding_idx", 0, n.label());
  return a;
}
std::shared_ptr<const void> prepare_axis(const Node& n) { return prepared(axis_attrs(n)); }
void infer_concat(InferCtx& c) {
  Shape out = c.shape(0);
  int r = static_cast<int>(out.size());
  int ax = normalize_axis(axis_attrs(c.node()).axis, r, c.node());
  for (int i = 1; i < c.n_in(); ++i) {
    const Shape& s = c.shape(i);
    c.check(c.dtype(i) == c.dtype(0), "inputs differ in dtype");
    c.check(static_cast<int>(s.size()) == r, "inputs differ in rank");
    for (int k = 0; k < r; ++k)
      if (k != ax)
        c.check(s[k] == out[k], "input '" + c.in(i).name + "' of shape " + shape_str(s) +
                                    " does not match " + shape_str(c.shape(0)) +
                                    " off the concat axis");
    c.check(s[ax] <= INT64_MAX - out[ax], "concatenated size overflows int64");
    out[ax] += s[ax];
  }
  c.set_out(0, c.dtype(0), out);
}
void concat_kernel(KernelCtx& c) {
  const Tensor& y = c.out(0);
  const int ax = normalize_axis(c.attrs<AxisAttrs>().axis, y.rank(), c.node);
  int64_t outer, mid, inner;
  split3(y.shape(), ax, ax + 1, outer, mid, inner);
  const size_t es = dtype_size(y.dtype());
  char* py = static_cast<char*>(y.raw());
  int64_t off = 0;
  for (size_t k = 0; k < c.ins.size(); ++k) {
    const Tensor& x = c.in(static_cast<int>(k));
    const int64_t m = x.dim(ax), row = m * inner * es;
    const char* px = static_cast<const char*>(x.raw());
    for (int64_t o = 0; o < outer; ++o)
      std::memcpy(py + (o * mid + off) * inner * es, px + o * row, row);
    off += m;
  }
}
void grad_concat(GradBuilder& g) {
  const Node& n = g.node();
  const int ax = normalize_axis(axis_attrs(n).axis, static_cast<int>(g.shape(g.x(0)).size()), n);
  std::vector<int64_t> sizes;
  for (int v : n.inputs) sizes.push_back(g.shape(v)[ax]);
  Attrs a;
  a.set_int("axis", ax);
  auto parts = g.emit("Split", {g.dy(0), g.ints(sizes)}, a, static_cast<int>(sizes.size()));
  for (size_t i = 0; i < parts.size(); ++i)
    if (g.needs(static_cast<int>(i))) g.set_dx(static_cast<int>(i), parts[i]);
}

std::vector<int64_t> split_sizes(InferCtx& c) {
  const Shape& s = c.shape(0);
  int ax = normalize_axis(axis_attrs(c.node()).axis, static_cast<int>(s.size()), c.node());
  std::vector<int64_t> sz;
  if (c.has_in(1)) {
    sz = c.ints_in(1);
    c.check(static_cast<int>(sz.size()) == c.n_out(), "split has " + std::to_string(sz.size()) +
                                                          " entries for " +
                                                          std::to_string(c.n_out()) + " outputs");
    int64_t t = 0;
    for (int64_t v : sz) {
      c.check(v >= 0 && v <= s[ax] - t,
              "split sizes " + shape_str(sz) + " do not sum to " + std::to_string(s[ax]));
      t += v;
    }
    c.check(t == s[ax],
            "split sizes sum to " + std::to_string(t) + ", not " + std::to_string(s[ax]));
  } else {
    int64_t n = c.n_out(), each = (s[ax] + n - 1) / n;
    for (int64_t i = 0; i < n; ++i)
      sz.push_back(std::max<int64_t>(0, std::min(each, s[ax] - i * each)));
  }
  return sz;
}
void infer_split(InferCtx& c) {
  auto sz = split_sizes(c);
  int ax = normalize_axis(axis_attrs(c.node()).axis, static_cast<int>(c.shape(0).size()), c.node());
  for (int i = 0; i < c.n_out(); ++i) {
    Shape s = c.shape(0);
    s[ax] = sz[i];
    c.set_out(i, c.dtype(0), s);
  }
}
void split_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  const int ax = normalize_axis(c.attrs<AxisAttrs>().axis, x.rank(), c.node);
  int64_t outer, mid, inner;
  split3(x.shape(), ax, ax + 1, outer, mid, inner);
  const size_t es = dtype_size(x.dtype());
  const char* px = static_cast<const char*>(x.raw());
  // Part sizes as the shape function computed them (an absent output still takes its part).
  const int64_t n = static_cast<int64_t>(c.outs.size());
  std::vector<int64_t> sz;
  if (c.has_in(1)) {
    sz.assign(c.in(1).data<int64_t>(), c.in(1).data<int64_t>() + c.in(1).numel());
  } else {
    const int64_t each = (mid + n - 1) / n;
    for (int64_t i = 0; i < n; ++i)
      sz.push_back(std::max<int64_t>(0, std::min(each, mid - i * each)));
  }
  if (static_cast<int64_t>(sz.size()) != n)
    c.error(ErrorKind::InvalidModel, "split sizes do not match the outputs");
  int64_t off = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t m = sz[k];
    if (c.has_out(static_cast<int>(k))) {
      char* py = static_cast<char*>(c.out(static_cast<int>(k)).raw());
      const int64_t row = m * inner * es;
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(py + o * row, px + (o * mid + off) * inner * es, row);
    }
    off += m;
  }
}
void grad_split(GradBuilder& g) {
  const Node& n = g.node();
  std::vector<int> parts;
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    int d = g.dy(static_cast<int>(i));
    if (d < 0) {
      const Value& v = g.val(n.outputs[i]);
      Attrs z;
      z.set_ints("shape", v.shape);
      z.set_int("to", onnx_dtype_code_of(v.dtype));
      d = g.emit1("Zeros", {}, z, "graft");
    }
    parts.push_back(d);
  }
  Attrs a;
  a.set_int("axis", n.attrs.get_int("axis", 0));
  g.set_dx(0, g.emit1("Concat", parts, a));
}

void infer_zeros(InferCtx& c) {
  DType dt;
  if (!dtype_of_onnx_elem(c.attr_int("to", 1), dt)) c.error(ErrorKind::Unsupported, "Zeros dtype");
  c.set_out(0, dt, c.attrs().get_ints("shape", {}, c.node().label()));
}
void zeros_kernel(KernelCtx& c) { std::memset(c.out(0).raw(), 0, c.out(0).nbytes()); }

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
void infer_gather(InferCtx& c) {
  const Shape& s = c.shape(0);
  int ax = normalize_axis(axis_attrs(c.node()).axis, static_cast<int>(s.size()), c.node());
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
  const int ax = normalize_axis(c.attrs<AxisAttrs>().axis, x.rank(), c.node);
  dispatch(x.dtype(), [&]<class T>() {
    gather_impl<T, false>(c, c.in(1), x.data<T>(), x.shape(), c.out(0).data<T>(), ax);
  });
}
void grad_gather(GradBuilder& g) {
  Attrs a;
  a.set_int("axis", normalize_axis(axis_attrs(g.node()).axis,
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
    const AxisAttrs& a = c.attrs<AxisAttrs>();
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

// ---- Shape / Expand / Trilu -------------------------------------------------------------------
void shape_range(const Node& n, int r, int64_t& b, int64_t& e) {
  b = n.attrs.get_int("start", 0, n.label());
  e = n.attrs.get_int("end", r, n.label());
  if (b < 0) b += r;
  if (e < 0) e += r;
  b = std::clamp<int64_t>(b, 0, r);
  e = std::clamp<int64_t>(e, 0, r);
}
void infer_shape(InferCtx& c) {
  int64_t b, e;
  shape_range(c.node(), static_cast<int>(c.shape(0).size()), b, e);
  c.set_out(0, DType::I64, {std::max<int64_t>(0, e - b)});
}
void shape_kernel(KernelCtx& c) {
  int64_t b, e;
  shape_range(c.node, c.in(0).rank(), b, e);
  for (int64_t i = b; i < e; ++i)
    c.out(0).data<int64_t>()[i - b] = c.in(0).dim(static_cast<int>(i));
}

void infer_expand(InferCtx& c) {
  Shape out;
  Shape want = c.ints_in(1);
  c.check(broadcast_shape(c.shape(0), want, out),
          "cannot expand " + shape_str(c.shape(0)) + " to " + shape_str(want));
  c.set_out(0, c.dtype(0), out);
}
void expand_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  dispatch(x.dtype(), [&]<class T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    const auto p = bcast_rows<1>(y.shape(), {&x.shape()});
    for_each_row<1>(p, 1, [&](int64_t o, const std::array<int64_t, 1>& off, int64_t len) {
      if (p.ist[0])
        std::memcpy(py + o, px + off[0], len * sizeof(T));
      else
        std::fill(py + o, py + o + len, px[off[0]]);
    });
  });
}
void grad_expand(GradBuilder& g) { g.set_dx(0, g.dy(0)); }

// k does not change the output's shape: the kernel reads it at run time, so it may be a graph
// input (only its dtype and size are checked here).
void infer_trilu(InferCtx& c) {
  c.check(c.shape(0).size() >= 2, "input must have rank >= 2");
  if (c.has_in(1)) {
    if (c.dtype(1) != DType::I64) c.error(ErrorKind::InvalidModel, "k must be an int64 scalar");
    c.check(numel(c.shape(1)) == 1, "k must be a scalar, got shape " + shape_str(c.shape(1)));
  }
  infer_same(c);
}
struct TriluAttrs {
  bool upper = true;
};
std::shared_ptr<const void> prepare_trilu(const Node& n) {
  return prepared(TriluAttrs{n.attrs.get_int("upper", 1, n.label()) != 0});
}
void trilu_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  int64_t k = c.has_in(1) ? c.in(1).data<int64_t>()[0] : 0;
  const bool upper = c.attrs<TriluAttrs>().upper;
  const int64_t R = x.dim(-2), C = x.dim(-1), nb = R * C != 0 ? x.numel() / (R * C) : 0;
  dispatch(x.dtype(), [&]<class T>() {
    const T* px = x.data<T>();
    T* py = c.out(0).data<T>();
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j) {
          int64_t o = (b * R + i) * C + j;
          bool keep = upper ? j - i >= k : j - i <= k;
          py[o] = keep ? px[o] : T(0);
        }
  });
}
void grad_trilu(GradBuilder& g) {
  std::vector<int> ins{g.dy(0)};
  if (g.node().inputs.size() > 1 && g.node().inputs[1] >= 0) ins.push_back(g.node().inputs[1]);
  g.set_dx(0, g.emit1("Trilu", ins, g.node().attrs));
}

// ---- ConstantOfShape(shape; value) --------------------------------------------------------------
void infer_constant_of_shape(InferCtx& c) {
  if (c.dtype(0) != DType::I64) c.error(ErrorKind::InvalidModel, "the shape input must be int64");
  Shape s = c.ints_in(0);
  for (int64_t d : s)
    if (d < 0) c.error(ErrorKind::InvalidModel, "negative dimension in " + shape_str(s));
  const Attr* v = c.attrs().find("value");
  DType dt = DType::F32;
  if (v) {
    if (v->kind != Attr::TensorV || v->t.numel() != 1)
      c.error(ErrorKind::InvalidModel, "value must be a one-element tensor");
    dt = v->t.dtype();
  }
  c.set_out(0, dt, s);
}
void constant_of_shape_kernel(KernelCtx& c) {
  const Attr* v = c.node.attrs.find("value");
  Tensor& y = c.out(0);
  dispatch(y.dtype(), [&]<class T>() {
    T val = v ? v->t.data<T>()[0] : T(0);
    std::fill(y.data<T>(), y.data<T>() + y.numel(), val);
  });
}

// ---- Range(start, limit, delta) -----------------------------------------------------------------
void infer_range(InferCtx& c) {
  for (int i = 1; i < 3; ++i)
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "inputs differ in dtype");
  const Tensor *s = c.const_in(0), *l = c.const_in(1), *d = c.const_in(2);
  if (!s || !l || !d)
    c.error(ErrorKind::Unsupported,
            "start, limit and delta must be constants (graft plans static shapes)");
  double start = s->at(0), limit = l->at(0), delta = d->at(0);
  if (delta == 0) c.error(ErrorKind::InvalidModel, "delta is 0");
  double n = std::ceil((limit - start) / delta);
  if (!(n < 9.2e18)) c.error(ErrorKind::InvalidModel, "the range has too many elements");
  c.set_out(0, c.dtype(0), {static_cast<int64_t>(std::max(0.0, n))});
}
void range_kernel(KernelCtx& c) {
  Tensor& y = c.out(0);
  dispatch(y.dtype(), [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      T start = c.in(0).data<T>()[0], delta = c.in(2).data<T>()[0];
      for (int64_t i = 0; i < y.numel(); ++i)
        y.data<T>()[i] = static_cast<T>(start + static_cast<T>(i) * delta);
    }
  });
}

// ---- Tile(x, repeats)
// -----------------------------------------------------------------------------
void infer_tile(InferCtx& c) {
  std::vector<int64_t> r = c.ints_in(1);
  const Shape& s = c.shape(0);
  c.check(r.size() == s.size(), "repeats has " + std::to_string(r.size()) + " entries for rank " +
                                    std::to_string(s.size()));
  Shape out(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (r[i] < 0) c.error(ErrorKind::InvalidModel, "negative repeat");
    out[i] = s[i] * r[i];
  }
  c.set_out(0, c.dtype(0), out);
}
void tile_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  const int r = x.rank();
  dispatch(x.dtype(), [&]<class T>() {
    const T* px = x.data<T>();
    T* py = y.data<T>();
    std::vector<int64_t> idx(r, 0), xstride(r, 1);
    for (int d = r - 2; d >= 0; --d) xstride[d] = xstride[d + 1] * x.shape()[d + 1];
    for (int64_t i = 0; i < y.numel(); ++i) {
      int64_t off = 0;
      for (int d = 0; d < r; ++d) off += (idx[d] % x.shape()[d]) * xstride[d];
      py[i] = px[off];
      for (int d = r - 1; d >= 0; --d) {
        if (++idx[d] < y.shape()[d]) break;
        idx[d] = 0;
      }
    }
  });
}
// TileGrad(dy; shape = x's shape) -> dx: the sum of dy over the tiles.
void infer_tile_grad(InferCtx& c) {
  c.set_out(0, c.dtype(0), c.attrs().get_ints("shape", {}, c.node().label()));
}
void tile_grad_kernel(KernelCtx& c) {
  const Tensor& dy = c.in(0);
  Tensor& dx = c.out(0);
  const int r = dy.rank();
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    const T* pd = dy.data<T>();
    T* px = dx.data<T>();
    std::fill(px, px + dx.numel(), T(0));
    std::vector<int64_t> idx(r, 0), xstride(r, 1);
    for (int d = r - 2; d >= 0; --d) xstride[d] = xstride[d + 1] * dx.shape()[d + 1];
    for (int64_t i = 0; i < dy.numel(); ++i) {
      int64_t off = 0;
      for (int d = 0; d < r; ++d) off += (idx[d] % dx.shape()[d]) * xstride[d];
      px[off] += pd[i];
      for (int d = r - 1; d >= 0; --d) {
        if (++idx[d] < dy.shape()[d]) break;
        idx[d] = 0;
      }
    }
  });
}
void grad_tile(GradBuilder& g) {
  Attrs a;
  a.set_ints("shape", g.shape(g.x(0)));
  g.set_dx(0, g.emit1("TileGrad", {g.dy(0)}, a, "graft"));
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
    {.name = "ConstantOfShape",
     .infer = infer_constant_of_shape,
     .kernel = constant_of_shape_kernel},
    {.name = "Range", .min_in = 3, .max_in = 3, .infer = infer_range, .kernel = range_kernel},
    {.name = "Tile",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_tile,
     .kernel = tile_kernel,
     .grad = grad_tile,
     .nondiff_inputs = {1},
     .copy_like = true},
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
    {.name = "TileGrad", .domain = "graft", .infer = infer_tile_grad, .kernel = tile_grad_kernel},
    {.name = "GatherNDGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_gather_nd_grad,
     .kernel = gather_nd_grad_kernel,
     .nondiff_inputs = {1}},
    {.name = "Reshape",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_reshape,
     .grad = grad_alias,
     .alias = true,
     .nondiff_inputs = {1},
     .copy_like = true},
    {.name = "Flatten",
     .infer = infer_flatten,
     .grad = grad_alias,
     .alias = true,
     .copy_like = true},
    {.name = "Squeeze",
     .max_in = 2,
     .infer = infer_squeeze,
     .grad = grad_alias,
     .alias = true,
     .nondiff_inputs = {1},
     .copy_like = true},
    {.name = "Unsqueeze",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_unsqueeze,
     .grad = grad_alias,
     .alias = true,
     .nondiff_inputs = {1},
     .copy_like = true},
    {.name = "Transpose",
     .infer = infer_transpose,
     .prepare = prepare_transpose,
     .kernel = transpose_kernel,
     .grad = grad_transpose,
     .copy_like = true},
    {.name = "Concat",
     .max_in = 1 << 20,
     .infer = infer_concat,
     .prepare = prepare_axis,
     .kernel = concat_kernel,
     .grad = grad_concat,
     .copy_like = true},
    {.name = "Split",
     .max_in = 2,
     .max_out = 1 << 20,
     .infer = infer_split,
     .prepare = prepare_axis,
     .kernel = split_kernel,
     .grad = grad_split,
     .nondiff_inputs = {1},
     .copy_like = true},
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
     .prepare = prepare_axis,
     .kernel = gather_kernel,
     .grad = grad_gather,
     .nondiff_inputs = {1}},
    {.name = "Shape", .infer = infer_shape, .kernel = shape_kernel, .shape_only = true},
    {.name = "Expand",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_expand,
     .kernel = expand_kernel,
     .grad = grad_expand,
     .nondiff_inputs = {1},
     .copy_like = true},
    {.name = "Trilu",
     .max_in = 2,
     .infer = infer_trilu,
     .prepare = prepare_trilu,
     .kernel = trilu_kernel,
     .grad = grad_trilu,
     .inplace_input = 0,
     .nondiff_inputs = {1}},
    {.name = "Zeros",
     .domain = "graft",
     .min_in = 0,
     .max_in = 0,
     .infer = infer_zeros,
     .kernel = zeros_kernel},
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
     .prepare = prepare_axis,
     .kernel = gather_grad_kernel,
     .nondiff_inputs = {1}},
};

}  // namespace

void register_shape_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
