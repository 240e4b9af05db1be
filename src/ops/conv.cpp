// Convolution and pooling: Conv (1-D, 2-D, 3-D; groups, depthwise, strides, pads, dilations),
// MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, and graft's ConvGrad, PoolGrad.
//
// Conv is im2col + GEMM (the one GEMM entry point, opsutil::gemm): per image and group,
//   col[(c, k), o] = x[c, o * stride + k * dilation - pad]   (0 outside)     // (C/g * K, O)
//   y[m, o] = W[m, (c, k)] @ col                                               // (M/g, O)
// and its gradient dW += dy @ col^T, dcol = W^T @ dy then col2im (scatter-add) into dx.
#include <cmath>
#include <functional>
#include <limits>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// The geometry of a convolution or pooling window over the spatial dims of x [N, C, D...].
struct Window {
  int nd = 0;  // spatial dims
  std::vector<int64_t> in, out, k, stride, dil, pad_begin, pad_end;
  int64_t in_size() const { return prod(in); }
  int64_t out_size() const { return prod(out); }
  int64_t k_size() const { return prod(k); }
  static int64_t prod(const std::vector<int64_t>& v) {
    int64_t p = 1;
    for (int64_t d : v) p *= d;
    return p;
  }
};

// Reads kernel_shape (or the weight's spatial dims), strides, dilations, pads and auto_pad.
Window window(const Node& n, const Shape& x, const std::vector<int64_t>& kernel, bool ceil_mode,
              const std::function<void(const std::string&)>& err) {
  Window w;
  if (x.size() < 3) err("the input must be [N, C, D1, ...] with at least one spatial dim");
  w.nd = static_cast<int>(x.size()) - 2;
  w.in.assign(x.begin() + 2, x.end());
  w.k = n.attrs.get_ints("kernel_shape", kernel, n.label());
  if (static_cast<int>(w.k.size()) != w.nd) err("kernel_shape has the wrong rank");
  auto get = [&](const char* name, int64_t dflt, size_t len) {
    auto v = n.attrs.get_ints(name, std::vector<int64_t>(len, dflt), n.label());
    if (v.size() != len) err(std::string(name) + " has the wrong length");
    return v;
  };
  w.stride = get("strides", 1, w.nd);
  w.dil = get("dilations", 1, w.nd);
  auto pads = get("pads", 0, 2 * w.nd);
  w.pad_begin.assign(pads.begin(), pads.begin() + w.nd);
  w.pad_end.assign(pads.begin() + w.nd, pads.end());
  std::string auto_pad = n.attrs.get_string("auto_pad", "NOTSET", n.label());
  for (int i = 0; i < w.nd; ++i) {
    if (w.k[i] < 1 || w.stride[i] < 1 || w.dil[i] < 1 || w.pad_begin[i] < 0 || w.pad_end[i] < 0)
      err("kernel, strides and dilations must be >= 1 and pads >= 0");
    const int64_t ek = w.dil[i] * (w.k[i] - 1) + 1;
    if (auto_pad == "VALID") {
      w.pad_begin[i] = w.pad_end[i] = 0;
    } else if (auto_pad == "SAME_UPPER" || auto_pad == "SAME_LOWER") {
      int64_t o = (w.in[i] + w.stride[i] - 1) / w.stride[i];
      int64_t total = std::max<int64_t>(0, (o - 1) * w.stride[i] + ek - w.in[i]);
      w.pad_begin[i] = auto_pad == "SAME_UPPER" ? total / 2 : total - total / 2;
      w.pad_end[i] = total - w.pad_begin[i];
    } else if (auto_pad != "NOTSET") {
      err("auto_pad '" + auto_pad + "' is not supported");
    }
    int64_t span = w.in[i] + w.pad_begin[i] + w.pad_end[i] - ek;
    if (span < 0) err("the window is larger than the padded input");
    int64_t o = (ceil_mode ? (span + w.stride[i] - 1) / w.stride[i] : span / w.stride[i]) + 1;
    // With ceil_mode, a last window that starts in the end padding is dropped (as PyTorch does).
    if (ceil_mode && (o - 1) * w.stride[i] >= w.in[i] + w.pad_begin[i]) --o;
    w.out.push_back(o);
  }
  return w;
}

// Calls f(out_index, k_index, in_index) for every (output position, kernel offset) pair whose
// input position is inside the image (in_index: flat spatial index into x's spatial dims).
template <class F>
void for_each_tap(const Window& w, F&& f) {
  const int nd = w.nd;
  std::vector<int64_t> o(nd, 0), k(nd, 0);
  const int64_t O = w.out_size(), K = w.k_size();
  for (int64_t oi = 0; oi < O; ++oi) {
    std::fill(k.begin(), k.end(), 0);
    for (int64_t ki = 0; ki < K; ++ki) {
      int64_t in_idx = 0;
      bool inside = true;
      for (int d = 0; d < nd; ++d) {
        int64_t p = o[d] * w.stride[d] + k[d] * w.dil[d] - w.pad_begin[d];
        if (p < 0 || p >= w.in[d]) {
          inside = false;
          break;
        }
        in_idx = in_idx * w.in[d] + p;
      }
      if (inside) f(oi, ki, in_idx);
      for (int d = nd - 1; d >= 0; --d) {
        if (++k[d] < w.k[d]) break;
        k[d] = 0;
      }
    }
    for (int d = nd - 1; d >= 0; --d) {
      if (++o[d] < w.out[d]) break;
      o[d] = 0;
    }
  }
}

// ---- Conv(X, W, B?)
// -------------------------------------------------------------------------------
Window conv_window(const Node& n, const Shape& x, const Shape& wt,
                   const std::function<void(const std::string&)>& err) {
  if (wt.size() != x.size()) err("X and W differ in rank");
  return window(n, x, std::vector<int64_t>(wt.begin() + 2, wt.end()), false, err);
}
void infer_conv(InferCtx& c) {
  require_float(c, 0);
  if (c.dtype(1) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "W differs in dtype from X");
  const Shape &x = c.shape(0), &wt = c.shape(1);
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  Window w = conv_window(c.node(), x, wt, err);
  int64_t g = c.attr_int("group", 1);
  if (g < 1 || x[1] % g || wt[0] % g || wt[1] * g != x[1])
    err("channels " + std::to_string(x[1]) + ", weight " + shape_str(wt) + " and group " +
        std::to_string(g) + " do not fit");
  if (c.has_in(2)) c.check(c.shape(2) == Shape{wt[0]}, "B must have shape [M]");
  Shape out{x[0], wt[0]};
  out.insert(out.end(), w.out.begin(), w.out.end());
  c.set_out(0, c.dtype(0), out);
}

template <class T>
void im2col(const T* x, const Window& w, int64_t C, T* col) {  // col: (C * K, O)
  const int64_t O = w.out_size(), K = w.k_size(), I = w.in_size();
  std::fill(col, col + C * K * O, T(0));
  for_each_tap(w, [&](int64_t o, int64_t k, int64_t i) {
    for (int64_t ch = 0; ch < C; ++ch) col[(ch * K + k) * O + o] = x[ch * I + i];
  });
}
template <class T>
void col2im_add(const T* col, const Window& w, int64_t C, T* x) {
  const int64_t O = w.out_size(), K = w.k_size(), I = w.in_size();
  for_each_tap(w, [&](int64_t o, int64_t k, int64_t i) {
    for (int64_t ch = 0; ch < C; ++ch) x[ch * I + i] += col[(ch * K + k) * O + o];
  });
}

void conv_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &x = c.in(0), &wt = c.in(1);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    Window w = conv_window(c.node, x.shape(), wt.shape(), err);
    const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), g = c.attr_int("group", 1);
    const int64_t Cg = C / g, Mg = M / g, K = w.k_size(), O = w.out_size(), I = w.in_size();
    Tensor col = Tensor::empty({Cg * K, O}, x.dtype(), c.alloc, Category::Workspace, "im2col");
    T* y = c.out(0).data<T>();
    const T* b = c.has_in(2) ? c.in(2).data<T>() : nullptr;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t gi = 0; gi < g; ++gi) {
        im2col(x.data<T>() + (n * C + gi * Cg) * I, w, Cg, col.data<T>());
        T* yg = y + (n * M + gi * Mg) * O;
        gemm<T>(false, false, Mg, O, Cg * K, T(1), wt.data<T>() + gi * Mg * Cg * K, col.data<T>(),
                T(0), yg);
        if (b)
          for (int64_t m = 0; m < Mg; ++m)
            for (int64_t o = 0; o < O; ++o) yg[m * O + o] += b[gi * Mg + m];
      }
  });
}

// ConvGrad(dY, X, W) -> dX, dW, dB (same attributes as the Conv).
void infer_conv_grad(InferCtx& c) {
  c.set_out(0, c.dtype(1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), {c.shape(2)[0]});
}
void conv_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &dy = c.in(0), &x = c.in(1), &wt = c.in(2);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    Window w = conv_window(c.node, x.shape(), wt.shape(), err);
    const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), g = c.attr_int("group", 1);
    const int64_t Cg = C / g, Mg = M / g, K = w.k_size(), O = w.out_size(), I = w.in_size();
    T* dx = c.has_out(0) ? c.out(0).data<T>() : nullptr;
    T* dw = c.has_out(1) ? c.out(1).data<T>() : nullptr;
    T* db = c.has_out(2) ? c.out(2).data<T>() : nullptr;
    if (dx) std::fill(dx, dx + x.numel(), T(0));
    if (dw) std::fill(dw, dw + wt.numel(), T(0));
    if (db) std::fill(db, db + M, T(0));
    Tensor col = Tensor::empty({Cg * K, O}, x.dtype(), c.alloc, Category::Workspace, "im2col");
    const T* pdy = dy.data<T>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t gi = 0; gi < g; ++gi) {
        const T* dyg = pdy + (n * M + gi * Mg) * O;
        const T* wg = wt.data<T>() + gi * Mg * Cg * K;
        if (dw) {  // dW_g += dY_g (Mg, O) @ col^T (O, Cg*K)
          im2col(x.data<T>() + (n * C + gi * Cg) * I, w, Cg, col.data<T>());
          gemm<T>(false, true, Mg, Cg * K, O, T(1), dyg, col.data<T>(), T(1),
                  dw + gi * Mg * Cg * K);
        }
        if (dx) {  // dcol = W_g^T (Cg*K, Mg) @ dY_g (Mg, O), scattered back
          gemm<T>(true, false, Cg * K, O, Mg, T(1), wg, dyg, T(0), col.data<T>());
          col2im_add(col.data<T>(), w, Cg, dx + (n * C + gi * Cg) * I);
        }
        if (db)
          for (int64_t m = 0; m < Mg; ++m)
            for (int64_t o = 0; o < O; ++o) db[gi * Mg + m] += dyg[m * O + o];
      }
  });
}
void grad_conv(GradBuilder& g) {
  const Node& n = g.node();
  auto outs = g.emit("ConvGrad", {g.dy(0), g.x(0), g.x(1)}, n.attrs, 3, "graft");
  if (g.needs(0)) g.set_dx(0, outs[0]);
  if (g.needs(1)) g.set_dx(1, outs[1]);
  if (n.inputs.size() > 2 && n.inputs[2] >= 0 && g.needs(2)) g.set_dx(2, outs[2]);
}

// ---- MaxPool / AveragePool (and graft's PoolGrad)
// -------------------------------------------------
Window pool_window(const Node& n, const Shape& x,
                   const std::function<void(const std::string&)>& err) {
  if (!n.attrs.has("kernel_shape")) err("kernel_shape is required");
  return window(n, x, {}, n.attrs.get_int("ceil_mode", 0, n.label()) != 0, err);
}
void infer_pool(InferCtx& c) {
  require_float(c, 0);
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  Window w = pool_window(c.node(), c.shape(0), err);
  if (c.node().op == "MaxPool" && c.attr_int("storage_order", 0) != 0)
    c.error(ErrorKind::Unsupported, "storage_order 1 is not supported");
  if (c.has_out(1))
    c.error(ErrorKind::Unsupported, "the Indices output of MaxPool is not supported");
  Shape out{c.shape(0)[0], c.shape(0)[1]};
  out.insert(out.end(), w.out.begin(), w.out.end());
  c.set_out(0, c.dtype(0), out);
}
// Per (image, channel) plane: max or average over each window. For MaxPool `arg` receives the flat
// input index of each output's maximum (the first one on ties, as PyTorch).
template <class T>
void pool_plane(const Window& w, bool is_max, bool count_pad, const T* x, T* y, int64_t* arg) {
  const int64_t O = w.out_size();
  std::vector<double> acc(O, is_max ? -std::numeric_limits<double>::infinity() : 0.0);
  std::vector<int64_t> cnt(O, 0);
  for_each_tap(w, [&](int64_t o, int64_t, int64_t i) {
    double v = x[i];
    if (is_max) {
      if (v > acc[o] || cnt[o] == 0 || std::isnan(v)) {
        if (!(cnt[o] > 0 && std::isnan(acc[o]))) {
          acc[o] = v;
          if (arg) arg[o] = i;
        }
      }
    } else {
      acc[o] += v;
    }
    ++cnt[o];
  });
  for (int64_t o = 0; o < O; ++o) {
    if (is_max)
      y[o] = static_cast<T>(acc[o]);
    else {
      int64_t div = count_pad ? w.k_size() : cnt[o];
      if (count_pad) {  // the window clipped to the padded input (ceil_mode windows may overhang)
        div = 1;
        // windows are never past the padded extent except with ceil_mode; PyTorch clips those
        int64_t rem = o;
        for (int d = w.nd - 1; d >= 0; --d) {
          int64_t od = rem % w.out[d];
          rem /= w.out[d];
          int64_t start = od * w.stride[d] - w.pad_begin[d];
          int64_t end = std::min(start + (w.k[d] - 1) * w.dil[d] + 1, w.in[d] + w.pad_end[d]);
          div *= (end - start + w.dil[d] - 1) / w.dil[d];
        }
      }
      y[o] = static_cast<T>(div ? acc[o] / static_cast<double>(div) : 0.0);
    }
  }
}
void pool_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    Window w = pool_window(c.node, x.shape(), err);
    const bool is_max = c.node.op == "MaxPool";
    const bool count_pad = c.attr_int("count_include_pad", 0) != 0;
    const int64_t planes = x.dim(0) * x.dim(1), I = w.in_size(), O = w.out_size();
    for (int64_t p = 0; p < planes; ++p)
      pool_plane<T>(w, is_max, count_pad, x.data<T>() + p * I, c.out(0).data<T>() + p * O, nullptr);
  });
}
// PoolGrad(dY, X; the pool's attributes, op = MaxPool | AveragePool) -> dX.
void infer_pool_grad(InferCtx& c) { c.set_out(0, c.dtype(1), c.shape(1)); }
void pool_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &dy = c.in(0), &x = c.in(1);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    Window w = pool_window(c.node, x.shape(), err);
    const bool is_max = c.node.attrs.get_string("op", "MaxPool", c.node.label()) == "MaxPool";
    const bool count_pad = c.attr_int("count_include_pad", 0) != 0;
    const int64_t planes = x.dim(0) * x.dim(1), I = w.in_size(), O = w.out_size();
    T* dx = c.out(0).data<T>();
    std::fill(dx, dx + x.numel(), T(0));
    std::vector<int64_t> arg(O, -1);
    std::vector<T> y(O), ones(I, T(1));
    for (int64_t p = 0; p < planes; ++p) {
      const T* dyp = dy.data<T>() + p * O;
      T* dxp = dx + p * I;
      if (is_max) {
        pool_plane<T>(w, true, false, x.data<T>() + p * I, y.data(), arg.data());
        for (int64_t o = 0; o < O; ++o)
          if (arg[o] >= 0) dxp[arg[o]] += dyp[o];
      } else {
        // Each output's divisor, from pooling ones: avg(1) * count = 1, so divisor = count / avg.
        pool_plane<T>(w, false, count_pad, ones.data(), y.data(), nullptr);
        std::vector<int64_t> cnt(O, 0);
        for_each_tap(w, [&](int64_t o, int64_t, int64_t) { ++cnt[o]; });
        for_each_tap(w, [&](int64_t o, int64_t, int64_t i) {
          // y[o] = cnt / divisor when pooling ones, so 1 / divisor = y[o] / cnt.
          dxp[i] += dyp[o] * y[o] / static_cast<T>(cnt[o]);
        });
      }
    }
  });
}
void grad_pool(GradBuilder& g) {
  Attrs a = g.node().attrs;
  a.set_string("op", g.node().op);
  g.set_dx(0, g.emit1("PoolGrad", {g.dy(0), g.x(0)}, a, "graft"));
}

// ---- GlobalAveragePool / GlobalMaxPool
// --------------------------------------------------------------
void infer_global_pool(InferCtx& c) {
  require_float(c, 0);
  Shape s = c.shape(0);
  c.check(s.size() >= 3, "the input must be [N, C, D1, ...]");
  for (size_t i = 2; i < s.size(); ++i) s[i] = 1;
  c.set_out(0, c.dtype(0), s);
}
template <bool kMax>
void global_pool_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    const int64_t planes = x.dim(0) * x.dim(1), I = x.numel() / std::max<int64_t>(planes, 1);
    for (int64_t p = 0; p < planes; ++p) {
      const T* xp = x.data<T>() + p * I;
      double acc = kMax ? -std::numeric_limits<double>::infinity() : 0.0;
      for (int64_t i = 0; i < I; ++i) acc = kMax ? std::max<double>(acc, xp[i]) : acc + xp[i];
      c.out(0).data<T>()[p] = static_cast<T>(kMax ? acc : acc / static_cast<double>(I ? I : 1));
    }
  });
}
void grad_global_average_pool(GradBuilder& g) {
  const Shape& xs = g.shape(g.x(0));
  int64_t count = 1;
  for (size_t i = 2; i < xs.size(); ++i) count *= xs[i];
  int d = g.emit1("Expand", {g.dy(0), g.ints(xs)});
  g.set_dx(0, g.emit1("Mul", {d, g.scalar(1.0 / static_cast<double>(count), g.val(d).dtype)}));
}
void grad_global_max_pool(GradBuilder& g) {
  // As ReduceMax over the spatial axes: split evenly between ties.
  const Shape& xs = g.shape(g.x(0));
  Attrs a;
  std::vector<int64_t> axes;
  for (size_t i = 2; i < xs.size(); ++i) axes.push_back(static_cast<int64_t>(i));
  a.set_ints("axes", axes);
  a.set_int("kind", 0);
  g.set_dx(0, g.emit1("ReduceGrad", {g.dy(0), g.x(0), g.y(0)}, a, "graft"));
}

const OpDef kOps[] = {
    {.name = "Conv",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_conv,
     .kernel = conv_kernel,
     .grad = grad_conv},
    {.name = "MaxPool",
     .max_out = 2,
     .infer = infer_pool,
     .kernel = pool_kernel,
     .grad = grad_pool},
    {.name = "AveragePool", .infer = infer_pool, .kernel = pool_kernel, .grad = grad_pool},
    {.name = "GlobalAveragePool",
     .infer = infer_global_pool,
     .kernel = global_pool_kernel<false>,
     .grad = grad_global_average_pool},
    {.name = "GlobalMaxPool",
     .infer = infer_global_pool,
     .kernel = global_pool_kernel<true>,
     .grad = grad_global_max_pool},
    {.name = "ConvGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_conv_grad,
     .kernel = conv_grad_kernel},
    {.name = "PoolGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_pool_grad,
     .kernel = pool_grad_kernel},
};

}  // namespace

void register_conv_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
