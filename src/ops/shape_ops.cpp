// Shape and data-movement ops: Reshape, Flatten, Squeeze, Unsqueeze (aliases: no copy),
// Transpose, Concat, Split, Shape, Expand, Tile, Trilu, ConstantOfShape, Range, and graft's Zeros
// and TileGrad. Ops that read or write data at computed indices (Slice, Gather, GatherND,
// ScatterND, Pad) are in index_ops.cpp.
#include <cmath>
#include <functional>

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
// The axis of Concat and Split (as given: normalized for the input's rank where used).
struct AxisAttrs {
  int64_t axis = 0;
};
AxisAttrs axis_attrs(const Node& n) { return {n.attrs.get_int("axis", 0, n.label())}; }
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

const OpDef kOps[] = {
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
    {.name = "TileGrad", .domain = "graft", .infer = infer_tile_grad, .kernel = tile_grad_kernel},
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
};

}  // namespace

void register_shape_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
