// Convolution and pooling: Conv (1-D, 2-D, 3-D; groups, depthwise, strides, pads, dilations),
// ConvTranspose (the same, as Conv's backward-data), MaxPool, AveragePool, GlobalAveragePool,
// GlobalMaxPool, and graft's ConvGrad, PoolGrad.
//
// Conv is im2col + GEMM (the one GEMM entry point, opsutil::gemm_ld): per image (or a few images
// side by side when an image has few outputs) and group,
//   col[(c, k), o] = x[c, o * stride + k * dilation - pad]   (0 outside)     // (C/g * K, O)
//   y[m, o] = W[m, (c, k)] @ col                                               // (M/g, O)
// and its gradient dW += dy @ col^T, dcol = W^T @ dy then col2im (scatter-add) into dx.
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>

#include "conv_dnnl.h"
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

// The attributes of a convolution or pooling node (Conv, ConvTranspose, ConvGrad, MaxPool,
// AveragePool, PoolGrad), read once (Note [prepared attributes], ops.h); window() and
// conv_transpose_out() check them against the input's shape.
enum class AutoPad { NotSet, Valid, SameUpper, SameLower, Other };
struct ConvAttrs {
  // Absent: the default for the input's rank (kernel_shape: the weight's spatial dims).
  std::optional<std::vector<int64_t>> kernel_shape, strides, dilations, pads, output_padding;
  AutoPad auto_pad = AutoPad::NotSet;
  std::string auto_pad_name = "NOTSET";  // as given, for messages
  bool output_shape = false;             // ConvTranspose's output_shape is given (unsupported)
  int64_t group = 1;
  bool max = false;  // MaxPool, or the PoolGrad of one (its attribute op)
  bool ceil_mode = false, count_include_pad = false;
  int64_t storage_order = 0;  // MaxPool
  bool argmax = false;        // PoolGrad through the argmax the forward saved; x_shape: X's shape
  Shape x_shape;
};
ConvAttrs conv_attrs(const Node& n) {
  const std::string where = n.label();
  auto ints = [&](const char* k) -> std::optional<std::vector<int64_t>> {
    if (!n.attrs.has(k)) return std::nullopt;
    return n.attrs.get_ints(k, {}, where);
  };
  ConvAttrs a;
  a.kernel_shape = ints("kernel_shape");
  a.strides = ints("strides");
  a.dilations = ints("dilations");
  a.pads = ints("pads");
  a.output_padding = ints("output_padding");
  a.auto_pad_name = n.attrs.get_string("auto_pad", "NOTSET", where);
  a.auto_pad = a.auto_pad_name == "NOTSET"       ? AutoPad::NotSet
               : a.auto_pad_name == "VALID"      ? AutoPad::Valid
               : a.auto_pad_name == "SAME_UPPER" ? AutoPad::SameUpper
               : a.auto_pad_name == "SAME_LOWER" ? AutoPad::SameLower
                                                 : AutoPad::Other;
  a.output_shape = n.attrs.has("output_shape");
  a.group = n.attrs.get_int("group", 1, where);
  a.max = n.op == "PoolGrad" ? n.attrs.get_string("op", "MaxPool", where) == "MaxPool"
                             : n.op == "MaxPool";
  a.ceil_mode = n.attrs.get_int("ceil_mode", 0, where) != 0;
  a.count_include_pad = n.attrs.get_int("count_include_pad", 0, where) != 0;
  a.storage_order = n.attrs.get_int("storage_order", 0, where);
  a.argmax = n.attrs.get_int("argmax", 0, where) != 0;
  a.x_shape = n.attrs.get_ints("x_shape", {}, where);
  return a;
}
std::shared_ptr<const void> prepare_conv(const Node& n) { return prepared(conv_attrs(n)); }

// An ints attribute of a window (strides, pads, ...) of `len` entries, each `dflt` when absent.
std::vector<int64_t> window_ints(const std::optional<std::vector<int64_t>>& v, const char* name,
                                 int64_t dflt, size_t len,
                                 const std::function<void(const std::string&)>& err) {
  std::vector<int64_t> r = v ? *v : std::vector<int64_t>(len, dflt);
  if (r.size() != len) err(std::string(name) + " has the wrong length");
  return r;
}
// The window over x: kernel_shape (or `kernel`, the weight's spatial dims), strides, dilations,
// pads and auto_pad.
Window window(const ConvAttrs& a, const Shape& x, const std::vector<int64_t>& kernel,
              bool ceil_mode, const std::function<void(const std::string&)>& err) {
  Window w;
  if (x.size() < 3) err("the input must be [N, C, D1, ...] with at least one spatial dim");
  w.nd = static_cast<int>(x.size()) - 2;
  w.in.assign(x.begin() + 2, x.end());
  w.k = a.kernel_shape ? *a.kernel_shape : kernel;
  if (static_cast<int>(w.k.size()) != w.nd) err("kernel_shape has the wrong rank");
  w.stride = window_ints(a.strides, "strides", 1, w.nd, err);
  w.dil = window_ints(a.dilations, "dilations", 1, w.nd, err);
  auto pads = window_ints(a.pads, "pads", 0, 2 * w.nd, err);
  w.pad_begin.assign(pads.begin(), pads.begin() + w.nd);
  w.pad_end.assign(pads.begin() + w.nd, pads.end());
  for (int i = 0; i < w.nd; ++i) {
    if (w.k[i] < 1 || w.stride[i] < 1 || w.dil[i] < 1 || w.pad_begin[i] < 0 || w.pad_end[i] < 0)
      err("kernel, strides and dilations must be >= 1 and pads >= 0");
    const int64_t ek = w.dil[i] * (w.k[i] - 1) + 1;
    if (a.auto_pad == AutoPad::Valid) {
      w.pad_begin[i] = w.pad_end[i] = 0;
    } else if (a.auto_pad == AutoPad::SameUpper || a.auto_pad == AutoPad::SameLower) {
      int64_t o = (w.in[i] + w.stride[i] - 1) / w.stride[i];
      int64_t total = std::max<int64_t>(0, (o - 1) * w.stride[i] + ek - w.in[i]);
      w.pad_begin[i] = a.auto_pad == AutoPad::SameUpper ? total / 2 : total - total / 2;
      w.pad_end[i] = total - w.pad_begin[i];
    } else if (a.auto_pad != AutoPad::NotSet) {
      err("auto_pad '" + a.auto_pad_name + "' is not supported");
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
Window conv_window(const ConvAttrs& a, const Shape& x, const Shape& wt,
                   const std::function<void(const std::string&)>& err) {
  if (wt.size() != x.size()) err("X and W differ in rank");
  if (x.size() < 3)
    err("X has rank " + std::to_string(x.size()) + "; Conv needs (N, C, spatial...)");
  return window(a, x, std::vector<int64_t>(wt.begin() + 2, wt.end()), false, err);
}
void infer_conv(InferCtx& c) {
  require_float(c, 0);
  if (c.dtype(1) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "W differs in dtype from X");
  const Shape &x = c.shape(0), &wt = c.shape(1);
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  const ConvAttrs a = conv_attrs(c.node());
  Window w = conv_window(a, x, wt, err);
  const int64_t g = a.group;
  if (g < 1 || x[1] % g || wt[0] % g || wt[1] * g != x[1])
    err("channels " + std::to_string(x[1]) + ", weight " + shape_str(wt) + " and group " +
        std::to_string(g) + " do not fit");
  if (c.has_in(2)) c.check(c.shape(2) == Shape{wt[0]}, "B must have shape [M]");
  Shape out{x[0], wt[0]};
  out.insert(out.end(), w.out.begin(), w.out.end());
  c.set_out(0, c.dtype(0), out);
}

// ---- im2col / col2im ------------------------------------------------------------------------
// The layout of im2col for one channel: per kernel offset k (a row block of O columns) and per
// output row (every output dim but the last), the range [lo, hi) of last-dim outputs whose input
// is inside the image; the rest of the row is padding. Computed once per kernel call.
struct Run {
  int64_t k, o;    // col row k, first column o (of an output row of length OL)
  int64_t in;      // input flat index of last-dim output 0 (may point outside; only [lo, hi) read)
  int64_t lo, hi;  // inside: lo <= ol < hi (lo == hi: the whole row is padding)
};
std::vector<Run> col_runs(const Window& w) {
  const int nd = w.nd, L = nd - 1;
  const int64_t OL = w.out[L], K = w.k_size(), outer = w.out_size() / std::max<int64_t>(OL, 1);
  const int64_t sL = w.stride[L], eL = w.in[L];
  std::vector<Run> runs;
  runs.reserve(K * outer);
  std::vector<int64_t> k(nd, 0), o(nd, 0);
  for (int64_t ki = 0; ki < K; ++ki) {
    std::fill(o.begin(), o.end(), 0);
    for (int64_t oo = 0; oo < outer; ++oo) {
      Run r{ki, oo * OL, 0, 0, 0};
      bool inside = true;
      int64_t base = 0;
      for (int d = 0; d < L; ++d) {
        int64_t p = o[d] * w.stride[d] + k[d] * w.dil[d] - w.pad_begin[d];
        inside = inside && p >= 0 && p < w.in[d];
        base = base * w.in[d] + p;
      }
      if (inside) {
        const int64_t off = k[L] * w.dil[L] - w.pad_begin[L];  // input of ol: ol * sL + off
        int64_t lo = off >= 0 ? 0 : (-off + sL - 1) / sL;
        int64_t hi = eL - off > 0 ? std::min<int64_t>(OL, (eL - off + sL - 1) / sL) : 0;
        if (lo < hi) {
          r.lo = lo;
          r.hi = hi;
          r.in = base * eL + off;
        }
      }
      runs.push_back(r);
      for (int d = L - 1; d >= 0; --d) {
        if (++o[d] < w.out[d]) break;
        o[d] = 0;
      }
    }
    for (int d = nd - 1; d >= 0; --d) {
      if (++k[d] < w.k[d]) break;
      k[d] = 0;
    }
  }
  return runs;
}

// col[(ch, k), col0 + o] = x[ch, ...] (0 in the padding), ld: col's row length. Parallel over the
// (channel, kernel offset) rows: col_runs lists each offset's runs together.
template <class T>
void im2col(const T* x, const Window& w, const std::vector<Run>& runs, int64_t C, T* col,
            int64_t ld) {
  const int64_t K = w.k_size(), I = w.in_size(), O = w.out_size(), OL = w.out[w.nd - 1];
  const int64_t s = w.stride[w.nd - 1], per_k = static_cast<int64_t>(runs.size()) / K;
  parallel_for(C * K, O, [&](int, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t ch = row / K, k = row % K;
      for (const Run* r = runs.data() + k * per_k; r != runs.data() + (k + 1) * per_k; ++r) {
        T* c = col + row * ld + r->o;
        const T* xi = x + ch * I + r->in;
        std::fill(c, c + r->lo, T(0));
        if (s == 1)
          std::copy(xi + r->lo, xi + r->hi, c + r->lo);
        else
          for (int64_t ol = r->lo; ol < r->hi; ++ol) c[ol] = xi[ol * s];
        std::fill(c + r->hi, c + OL, T(0));
      }
    }
  });
}
// x[ch, ...] += col[(ch, k), o] over every tap inside the image (the scatter-add of im2col).
// Parallel over channels (the offsets of one channel add into the same inputs).
template <class T>
void col2im_add(const T* col, const Window& w, const std::vector<Run>& runs, int64_t C, T* x,
                int64_t ld) {
  const int64_t K = w.k_size(), I = w.in_size();
  const int64_t s = w.stride[w.nd - 1];
  parallel_for(C, K * w.out_size(), [&](int, int64_t c0, int64_t c1) {
    for (int64_t ch = c0; ch < c1; ++ch)
      for (const Run& r : runs) {
        const T* c = col + (ch * K + r.k) * ld + r.o;
        T* xi = x + ch * I + r.in;
        if (s == 1)
          for (int64_t ol = r.lo; ol < r.hi; ++ol) xi[ol] += c[ol];
        else
          for (int64_t ol = r.lo; ol < r.hi; ++ol) xi[ol * s] += c[ol];
      }
  });
}

// A 1x1 convolution with unit strides and no padding reads x as its own im2col matrix.
bool is_pointwise(const Window& w) {
  for (int d = 0; d < w.nd; ++d)
    if (w.k[d] != 1 || w.stride[d] != 1 || w.pad_begin[d] != 0 || w.pad_end[d] != 0) return false;
  return true;
}
// The oneDNN path (Note [oneDNN convolutions], conv_dnnl.cpp): dense float32 convolutions, in
// bf16 too under a Bf16MatmulScope. Depthwise ones keep the direct kernels below; float64 keeps
// im2col + GEMM.
ConvShape conv_shape(const Window& w, int64_t N, int64_t C, int64_t M, int64_t g) {
  return ConvShape{N, C, M, g, w.in, w.out, w.k, w.stride, w.dil, w.pad_begin, w.pad_end};
}
// The oneDNN passes' scratch (dnnl_conv_scratch bytes), from graft's allocator.
Tensor dnnl_scratch(int64_t bytes, Allocator& a) {
  return Tensor::empty({std::max<int64_t>(1, (bytes + 3) / 4)}, DType::F32, a, Category::Workspace,
                       "oneDNN convolution scratch");
}

// Images per GEMM: one, unless an image has few output positions (ViT's 14x14 patch grid), where
// nb images side by side give the GEMM ~2048 columns; the im2col workspace stays under 16 MiB.
int64_t images_per_gemm(int64_t N, int64_t O, int64_t rows, size_t elem) {
  if (O >= 1024) return 1;
  int64_t nb = std::min<int64_t>(N, (2048 + O - 1) / std::max<int64_t>(O, 1));
  const int64_t cap = (int64_t{16} << 20) / std::max<int64_t>(1, rows * O * int64_t(elem));
  return std::max<int64_t>(1, std::min(nb, cap));
}

// ---- depthwise (one input channel per group), direct -----------------------------------------
// 1-D and 2-D convolutions whose groups each read one input channel (MobileNet, EfficientNet,
// ConvNeXt) are a handful of multiply-adds per output: an im2col + GEMM per channel would be
// tiny GEMMs. Each plane is copied into a zero-padded buffer, so every inner loop is bounds-free;
// a block of B outputs of a row stays in registers over all the kernel taps.
//   forward  y[oh, ow] = b + sum_k w[kh, kw] * xp[oh * sh + kh * dh, ow * sw + kw * dw]
//   dW       dw[k] += sum_{oh, ow} dy[oh, ow] * xp[oh * sh + kh * dh, ow * sw + kw * dw]
//   dX       unit strides: the forward over dy zero-padded by the dilated kernel extent with the
//            kernel flipped, written straight into dx; other strides: a scatter-add into a padded
//            plane.
struct Plane2 {
  int64_t H, W, OH, OW, KH, KW, sh, sw, dh, dw, ph, pw, Hp, Wp;
  int64_t ld;  // row stride of the padded input the taps read
};
bool depthwise_plane(const Window& w, int64_t Cg, Plane2& p) {
  if (Cg != 1 || w.nd > 2) return false;
  const bool two = w.nd == 2;
  auto at = [&](const std::vector<int64_t>& v, int i, int64_t one) {
    return two ? v[i] : (i == 0 ? one : v[0]);
  };
  p.H = at(w.in, 0, 1), p.W = at(w.in, 1, 1), p.OH = at(w.out, 0, 1), p.OW = at(w.out, 1, 1);
  p.KH = at(w.k, 0, 1), p.KW = at(w.k, 1, 1), p.sh = at(w.stride, 0, 1), p.sw = at(w.stride, 1, 1);
  p.dh = at(w.dil, 0, 1), p.dw = at(w.dil, 1, 1);
  p.ph = at(w.pad_begin, 0, 0), p.pw = at(w.pad_begin, 1, 0);
  // The padded extent the taps read (rows and columns past it are never read).
  p.Hp = (p.OH - 1) * p.sh + (p.KH - 1) * p.dh + 1;
  p.Wp = (p.OW - 1) * p.sw + (p.KW - 1) * p.dw + 1;
  p.ld = p.Wp;
  return true;
}
// xp (rows x cols, row stride cols) = x (H x W) placed at (r0, c0), zeros around it, clipped.
template <class T>
void pad_into(const T* x, int64_t H, int64_t W, T* xp, int64_t rows, int64_t cols, int64_t r0,
              int64_t c0) {
  std::fill(xp, xp + rows * cols, T(0));
  const int64_t w1 = std::max<int64_t>(0, std::min(W, cols - c0));
  for (int64_t h = 0; h < H && h + r0 < rows; ++h)
    std::copy(x + h * W, x + h * W + w1, xp + (h + r0) * cols + c0);
}
// B outputs of one row, starting at x (the first tap's input of the first output).
// The depthwise kernels below are plain loops the compiler vectorizes; their float32 entry points
// are GRAFT_ISA_CLONES (Note [ISA clones], util.h), their helpers GRAFT_INLINE.

template <int B, bool kUnit, class T>
GRAFT_INLINE void dw_block(const Plane2& p, const T* x, const T* wk, T b, T* out) {
  T acc[B];
  for (int i = 0; i < B; ++i) acc[i] = b;
  for (int64_t kh = 0; kh < p.KH; ++kh) {
    const T* xr = x + kh * p.dh * p.ld;
    for (int64_t kw = 0; kw < p.KW; ++kw) {
      const T wv = wk[kh * p.KW + kw];
      const T* xs = xr + kw * p.dw;
      for (int i = 0; i < B; ++i) acc[i] += wv * xs[kUnit ? i : i * p.sw];
    }
  }
  for (int i = 0; i < B; ++i) out[i] = acc[i];
}
// One output row in blocks of B; the last block overlaps the one before (outputs are written,
// not added, so recomputing a few is harmless).
template <int B, bool kUnit, class T>
GRAFT_INLINE void dw_row(const Plane2& p, const T* x, const T* wk, T b, T* y) {
  for (int64_t o = 0;; o += B) {
    const int64_t o0 = std::min(o, p.OW - B);
    dw_block<B, kUnit>(p, x + o0 * p.sw, wk, b, y + o0);
    if (o0 + B >= p.OW) break;
  }
}
template <bool kUnit, class T>
GRAFT_INLINE void dw_forward(const Plane2& p, const T* xp, const T* wk, T b, T* y) {
  constexpr int kB = 128 / sizeof(T);  // 32 floats: enough independent sums to hide the latency
  for (int64_t oh = 0; oh < p.OH; ++oh) {
    const T* x = xp + oh * p.sh * p.ld;
    T* yr = y + oh * p.OW;
    if (p.OW >= kB)
      dw_row<kB, kUnit>(p, x, wk, b, yr);
    else if (p.OW >= 8)
      dw_row<8, kUnit>(p, x, wk, b, yr);
    else
      for (int64_t o = 0; o < p.OW; ++o) dw_block<1, kUnit>(p, x + o * p.sw, wk, b, yr + o);
  }
}
template <class T>
GRAFT_INLINE void depthwise_forward_impl(const Plane2& p, const T* xp, const T* wk, T b, T* y) {
  if (p.sw == 1)
    dw_forward<true>(p, xp, wk, b, y);
  else
    dw_forward<false>(p, xp, wk, b, y);
}
template <class T>
void depthwise_forward(const Plane2& p, const T* xp, const T* wk, T b, T* y) {
  depthwise_forward_impl(p, xp, wk, b, y);
}
GRAFT_ISA_CLONES void depthwise_forward(const Plane2& p, const float* xp, const float* wk, float b,
                                        float* y) {
  depthwise_forward_impl(p, xp, wk, b, y);
}
// dwk[k] += sum over the plane of dy * (the inputs tap k reads). Each row's products add up in T
// (a few per lane: vectorized), the rows in double: a sum over a whole plane in float32 (4096
// terms at 64x64, which largely cancel) lost three digits against PyTorch's (MobileNetV2's
// depthwise weight gradients, tests/python/test_zoo.py's accuracy test).
template <bool kUnit, class T>
GRAFT_INLINE void dw_wgrad(const Plane2& p, const T* xp, const T* dy, T* dwk) {
  constexpr int kB = 64 / sizeof(T);
  for (int64_t kh = 0; kh < p.KH; ++kh)
    for (int64_t kw = 0; kw < p.KW; ++kw) {
      double total = 0;
      for (int64_t oh = 0; oh < p.OH; ++oh) {
        const T* xs = xp + (oh * p.sh + kh * p.dh) * p.ld + kw * p.dw;
        const T* dyr = dy + oh * p.OW;
        T acc[kB] = {};
        T tail = 0;
        int64_t o = 0;
        for (; o + kB <= p.OW; o += kB)
          for (int i = 0; i < kB; ++i) acc[i] += dyr[o + i] * xs[kUnit ? o + i : (o + i) * p.sw];
        for (; o < p.OW; ++o) tail += dyr[o] * xs[o * p.sw];
        for (int i = 0; i < kB; ++i) tail += acc[i];
        total += tail;
      }
      dwk[kh * p.KW + kw] += static_cast<T>(total);
    }
}
template <class T>
GRAFT_INLINE void depthwise_wgrad_impl(const Plane2& p, const T* xp, const T* dy, T* dwk) {
  if (p.sw == 1)
    dw_wgrad<true>(p, xp, dy, dwk);
  else
    dw_wgrad<false>(p, xp, dy, dwk);
}
template <class T>
void depthwise_wgrad(const Plane2& p, const T* xp, const T* dy, T* dwk) {
  depthwise_wgrad_impl(p, xp, dy, dwk);
}
GRAFT_ISA_CLONES void depthwise_wgrad(const Plane2& p, const float* xp, const float* dy,
                                      float* dwk) {
  depthwise_wgrad_impl(p, xp, dy, dwk);
}
// Strided dX: dxp[oh * sh + kh * dh, ow * sw + kw * dw] += w[k] * dy[oh, ow] (dxp padded).
template <class T>
void depthwise_dx_scatter(const Plane2& p, const T* dy, const T* wk, T* dxp) {
  for (int64_t oh = 0; oh < p.OH; ++oh) {
    const T* dyr = dy + oh * p.OW;
    for (int64_t kh = 0; kh < p.KH; ++kh)
      for (int64_t kw = 0; kw < p.KW; ++kw) {
        const T wv = wk[kh * p.KW + kw];
        T* ds = dxp + (oh * p.sh + kh * p.dh) * p.Wp + kw * p.dw;
        for (int64_t ow = 0; ow < p.OW; ++ow) ds[ow * p.sw] += wv * dyr[ow];
      }
  }
}
// Unit strides: dX is a forward pass (see above). The plane that describes it and the padded dy
// buffer's extent.
Plane2 dx_plane(const Plane2& p) {
  Plane2 q = p;
  q.OH = p.H, q.OW = p.W, q.sh = q.sw = 1;
  q.ld = p.OW + 2 * (p.KW - 1) * p.dw;
  return q;
}
int64_t dy_pad_rows(const Plane2& p) { return p.OH + 2 * (p.KH - 1) * p.dh; }

// ---- depthwise on narrow planes, 16 channels side by side ----------------------------------
// Planes under 16 outputs wide (MobileNet's and EfficientNet's later stages at small images:
// 8x8, 4x4, 2x2) leave the row loops above scalar, and oneDNN's blocked layouts beat them by
// vectorizing across channels. So here 16 channels go side by side: their planes are transposed
// into one zero-padded [rows][cols][16] buffer (in cache at these sizes) and each tap of each
// output is one 16-wide multiply-add. Per output the taps add in dw_block's order (bias first,
// then kh, kw); dW sums over the plane in another order than dw_wgrad. Float32 only.
constexpr int kLanes = 16;
bool narrow_planes(const Plane2& p) { return p.OW < kLanes && p.W < kLanes; }

// dst[(r * cols + c) * kLanes + l] = plane l of src (H x W, `plane` apart) at (r - r0, c - c0),
// zeros elsewhere and in the lanes past nc; clipped to rows x cols.
void transpose_pad(const float* src, int64_t plane, int64_t nc, int64_t H, int64_t W, float* dst,
                   int64_t rows, int64_t cols, int64_t r0, int64_t c0) {
  std::fill(dst, dst + rows * cols * kLanes, 0.f);
  for (int64_t l = 0; l < nc; ++l)
    for (int64_t h = 0; h < H && h + r0 < rows; ++h)
      for (int64_t w = 0; w < W && w + c0 < cols; ++w)
        dst[((h + r0) * cols + w + c0) * kLanes + l] = src[l * plane + h * W + w];
}
// out[o * kLanes + l] = bias[l] + sum over taps of wt[k * kLanes + l] * (the input tap k reads),
// the input a transposed padded buffer with row stride ld starting at tp.
GRAFT_ISA_CLONES void dwc_forward(const Plane2& p, const float* tp, int64_t ld, const float* wt,
                                  const float* bias, float* out) {
  for (int64_t oh = 0; oh < p.OH; ++oh)
    for (int64_t ow = 0; ow < p.OW; ++ow) {
      float acc[kLanes];
      for (int l = 0; l < kLanes; ++l) acc[l] = bias[l];
      const float* x0 = tp + (oh * p.sh * ld + ow * p.sw) * kLanes;
      for (int64_t kh = 0; kh < p.KH; ++kh)
        for (int64_t kw = 0; kw < p.KW; ++kw) {
          const float* xs = x0 + (kh * p.dh * ld + kw * p.dw) * kLanes;
          const float* wv = wt + (kh * p.KW + kw) * kLanes;
          for (int l = 0; l < kLanes; ++l) acc[l] += wv[l] * xs[l];
        }
      float* o = out + (oh * p.OW + ow) * kLanes;
      for (int l = 0; l < kLanes; ++l) o[l] = acc[l];
    }
}
// dw[k * kLanes + l] += sum over outputs (oh, ow) of dy[(oh * ldy + ow) * kLanes + l] * (the
// input tap k reads), the input a transposed padded buffer with row stride p.Wp.
GRAFT_ISA_CLONES void dwc_wgrad(const Plane2& p, const float* tp, const float* dy, int64_t ldy,
                                float* dw) {
  for (int64_t kh = 0; kh < p.KH; ++kh)
    for (int64_t kw = 0; kw < p.KW; ++kw) {
      float acc[kLanes] = {};
      for (int64_t oh = 0; oh < p.OH; ++oh)
        for (int64_t ow = 0; ow < p.OW; ++ow) {
          const float* xs = tp + ((oh * p.sh + kh * p.dh) * p.Wp + ow * p.sw + kw * p.dw) * kLanes;
          const float* d = dy + (oh * ldy + ow) * kLanes;
          for (int l = 0; l < kLanes; ++l) acc[l] += d[l] * xs[l];
        }
      float* o = dw + (kh * p.KW + kw) * kLanes;
      for (int l = 0; l < kLanes; ++l) o[l] += acc[l];
    }
}
// w[(c0 + l) * K + k] (flipped: w[.. + K - 1 - k]) as wt[k * kLanes + l], zeros past nc.
void transpose_taps(const float* w, int64_t K, int64_t nc, bool flip, float* wt) {
  std::fill(wt, wt + K * kLanes, 0.f);
  for (int64_t l = 0; l < nc; ++l)
    for (int64_t k = 0; k < K; ++k) wt[k * kLanes + l] = w[l * K + (flip ? K - 1 - k : k)];
}
// dst plane l (n outputs each, `plane` apart) = src[o * kLanes + l], for l < nc.
void untranspose(const float* src, int64_t n, int64_t nc, float* dst, int64_t plane) {
  for (int64_t l = 0; l < nc; ++l)
    for (int64_t o = 0; o < n; ++o) dst[l * plane + o] = src[o * kLanes + l];
}

void conv_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor &x = c.in(0), &wt = c.in(1);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    const ConvAttrs& a = c.attrs<ConvAttrs>();
    Window w = conv_window(a, x.shape(), wt.shape(), err);
    const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), g = a.group;
    const int64_t Cg = C / g, Mg = M / g, K = w.k_size(), O = w.out_size(), I = w.in_size();
    const T *px = x.data<T>(), *pw = wt.data<T>();
    const T* b = c.has_in(2) ? c.in(2).data<T>() : nullptr;
    T* y = c.out(0).data<T>();
    Plane2 p;
    if constexpr (std::is_same_v<T, float>) {
      if (depthwise_plane(w, Cg, p) && Mg == 1 && narrow_planes(p)) {
        const int64_t CB = (C + kLanes - 1) / kLanes, per = (p.Hp * p.Wp + K + 1 + O) * kLanes;
        Tensor ws = Tensor::empty({max_threads(), per}, x.dtype(), c.alloc, Category::Workspace,
                                  "channel-blocked planes");
        parallel_for(N * CB, kLanes * O * K, [&](int t, int64_t q0, int64_t q1) {
          float *tp = ws.data<float>() + t * per, *wt = tp + p.Hp * p.Wp * kLanes,
                *bias = wt + K * kLanes, *out = bias + kLanes;
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t n = q / CB, c0 = (q % CB) * kLanes,
                          nc = std::min<int64_t>(kLanes, C - c0);
            transpose_pad(px + (n * C + c0) * I, I, nc, p.H, p.W, tp, p.Hp, p.Wp, p.ph, p.pw);
            transpose_taps(pw + c0 * K, K, nc, false, wt);
            for (int64_t l = 0; l < kLanes; ++l) bias[l] = b && l < nc ? b[c0 + l] : 0.f;
            dwc_forward(p, tp, p.Wp, wt, bias, out);
            untranspose(out, O, nc, y + (n * M + c0) * O, O);
          }
        });
        return;
      }
    }
    if (depthwise_plane(w, Cg, p)) {
      Tensor ws = Tensor::empty({max_threads(), p.Hp * p.Wp}, x.dtype(), c.alloc,
                                Category::Workspace, "padded plane");
      parallel_for(N * g, Mg * O * K, [&](int t, int64_t q0, int64_t q1) {
        T* xp = ws.data<T>() + t * p.Hp * p.Wp;
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t n = q / g, gi = q % g;
          pad_into(px + (n * C + gi) * I, p.H, p.W, xp, p.Hp, p.Wp, p.ph, p.pw);
          for (int64_t m = gi * Mg; m < (gi + 1) * Mg; ++m)
            depthwise_forward(p, xp, pw + m * K, b ? b[m] : T(0), y + (n * M + m) * O);
        }
      });
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      const ConvShape cs = conv_shape(w, N, C, M, g);
      if (const DnnlConv* d = dnnl_conv(cs, ConvPass::Forward, bf16_gemm_active(), b != nullptr)) {
        Tensor scratch = dnnl_scratch(dnnl_conv_scratch(*d), c.alloc);
        dnnl_conv_forward(*d, px, pw, b, y, scratch.data<float>());
        return;
      }
    }
    const bool direct = is_pointwise(w);
    const int64_t rows = Cg * K, nb = direct ? 1 : images_per_gemm(N, O, rows, sizeof(T));
    const int64_t ld = nb * O;
    const std::vector<Run> runs = direct ? std::vector<Run>{} : col_runs(w);
    Tensor col, ytmp;
    if (!direct) col = Tensor::empty({rows, ld}, x.dtype(), c.alloc, Category::Workspace, "im2col");
    if (nb > 1) ytmp = Tensor::empty({Mg, ld}, x.dtype(), c.alloc, Category::Workspace, "conv out");
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
      const int64_t cnt = std::min(nb, N - n0);
      for (int64_t gi = 0; gi < g; ++gi) {
        const T* B = px + (n0 * C + gi * Cg) * I;  // direct: x is the im2col matrix
        if (!direct) {
          for (int64_t j = 0; j < cnt; ++j)
            im2col(px + ((n0 + j) * C + gi * Cg) * I, w, runs, Cg, col.data<T>() + j * O, ld);
          B = col.data<T>();
        }
        T* yg = y + (n0 * M + gi * Mg) * O;
        const bool gather = cnt > 1;
        gemm_ld<T>(false, false, Mg, cnt * O, rows, T(1), pw + gi * Mg * rows, rows, B,
                   direct ? O : ld, T(0), gather ? ytmp.data<T>() : yg, gather ? ld : O);
        for (int64_t j = 0; j < cnt; ++j)
          for (int64_t m = 0; m < Mg; ++m) {
            T* yr = y + ((n0 + j) * M + gi * Mg + m) * O;
            if (gather) std::copy_n(ytmp.data<T>() + m * ld + j * O, O, yr);
            if (b)
              for (int64_t o = 0; o < O; ++o) yr[o] += b[gi * Mg + m];
          }
      }
    }
  });
}

// ConvGrad(dY, X, W) -> dX, dW, dB (same attributes as the Conv).
void infer_conv_grad(InferCtx& c) {
  c.set_out(0, c.dtype(1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), {c.shape(2)[0]});
}
// The backward of the Conv of the node's window from x to dy's shape: dX (null: not wanted), dW,
// dB. x's data is read only for dW, so ConvTranspose passes a shape-only x to get dX alone.
void conv_backward(KernelCtx& c, const Tensor& dy, const Tensor& x, const Tensor& wt, Tensor* dxt,
                   Tensor* dwt, Tensor* dbt) {
  dispatch_float(dy.dtype(), c, [&]<class T>() {
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    const ConvAttrs& a = c.attrs<ConvAttrs>();
    Window w = conv_window(a, x.shape(), wt.shape(), err);
    const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), g = a.group;
    const int64_t Cg = C / g, Mg = M / g, K = w.k_size(), O = w.out_size(), I = w.in_size();
    T* dx = dxt ? dxt->data<T>() : nullptr;
    T* dw = dwt ? dwt->data<T>() : nullptr;
    T* db = dbt ? dbt->data<T>() : nullptr;
    if (dw) std::fill(dw, dw + wt.numel(), T(0));
    if (db) std::fill(db, db + M, T(0));
    const T *pdy = dy.data<T>(), *px = x.data<T>(), *pw = wt.data<T>();
    Plane2 p;
    if constexpr (std::is_same_v<T, float>) {
      if (depthwise_plane(w, Cg, p) && Mg == 1 && narrow_planes(p) &&
          (!dx || (p.sh == 1 && p.sw == 1))) {
        // One task per block of 16 channels: its dW rows sum over the images.
        const Plane2 q = dx_plane(p);
        const int64_t CB = (C + kLanes - 1) / kLanes, DYR = dy_pad_rows(p);
        const int64_t per = (p.Hp * p.Wp + O + 2 * K + DYR * q.ld + I + 1) * kLanes;
        Tensor ws = Tensor::empty({max_threads(), per}, x.dtype(), c.alloc, Category::Workspace,
                                  "channel-blocked planes");
        parallel_for(CB, 2 * N * kLanes * O * K, [&](int t, int64_t b0, int64_t b1) {
          float *tp = ws.data<float>() + t * per, *dyt = tp + p.Hp * p.Wp * kLanes,
                *dw16 = dyt + O * kLanes, *flip = dw16 + K * kLanes, *dyp = flip + K * kLanes,
                *out = dyp + DYR * q.ld * kLanes, *zero = out + I * kLanes;
          std::fill(zero, zero + kLanes, 0.f);
          for (int64_t cb = b0; cb < b1; ++cb) {
            const int64_t c0 = cb * kLanes, nc = std::min<int64_t>(kLanes, C - c0);
            std::fill(dw16, dw16 + K * kLanes, 0.f);
            if (dx) transpose_taps(pw + c0 * K, K, nc, true, flip);
            for (int64_t n = 0; n < N; ++n) {
              const float* dyn = pdy + (n * M + c0) * O;
              if (db)
                for (int64_t l = 0; l < nc; ++l) {
                  float s = 0;
                  for (int64_t o = 0; o < O; ++o) s += dyn[l * O + o];
                  db[c0 + l] += s;
                }
              // dy transposed once: padded by the kernel's extent when dX is wanted (dW reads
              // the same buffer at the padding's offset), else unpadded.
              const float* dyt16 = dyt;
              int64_t ldy = p.OW;
              if (dx) {
                transpose_pad(dyn, O, nc, p.OH, p.OW, dyp, DYR, q.ld, (p.KH - 1) * p.dh,
                              (p.KW - 1) * p.dw);
                dyt16 = dyp + ((p.KH - 1) * p.dh * q.ld + (p.KW - 1) * p.dw) * kLanes;
                ldy = q.ld;
              } else if (dw) {
                transpose_pad(dyn, O, nc, p.OH, p.OW, dyt, p.OH, p.OW, 0, 0);
              }
              if (dw) {
                transpose_pad(px + (n * C + c0) * I, I, nc, p.H, p.W, tp, p.Hp, p.Wp, p.ph, p.pw);
                dwc_wgrad(p, tp, dyt16, ldy, dw16);
              }
              if (dx) {  // a forward over dy padded by the kernel's extent, kernel flipped
                dwc_forward(q, dyp + (p.ph * q.ld + p.pw) * kLanes, q.ld, flip, zero, out);
                untranspose(out, I, nc, dx + (n * C + c0) * I, I);
              }
            }
            if (dw)
              for (int64_t l = 0; l < nc; ++l)
                for (int64_t k = 0; k < K; ++k) dw[(c0 + l) * K + k] += dw16[k * kLanes + l];
          }
        });
        return;
      }
    }
    if (depthwise_plane(w, Cg, p)) {
      // One task per group (input channel): its dW rows sum over the images.
      const Plane2 q = dx_plane(p);
      const bool flipped = p.sh == 1 && p.sw == 1 && Mg == 1;  // dX as a forward pass
      const int64_t HW = p.Hp * p.Wp, DY = flipped ? dy_pad_rows(p) * q.ld : HW;
      const int64_t per = HW + DY + K;
      Tensor ws = Tensor::empty({max_threads(), per}, x.dtype(), c.alloc, Category::Workspace,
                                "padded planes");
      parallel_for(g, 2 * N * Mg * O * K, [&](int t, int64_t g0, int64_t g1) {
        T *xp = ws.data<T>() + t * per, *buf = xp + HW, *flip = buf + DY;
        for (int64_t gi = g0; gi < g1; ++gi) {
          if (flipped) std::reverse_copy(pw + gi * K, pw + (gi + 1) * K, flip);
          for (int64_t n = 0; n < N; ++n) {
            if (dw) pad_into(px + (n * C + gi) * I, p.H, p.W, xp, p.Hp, p.Wp, p.ph, p.pw);
            if (dx && !flipped) std::fill(buf, buf + HW, T(0));
            for (int64_t m = gi * Mg; m < (gi + 1) * Mg; ++m) {
              const T* dyp = pdy + (n * M + m) * O;
              if (dw) depthwise_wgrad(p, xp, dyp, dw + m * K);
              if (db) db[m] += static_cast<T>(sum8(O, [&](int64_t o) { return double(dyp[o]); }));
              if (dx && flipped) {
                pad_into(dyp, p.OH, p.OW, buf, dy_pad_rows(p), q.ld, (p.KH - 1) * p.dh,
                         (p.KW - 1) * p.dw);
                depthwise_forward(q, buf + p.ph * q.ld + p.pw, flip, T(0), dx + (n * C + gi) * I);
              } else if (dx) {
                depthwise_dx_scatter(p, dyp, pw + m * K, buf);
              }
            }
            if (dx && !flipped) {  // the interior of the padded plane (zeros where never read)
              T* dxn = dx + (n * C + gi) * I;
              for (int64_t h = 0; h < p.H; ++h) {
                const int64_t hp = h + p.ph;
                const int64_t w1 = hp < p.Hp ? std::max<int64_t>(0, std::min(p.W, p.Wp - p.pw)) : 0;
                std::copy(buf + hp * p.Wp + p.pw, buf + hp * p.Wp + p.pw + w1, dxn + h * p.W);
                std::fill(dxn + h * p.W + w1, dxn + (h + 1) * p.W, T(0));
              }
            }
          }
        }
      });
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      const ConvShape cs = conv_shape(w, N, C, M, g);
      const bool bf16 = bf16_gemm_active();
      const DnnlConv* dgrad = dx ? dnnl_conv(cs, ConvPass::BackwardData, bf16, false) : nullptr;
      const DnnlConv* wgrad =
          dw ? dnnl_conv(cs, ConvPass::BackwardWeights, bf16, db != nullptr) : nullptr;
      if ((!dx || dgrad) && (!dw || wgrad)) {
        Tensor scratch = dnnl_scratch(
            std::max(dgrad ? dnnl_conv_scratch(*dgrad) : 0, wgrad ? dnnl_conv_scratch(*wgrad) : 0),
            c.alloc);
        if (dgrad) dnnl_conv_backward_data(*dgrad, pdy, pw, dx, scratch.data<float>());
        if (wgrad) dnnl_conv_backward_weights(*wgrad, pdy, px, dw, db, scratch.data<float>());
        if (db && !dw) {  // a frozen weight's bias: dB = dY summed over images and positions
          Shape per_channel(dy.shape().size(), 1);
          per_channel[1] = M;
          sum_to_shape(pdy, dy.shape(), db, per_channel, false);
        }
        return;
      }
    }
    const bool direct = is_pointwise(w);
    const int64_t rows = Cg * K, nb = direct ? 1 : images_per_gemm(N, O, rows, sizeof(T));
    const int64_t ld = nb * O;
    const std::vector<Run> runs = direct ? std::vector<Run>{} : col_runs(w);
    Tensor col, dytmp;
    if (!direct) col = Tensor::empty({rows, ld}, x.dtype(), c.alloc, Category::Workspace, "im2col");
    if (nb > 1) dytmp = Tensor::empty({Mg, ld}, x.dtype(), c.alloc, Category::Workspace, "conv dy");
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
      const int64_t cnt = std::min(nb, N - n0);
      for (int64_t gi = 0; gi < g; ++gi) {
        // dY_g for the cnt images side by side: (Mg, cnt * O), row stride lddy.
        const T* dyg = pdy + (n0 * M + gi * Mg) * O;
        int64_t lddy = O;
        if (cnt > 1) {
          for (int64_t j = 0; j < cnt; ++j)
            for (int64_t m = 0; m < Mg; ++m)
              std::copy_n(pdy + ((n0 + j) * M + gi * Mg + m) * O, O,
                          dytmp.data<T>() + m * ld + j * O);
          dyg = dytmp.data<T>();
          lddy = ld;
        }
        const T* wg = pw + gi * Mg * rows;
        if (dw) {  // dW_g += dY_g (Mg, cnt*O) @ col^T (cnt*O, Cg*K)
          const T* B = px + (n0 * C + gi * Cg) * I;
          if (!direct) {
            for (int64_t j = 0; j < cnt; ++j)
              im2col(px + ((n0 + j) * C + gi * Cg) * I, w, runs, Cg, col.data<T>() + j * O, ld);
            B = col.data<T>();
          }
          gemm_ld<T>(false, true, Mg, rows, cnt * O, T(1), dyg, lddy, B, direct ? O : ld, T(1),
                     dw + gi * Mg * rows, rows);
        }
        if (dx) {  // dcol = W_g^T (Cg*K, Mg) @ dY_g (Mg, cnt*O), scattered back
          T* dxg = dx + (n0 * C + gi * Cg) * I;
          if (direct) {
            gemm_ld<T>(true, false, rows, O, Mg, T(1), wg, rows, dyg, lddy, T(0), dxg, O);
          } else {
            gemm_ld<T>(true, false, rows, cnt * O, Mg, T(1), wg, rows, dyg, lddy, T(0),
                       col.data<T>(), ld);
            for (int64_t j = 0; j < cnt; ++j) {
              T* dxj = dx + ((n0 + j) * C + gi * Cg) * I;
              std::fill(dxj, dxj + Cg * I, T(0));
              col2im_add(col.data<T>() + j * O, w, runs, Cg, dxj, ld);
            }
          }
        }
        if (db)
          for (int64_t m = 0; m < Mg; ++m) {
            T s = 0;
            for (int64_t o = 0; o < cnt * O; ++o) s += dyg[m * lddy + o];
            db[gi * Mg + m] += s;
          }
      }
    }
  });
}
void conv_grad_kernel(KernelCtx& c) {
  conv_backward(c, c.in(0), c.in(1), c.in(2), c.has_out(0) ? &c.out(0) : nullptr,
                c.has_out(1) ? &c.out(1) : nullptr, c.has_out(2) ? &c.out(2) : nullptr);
}
void grad_conv(GradBuilder& g) {
  const Node& n = g.node();
  auto outs = g.emit("ConvGrad", {g.dy(0), g.x(0), g.x(1)}, n.attrs, 3, "graft");
  const bool has_b = n.inputs.size() > 2 && n.inputs[2] >= 0;
  const bool need[3] = {g.needs(0), g.needs(1), has_b && g.needs(2)};
  for (int i = 0; i < 3; ++i) {
    if (need[i])
      g.set_dx(i, outs[i]);
    else
      g.drop_output(outs[i]);  // no dX for an image, no dW for a frozen weight
  }
}

// 2 * out * (C / group * kernel): each output element is a multiply-add over that many weights.
double conv_flops(const Graph& g, const Node& n) {
  if (n.inputs.size() < 2 || input_shape(g, n, 1).empty()) return 0;
  const Shape& w = input_shape(g, n, 1);
  return 2 * output_elements(g, n) * static_cast<double>(numel(w) / std::max<int64_t>(1, w[0]));
}

// ---- ConvTranspose(X, W, B?)
// ------------------------------------------------------------------------
// The transpose of the Conv (same window attributes, weight [C_in, C_out / group, k...]) that maps
// Y's shape to X's: Y = that Conv's dX with dY := X, plus the bias. ONNX's output size per spatial
// dim: stride * (in - 1) + output_padding + dilation * (k - 1) + 1 - pad_begin - pad_end.
Shape conv_transpose_out(const ConvAttrs& a, const Shape& x, const Shape& wt,
                         const std::function<void(const std::string&)>& err,
                         const std::function<void(const std::string&)>& unsupported) {
  if (wt.size() != x.size()) err("X and W differ in rank");
  if (x.size() < 3) err("X has rank " + std::to_string(x.size()) + "; needs (N, C, spatial...)");
  const size_t nd = x.size() - 2;
  const int64_t g = a.group;
  if (a.auto_pad != AutoPad::NotSet && a.auto_pad != AutoPad::Valid)
    unsupported("auto_pad '" + a.auto_pad_name +
                "' is not supported for ConvTranspose (give pads)");
  if (a.output_shape)
    unsupported("the output_shape attribute is not supported (give pads and output_padding)");
  const auto k = window_ints(a.kernel_shape, "kernel_shape", 0, nd, err),
             stride = window_ints(a.strides, "strides", 1, nd, err),
             dil = window_ints(a.dilations, "dilations", 1, nd, err),
             opad = window_ints(a.output_padding, "output_padding", 0, nd, err);
  auto pads = window_ints(a.pads, "pads", 0, 2 * nd, err);
  if (a.auto_pad == AutoPad::Valid) pads.assign(2 * nd, 0);
  if (g < 1 || x[1] != wt[0] || wt[0] % g)
    err("channels " + std::to_string(x[1]) + ", weight " + shape_str(wt) + " and group " +
        std::to_string(g) + " do not fit (W is [C_in, C_out / group, k...])");
  Shape out{x[0], wt[1] * g};
  for (size_t i = 0; i < nd; ++i) {
    if (a.kernel_shape && k[i] != wt[2 + i]) err("kernel_shape differs from W's");
    if (stride[i] < 1 || dil[i] < 1 || pads[i] < 0 || pads[nd + i] < 0 || opad[i] < 0)
      err("strides and dilations must be >= 1, pads and output_padding >= 0");
    if (opad[i] >= stride[i]) err("output_padding must be smaller than the stride");
    const int64_t o = stride[i] * (x[2 + i] - 1) + opad[i] + dil[i] * (wt[2 + i] - 1) + 1 -
                      pads[i] - pads[nd + i];
    if (o < 1) err("the output would be empty (pads too large)");
    out.push_back(o);
  }
  return out;
}
void infer_conv_transpose(InferCtx& c) {
  require_float(c, 0);
  if (c.dtype(1) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "W differs in dtype from X");
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  auto unsupported = [&](const std::string& m) { c.error(ErrorKind::Unsupported, m); };
  const Shape &x = c.shape(0), &wt = c.shape(1);
  const Shape y = conv_transpose_out(conv_attrs(c.node()), x, wt, err, unsupported);
  if (c.has_in(2)) c.check(c.shape(2) == Shape{y[1]}, "B must have shape [C_out]");
  c.set_out(0, c.dtype(0), y);
}
void conv_transpose_kernel(KernelCtx& c) {
  const Tensor &x = c.in(0), &wt = c.in(1);
  Tensor& y = c.out(0);
  const Tensor y_shape = Tensor::external(nullptr, y.shape(), y.dtype(), nullptr);
  conv_backward(c, x, y_shape, wt, &y, nullptr, nullptr);
  if (!c.has_in(2)) return;
  dispatch_float(y.dtype(), c, [&]<class T>() {
    const int64_t N = y.dim(0), C = y.dim(1), S = y.numel() / std::max<int64_t>(1, N * C);
    const T* b = c.in(2).data<T>();
    T* py = y.data<T>();
    parallel_for(N * C, y.numel(), [&](int, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T v = b[r % C];
        for (int64_t i = 0; i < S; ++i) py[r * S + i] += v;
      }
    });
  });
}
// Y = C^T(X, W) with C the Conv from Y's shape to X's: <dY, C^T(X)> = <C(dY), X>, so
// dX = C(dY), a Conv with the same window; dW = C's weight gradient with C's input dY and its
// output gradient X (ConvGrad(X, dY, W), output 1); dB = dY summed over images and positions.
void grad_conv_transpose(GradBuilder& g) {
  const Node& n = g.node();
  Attrs a;  // the Conv's window: the node's attributes but output_padding (shape only)
  for (const auto& [k, v] : n.attrs.all())
    if (k != "output_padding") a.set(k, v);
  if (g.needs(0)) g.set_dx(0, g.emit1("Conv", {g.dy(0), g.x(1)}, a));
  if (g.needs(1)) {
    auto outs = g.emit("ConvGrad", {g.x(0), g.dy(0), g.x(1)}, a, 3, "graft");
    g.drop_output(outs[0]);
    g.drop_output(outs[2]);
    g.set_dx(1, outs[1]);
  }
  if (n.inputs.size() > 2 && n.inputs[2] >= 0 && g.needs(2)) {
    std::vector<int64_t> axes{0};
    for (size_t i = 2; i < g.shape(g.x(0)).size(); ++i) axes.push_back(static_cast<int64_t>(i));
    Attrs r;
    r.set_int("keepdims", 0);
    g.set_dx(2, g.emit1("ReduceSum", {g.dy(0), g.ints(axes)}, r));
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
// MaxPool over one 2-D plane without the generic tap walker: per output, the window clipped to
// the image once, taps visited in the same order (rows, then columns) with the same rule (first
// tap taken, then a larger value or a NaN, which then stays), so y and arg equal pool_plane's.
template <class T, class Idx>
void max_plane_2d(const Window& w, const T* x, T* y, Idx* arg) {
  const int64_t H = w.in[0], W = w.in[1], OH = w.out[0], OW = w.out[1];
  const int64_t sh = w.stride[0], sw = w.stride[1], dh = w.dil[0], dw = w.dil[1];
  auto range = [](int64_t start, int64_t k, int64_t d, int64_t n, int64_t& lo, int64_t& hi) {
    lo = start >= 0 ? 0 : (-start + d - 1) / d;                              // first tap inside
    hi = std::min<int64_t>(k, n - start > 0 ? (n - start + d - 1) / d : 0);  // one past the last
  };
  for (int64_t oh = 0; oh < OH; ++oh) {
    const int64_t h0 = oh * sh - w.pad_begin[0];
    int64_t kh0, kh1;
    range(h0, w.k[0], dh, H, kh0, kh1);
    for (int64_t ow = 0; ow < OW; ++ow) {
      const int64_t w0 = ow * sw - w.pad_begin[1];
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
    }
  }
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
    {.name = "Conv",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_conv,
     .prepare = prepare_conv,
     .kernel = conv_kernel,
     .grad = grad_conv,
     .flops = conv_flops},
    {.name = "ConvTranspose",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_conv_transpose,
     .prepare = prepare_conv,
     .kernel = conv_transpose_kernel,
     .grad = grad_conv_transpose},
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
    {.name = "ConvGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_conv_grad,
     .prepare = prepare_conv,
     .kernel = conv_grad_kernel},
    {.name = "PoolGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_pool_grad,
     .prepare = prepare_conv,
     .kernel = pool_grad_kernel},
};

}  // namespace

void register_conv_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
