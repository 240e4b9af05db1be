// Pooling: MaxPool, AveragePool (1-D, 2-D, 3-D; strides, pads, dilations, ceil_mode,
// count_include_pad), GlobalAveragePool, GlobalMaxPool, and graft's PoolGrad, over the window
// geometry of the convolutions (conv.h).
#include <cmath>
#include <limits>
#include <type_traits>

#include "conv.h"

namespace graft {
namespace {
using namespace opsutil;

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

// ---- MaxPool / AveragePool (and graft's PoolGrad)
// -------------------------------------------------
Window pool_window(const ConvAttrs& a, const Shape& x,
                   const std::function<void(const std::string&)>& err) {
  if (!a.kernel_shape) err("kernel_shape is required");
  return window(a, x, {}, a.ceil_mode, err);
}
void infer_pool(InferCtx& c) {
  require_float(c, 0);
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  const ConvAttrs a = conv_attrs(c.node());
  Window w = pool_window(a, c.shape(0), err);
  if (a.max && a.storage_order != 0)
    c.error(ErrorKind::Unsupported, "storage_order 1 is not supported");
  if (c.has_out(1))
    c.error(ErrorKind::Unsupported, "the Indices output of MaxPool is not supported");
  Shape out{c.shape(0)[0], c.shape(0)[1]};
  out.insert(out.end(), w.out.begin(), w.out.end());
  c.set_out(0, c.dtype(0), out);
  // graft's own output 2 of a 2-D MaxPool (added by its gradient rule): each output's argmax,
  // the int32 index within its input plane, which the backward scatters through (as PyTorch's
  // max_pool2d saves int64 indices) instead of searching every window again.
  if (c.has_out(2)) {
    c.check(a.max && w.nd == 2 && w.in_size() <= INT32_MAX,
            "output 2 (graft's argmax) needs a 2-D MaxPool with planes under 2^31 elements");
    c.set_out(2, DType::I32, out);
  }
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
// MaxPool over one 2-D plane without the generic tap walker. Every output takes its window's
// first tap inside the image, then a later tap with a larger value or a NaN, unless it holds a
// NaN already (which then stays): PyTorch's rule, so y and arg equal pool_plane's. Taps are
// visited in the same order (rows, then columns) per output.
//
// Note [max pool rows]
// The taps of one output are a chain of dependent compares, and on ResNet's stem (3 x 3 windows,
// stride 2, over 16 x 64 x 112^2) visiting them output by output, each compare a branch on data,
// took 46 ms of a 2.2 s step. An output row's columns whose windows lie inside the image
// (`interior`) are instead walked tap by tap: for each tap, one pass over the row's outputs that
// compares and selects without branches, which the compiler vectorizes (constant strides 1 and 2
// get their own copies; the entry is an ISA clone, Note [ISA clones]). Per output the taps and the
// rule are the same, so the results are too. Columns at the image's edges keep the per-output
// walk over the clipped window.
template <int S, class T, class Idx>
GRAFT_INLINE void max_row_interior(const T* x, int64_t W, int64_t h0, int64_t kh0, int64_t kh1,
                                   int64_t dh, int64_t kw_n, int64_t dw, int64_t stride,
                                   int64_t w_first, int64_t n, T* y, Idx* arg) {
  const int64_t sw = S ? S : stride;
  bool first = true;
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    const int64_t row = (h0 + kh * dh) * W;
    for (int64_t kw = 0; kw < kw_n; ++kw) {
      const int64_t base = row + w_first + kw * dw;
      const T* xs = x + base;
      if (first) {
        for (int64_t j = 0; j < n; ++j) y[j] = xs[j * sw];
        if (arg)
          for (int64_t j = 0; j < n; ++j) arg[j] = static_cast<Idx>(base + j * sw);
        first = false;
        continue;
      }
      if (arg) {
        for (int64_t j = 0; j < n; ++j) {
          const T v = xs[j * sw], b = y[j];
          const bool take = ((v > b) | (v != v)) & (b == b);
          y[j] = take ? v : b;
          arg[j] = take ? static_cast<Idx>(base + j * sw) : arg[j];
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const T v = xs[j * sw], b = y[j];
          const bool take = ((v > b) | (v != v)) & (b == b);
          y[j] = take ? v : b;
        }
      }
    }
  }
}
template <class T, class Idx>
GRAFT_INLINE void max_plane_2d_impl(const Window& w, const T* x, T* y, Idx* arg) {
  const int64_t H = w.in[0], W = w.in[1], OH = w.out[0], OW = w.out[1];
  const int64_t sh = w.stride[0], sw = w.stride[1], dh = w.dil[0], dw = w.dil[1];
  const int64_t pw = w.pad_begin[1];
  auto range = [](int64_t start, int64_t k, int64_t d, int64_t n, int64_t& lo, int64_t& hi) {
    lo = start >= 0 ? 0 : (-start + d - 1) / d;                              // first tap inside
    hi = std::min<int64_t>(k, n - start > 0 ? (n - start + d - 1) / d : 0);  // one past the last
  };
  // Columns ow in [ow_a, ow_b) have every tap inside the image: ow * sw - pw >= 0 and
  // ow * sw - pw + (k - 1) * dw <= W - 1.
  const int64_t span = (w.k[1] - 1) * dw;
  const int64_t ow_a = std::min(OW, (pw + sw - 1) / sw);
  const int64_t last = W - 1 - span + pw;
  const int64_t ow_b = std::max(ow_a, std::min(OW, last >= 0 ? last / sw + 1 : 0));
  for (int64_t oh = 0; oh < OH; ++oh) {
    const int64_t h0 = oh * sh - w.pad_begin[0];
    int64_t kh0, kh1;
    range(h0, w.k[0], dh, H, kh0, kh1);
    auto one = [&](int64_t ow) {
      const int64_t w0 = ow * sw - pw;
      int64_t kw0, kw1;
      range(w0, w.k[1], dw, W, kw0, kw1);
      T best = -std::numeric_limits<T>::infinity();
      int64_t bi = -1;
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        const int64_t row = (h0 + kh * dh) * W;
        for (int64_t kw = kw0; kw < kw1; ++kw) {
          const int64_t i = row + w0 + kw * dw;
          const T v = x[i];
          if (bi < 0 || ((v > best || std::isnan(v)) && !std::isnan(best))) best = v, bi = i;
        }
      }
      y[oh * OW + ow] = best;
      if (arg) arg[oh * OW + ow] = static_cast<Idx>(bi);
    };
    for (int64_t ow = 0; ow < ow_a; ++ow) one(ow);
    const int64_t n = ow_b - ow_a;
    if (n > 0 && kh1 > kh0) {
      T* yr = y + oh * OW + ow_a;
      Idx* ar = arg ? arg + oh * OW + ow_a : nullptr;
      const int64_t wf = ow_a * sw - pw;
      if (sw == 1)
        max_row_interior<1>(x, W, h0, kh0, kh1, dh, w.k[1], dw, sw, wf, n, yr, ar);
      else if (sw == 2)
        max_row_interior<2>(x, W, h0, kh0, kh1, dh, w.k[1], dw, sw, wf, n, yr, ar);
      else
        max_row_interior<0>(x, W, h0, kh0, kh1, dh, w.k[1], dw, sw, wf, n, yr, ar);
    } else {
      for (int64_t ow = ow_a; ow < ow_b; ++ow) one(ow);
    }
    for (int64_t ow = ow_b; ow < OW; ++ow) one(ow);
  }
}
GRAFT_ISA_CLONES void max_plane_2d_f32(const Window& w, const float* x, float* y, int32_t* arg) {
  max_plane_2d_impl(w, x, y, arg);
}
template <class T, class Idx>
void max_plane_2d(const Window& w, const T* x, T* y, Idx* arg) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Idx, int32_t>)
    max_plane_2d_f32(w, x, y, arg);
  else
    max_plane_2d_impl(w, x, y, arg);
}

void pool_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& x = c.in(0);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    const ConvAttrs& a = c.attrs<ConvAttrs>();
    Window w = pool_window(a, x.shape(), err);
    const bool is_max = a.max, count_pad = a.count_include_pad;
    const int64_t planes = x.dim(0) * x.dim(1), I = w.in_size(), O = w.out_size();
    int32_t* arg = c.has_out(2) ? c.out(2).data<int32_t>() : nullptr;
    parallel_for(planes, O * w.k_size(), [&](int, int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        if (is_max && w.nd == 2)
          max_plane_2d<T>(w, x.data<T>() + p * I, c.out(0).data<T>() + p * O,
                          arg ? arg + p * O : nullptr);
        else
          pool_plane<T>(w, is_max, count_pad, x.data<T>() + p * I, c.out(0).data<T>() + p * O,
                        nullptr);
      }
    });
  });
}
// PoolGrad(dY, X; the pool's attributes, op = MaxPool | AveragePool) -> dX.
// With argmax = 1: PoolGrad(dY, argmax; x_shape) -> dX, the argmax the 2-D MaxPool saved (its
// output 2): each dY element added at its index in its plane; X itself is not kept for this.
void infer_pool_grad(InferCtx& c) {
  const ConvAttrs a = conv_attrs(c.node());
  if (!a.argmax) {
    c.set_out(0, c.dtype(1), c.shape(1));
    return;
  }
  c.check(c.dtype(1) == DType::I32, "the argmax input must be int32");
  c.set_out(0, c.dtype(0), a.x_shape);
}
void pool_grad_argmax(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &dy = c.in(0), &arg = c.in(1);
    Tensor& dx = c.out(0);
    const int64_t planes = dx.dim(0) * dx.dim(1), I = dx.numel() / std::max<int64_t>(1, planes),
                  O = dy.numel() / std::max<int64_t>(1, planes);
    const T* pdy = dy.data<T>();
    const int32_t* pa = arg.data<int32_t>();
    T* pdx = dx.data<T>();
    parallel_for(planes, I + O, [&](int, int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        T* d = pdx + p * I;
        std::fill(d, d + I, T(0));
        const T* g = pdy + p * O;
        const int32_t* a = pa + p * O;
        for (int64_t o = 0; o < O; ++o) d[a[o]] += g[o];
      }
    });
  });
}
void pool_grad_kernel(KernelCtx& c) {
  const ConvAttrs& a = c.attrs<ConvAttrs>();
  if (a.argmax) return pool_grad_argmax(c);
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &dy = c.in(0), &x = c.in(1);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    Window w = pool_window(a, x.shape(), err);
    const bool is_max = a.max, count_pad = a.count_include_pad;
    const int64_t planes = x.dim(0) * x.dim(1), I = w.in_size(), O = w.out_size();
    T* dx = c.out(0).data<T>();
    const std::vector<T> ones(is_max ? 0 : I, T(1));
    std::vector<int64_t> cnt(is_max ? 0 : O, 0);
    if (!is_max) for_each_tap(w, [&](int64_t o, int64_t, int64_t) { ++cnt[o]; });
    parallel_for(planes, 2 * O * w.k_size(), [&](int, int64_t p0, int64_t p1) {
      std::vector<int64_t> arg(O, -1);
      std::vector<T> y(O);
      if (!is_max)  // each output's divisor, from pooling ones: y[o] = cnt / divisor
        pool_plane<T>(w, false, count_pad, ones.data(), y.data(), nullptr);
      for (int64_t p = p0; p < p1; ++p) {
        const T* dyp = dy.data<T>() + p * O;
        T* dxp = dx + p * I;
        std::fill(dxp, dxp + I, T(0));  // per plane, on its thread, just before the plane's adds
        if (is_max) {
          if (w.nd == 2)
            max_plane_2d<T, int64_t>(w, x.data<T>() + p * I, y.data(), arg.data());
          else
            pool_plane<T>(w, true, false, x.data<T>() + p * I, y.data(), arg.data());
          for (int64_t o = 0; o < O; ++o)
            if (arg[o] >= 0) dxp[arg[o]] += dyp[o];
        } else {
          // y[o] = cnt / divisor when pooling ones, so 1 / divisor = y[o] / cnt.
          for_each_tap(w, [&](int64_t o, int64_t, int64_t i) {
            dxp[i] += dyp[o] * y[o] / static_cast<T>(cnt[o]);
          });
        }
      }
    });
  });
}
void grad_pool(GradBuilder& g) {
  Attrs a = g.node().attrs;
  a.set_string("op", g.node().op);
  const Shape& xs = g.shape(g.x(0));
  const bool two_d = xs.size() == 4 && a.get_ints("kernel_shape", {}, g.node().label()).size() == 2;
  if (g.node().op == "MaxPool" && two_d && xs[0] > 0 && xs[1] > 0 && xs[2] > 0 && xs[3] > 0 &&
      xs[2] * xs[3] <= INT32_MAX) {
    // Scatter through the argmax the forward saves (its output 2, int32): PyTorch's max_pool2d
    // saves its input and int64 indices; graft keeps half those index bytes and not the input.
    a.set_int("argmax", 1);
    a.set_ints("x_shape", xs);
    g.set_dx(0, g.emit1("PoolGrad", {g.dy(0), g.y(2)}, a, "graft"));
    return;
  }
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
    {.name = "MaxPool",
     .max_out = 3,
     .infer = infer_pool,
     .prepare = prepare_conv,
     .kernel = pool_kernel,
     .grad = grad_pool},
    {.name = "AveragePool",
     .infer = infer_pool,
     .prepare = prepare_conv,
     .kernel = pool_kernel,
     .grad = grad_pool},
    {.name = "GlobalAveragePool",
     .infer = infer_global_pool,
     .kernel = global_pool_kernel<false>,
     .grad = grad_global_average_pool},
    {.name = "GlobalMaxPool",
     .infer = infer_global_pool,
     .kernel = global_pool_kernel<true>,
     .grad = grad_global_max_pool},
    {.name = "PoolGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_pool_grad,
     .prepare = prepare_conv,
     .kernel = pool_grad_kernel},
};

}  // namespace

void register_pool_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
