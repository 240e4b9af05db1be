// Conv (1-D, 2-D, 3-D; groups, depthwise, strides, pads, dilations) and graft's ConvGrad, its
// backward (dX, dW, dB). ConvTranspose is in conv_transpose.cpp, the pools in pool.cpp; what they
// share (attributes, window geometry) in conv.h.
//
// Conv is im2col + GEMM (the one GEMM entry point, opsutil::gemm_ld): per image (or a few images
// side by side when an image has few outputs) and group,
//   col[(c, k), o] = x[c, o * stride + k * dilation - pad]   (0 outside)     // (C/g * K, O)
//   y[m, o] = W[m, (c, k)] @ col                                               // (M/g, O)
// and its gradient dW += dy @ col^T, dcol = W^T @ dy then col2im (scatter-add) into dx. Dense
// float32 convolutions run on oneDNN (conv_dnnl.cpp), depthwise ones on the direct kernels below.
#include "conv.h"

#include <cmath>
#include <type_traits>

#include "conv_dnnl.h"

namespace graft {
namespace {
using namespace opsutil;

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
  const DType dt = float_or_bf16(c, 0);  // Note [bf16 activations]
  if (c.dtype(1) != dt) c.error(ErrorKind::InvalidModel, "W differs in dtype from X");
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
  c.set_out(0, dt, out);
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

void conv_forward(KernelCtx& c, const Tensor& x, Tensor& yt) {
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const Tensor& wt = c.in(1);
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    const ConvAttrs& a = c.attrs<ConvAttrs>();
    Window w = conv_window(a, x.shape(), wt.shape(), err);
    const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), g = a.group;
    const int64_t Cg = C / g, Mg = M / g, K = w.k_size(), O = w.out_size(), I = w.in_size();
    const T *px = x.data<T>(), *pw = wt.data<T>();
    const T* b = c.has_in(2) ? c.in(2).data<T>() : nullptr;
    T* y = yt.data<T>();
    // Conv's channel-blocked operands (Note [channel-blocked values]): X, Y. Only ever given to a
    // float32 convolution oneDNN runs.
    if (a.blocked && !(std::is_same_v<T, float> && dnnl_conv_enabled()))
      c.error(ErrorKind::Internal, "a channel-blocked operand has no oneDNN convolution");
    Plane2 p;
    if constexpr (std::is_same_v<T, float>) {
      if (!a.blocked && depthwise_plane(w, Cg, p) && Mg == 1 && narrow_planes(p)) {
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
    if (!a.blocked && depthwise_plane(w, Cg, p)) {
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
      ConvShape cs = conv_shape(w, N, C, M, g);
      cs.x_blocked = a.blocked & 1u, cs.y_blocked = a.blocked & (1u << 16);
      const auto d = dnnl_conv(cs, ConvPass::Forward, bf16_gemm_active(), b != nullptr);
      if (a.blocked && !d)
        c.error(ErrorKind::Internal, "a channel-blocked operand has no oneDNN convolution");
      if (d) {
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

// Note [bf16 activations]: whether a convolution of C input channels runs on oneDNN when it can
// (channel-blocked, or not one of graft's direct depthwise kernels), and a bfloat16 X as float32
// scratch for one that cannot.
bool on_dnnl(const ConvAttrs& a, const Window& w, int64_t C) {
  Plane2 p;
  return a.blocked || !depthwise_plane(w, C / a.group, p);
}
Tensor widened(const Tensor& x, Allocator& alloc) {
  Tensor wide = Tensor::empty(x.shape(), DType::F32, alloc, Category::Workspace, "widened X");
  widen_bf16(x.data<uint16_t>(), x.numel(), wide.data<float>());
  return wide;
}

// Note [bf16 activations]: X stored in bfloat16 by the plan (only in a bf16 step). oneDNN's bf16
// convolution reads it as it is; one that does not run there gets the widened copy (the same
// values, which its bf16 products round to themselves). Note [bf16 writers]: a bfloat16 Y
// (kBf16OutAttr) is oneDNN's bf16 destination, its accumulators rounded to nearest even as they
// are stored (RoundToBf16's rounding); elsewhere the float32 result, rounded after.
void conv_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  const bool y16 = y.dtype() == DType::BF16;
  if (x.dtype() != DType::BF16 && !y16) return conv_forward(c, x, y);
  const Tensor& wt = c.in(1);
  auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
  const ConvAttrs& a = c.attrs<ConvAttrs>();
  Window w = conv_window(a, x.shape(), wt.shape(), err);
  if (on_dnnl(a, w, x.dim(1)) && (x.dtype() == DType::BF16 || x.dtype() == DType::F32)) {
    ConvShape cs = conv_shape(w, x.dim(0), x.dim(1), wt.dim(0), a.group);
    cs.x_blocked = a.blocked & 1u, cs.y_blocked = a.blocked & (1u << 16);
    cs.x_bf16 = x.dtype() == DType::BF16, cs.y_bf16 = y16;
    const float* b = c.has_in(2) ? c.in(2).data<float>() : nullptr;
    if (const auto d = dnnl_conv(cs, ConvPass::Forward, true, b != nullptr)) {
      Tensor scratch = dnnl_scratch(dnnl_conv_scratch(*d), c.alloc);
      dnnl_conv_forward(*d, x.raw(), wt.data<float>(), b, y.raw(), scratch.data<float>());
      return;
    }
  }
  const Tensor xf = x.dtype() == DType::BF16 ? widened(x, c.alloc) : x;
  if (!y16) return conv_forward(c, xf, y);
  Tensor yf = Tensor::empty(y.shape(), DType::F32, c.alloc, Category::Workspace, "float32 Y");
  conv_forward(c, xf, yf);
  round_to_bf16(yf.data<float>(), yf.numel(), y.data<uint16_t>());
}

// ConvGrad(dY, X, W) -> dX, dW, dB (same attributes as the Conv).
void infer_conv_grad(InferCtx& c) {
  c.set_out(0, float_or_bf16(c, 1), c.shape(1));
  c.set_out(1, c.dtype(2), c.shape(2));
  c.set_out(2, c.dtype(2), {c.shape(2)[0]});
}

// ConvGrad through oneDNN (Note [oneDNN convolutions]): false when it has no primitive for a pass
// wanted. dW and dB are overwritten. X may be float32 or (Note [bf16 activations], read by dW
// only) bfloat16, which the bf16 weight-gradient pass reads as it is; so may dY (Note [bf16
// gradient operands], read by the two products only: not with a bias gradient).
bool dnnl_conv_grad(KernelCtx& c, const Window& w, const Tensor& dy, const Tensor& x,
                    const Tensor& wt, float* dx, float* dw, float* db) {
  const ConvAttrs& a = c.attrs<ConvAttrs>();
  const int64_t N = x.dim(0), C = x.dim(1), M = wt.dim(0), O = w.out_size();
  const bool dy_blk = a.blocked & 1u, x_blk = a.blocked & 2u, dx_blk = a.blocked & (1u << 16);
  const bool x16 = x.dtype() == DType::BF16, dy16 = dy.dtype() == DType::BF16;
  if (dy16 && db) return false;
  const void* pdy = dy.raw();
  const float* pw = wt.data<float>();
  ConvShape cs = conv_shape(w, N, C, M, a.group);
  cs.y_blocked = dy_blk;
  cs.y_bf16 = dy16;
  const bool bf16 = bf16_gemm_active() || x16 || dy16;
  cs.x_blocked = dx_blk;
  const auto dgrad = dx ? dnnl_conv(cs, ConvPass::BackwardData, bf16, false) : nullptr;
  cs.x_blocked = x_blk;
  cs.x_bf16 = x16;
  const auto wgrad = dw ? dnnl_conv(cs, ConvPass::BackwardWeights, bf16, db != nullptr) : nullptr;
  if ((dx && !dgrad) || (dw && !wgrad)) return false;
  Tensor scratch = dnnl_scratch(
      std::max(dgrad ? dnnl_conv_scratch(*dgrad) : 0, wgrad ? dnnl_conv_scratch(*wgrad) : 0),
      c.alloc);
  if (dgrad) dnnl_conv_backward_data(*dgrad, pdy, pw, dx, scratch.data<float>());
  if (wgrad) dnnl_conv_backward_weights(*wgrad, pdy, x.raw(), dw, db, scratch.data<float>());
  if (db && !dw && dy_blk) {  // the same over dY as [N, M/16, O, 16]: to [1, M/16, 1, 16]
    sum_to_shape(dy.data<float>(), Shape{N, M / 16, O, 16}, db, Shape{1, M / 16, 1, 16}, false);
  } else if (db && !dw) {  // a frozen weight's bias: dB = dY summed over images, positions
    Shape per_channel(dy.shape().size(), 1);
    per_channel[1] = M;
    sum_to_shape(dy.data<float>(), dy.shape(), db, per_channel, false);
  }
  return true;
}
}  // namespace

// The backward of the Conv of the node's window (conv.h).
void opsutil::conv_backward(KernelCtx& c, const Tensor& dy, const Tensor& x, const Tensor& wt,
                            Tensor* dxt, Tensor* dwt, Tensor* dbt) {
  if (dy.dtype() == DType::BF16 || x.dtype() == DType::BF16) {
    // Stored in bfloat16 by the plan: X (Note [bf16 activations]; ConvGrad only, read by dW only)
    // and dY (Note [bf16 gradient operands], rounded once for both products). oneDNN's bf16
    // passes read them as they are; a convolution that does not run there gets widened copies
    // (the same values, which its bf16 products round to themselves).
    auto err = [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); };
    const ConvAttrs& a = c.attrs<ConvAttrs>();
    Window w = conv_window(a, x.shape(), wt.shape(), err);
    float* dx = dxt ? dxt->data<float>() : nullptr;
    float* dw = dwt ? dwt->data<float>() : nullptr;
    float* db = dbt ? dbt->data<float>() : nullptr;
    if (on_dnnl(a, w, x.dim(1)) && (dy.dtype() == DType::F32 || dy.dtype() == DType::BF16) &&
        dnnl_conv_grad(c, w, dy, x, wt, dx, dw, db))
      return;
    if (dy.dtype() == DType::BF16)
      return conv_backward(c, widened(dy, c.alloc), x, wt, dxt, dwt, dbt);
    return conv_backward(c, dy, widened(x, c.alloc), wt, dxt, dwt, dbt);
  }
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
    // ConvGrad's channel-blocked operands (Note [channel-blocked values]): dY, X, dX. Only ever
    // given to a float32 convolution oneDNN runs (dnnl_conv_grad).
    if (a.blocked && !(std::is_same_v<T, float> && dnnl_conv_enabled()))
      c.error(ErrorKind::Internal, "a channel-blocked operand has no oneDNN convolution");
    Plane2 p;
    if constexpr (std::is_same_v<T, float>) {
      if (!a.blocked && depthwise_plane(w, Cg, p) && Mg == 1 && narrow_planes(p) &&
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
    if (!a.blocked && depthwise_plane(w, Cg, p)) {
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
      if (dnnl_conv_grad(c, w, dy, x, wt, dx, dw, db)) return;
      if (a.blocked)
        c.error(ErrorKind::Internal, "a channel-blocked operand has no oneDNN convolution");
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

namespace {
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

// Note [channel-blocked values]: oneDNN's convolutions read and write x and y (ConvGrad: dY, X and
// dX) channel-blocked; only a float32 convolution with more than one channel per group runs
// there (depthwise ones keep graft's direct kernels, float64 im2col), on a CPU whose oneDNN
// kernels use 16-channel blocks (dnnl_conv_blocked_ok).
bool runs_on_dnnl(const Graph& g, const Node& n, int x_input) {
  if (n.inputs.size() <= static_cast<size_t>(x_input) || n.inputs[x_input] < 0) return false;
  const Value& x = g.values[n.inputs[x_input]];
  const int64_t group = n.attrs.get_int("group", 1, n.label());
  return dnnl_conv_blocked_ok() && (x.dtype == DType::F32 || x.dtype == DType::BF16) &&
         x.shape.size() >= 3 && x.shape.size() <= 5 && group >= 1 && x.shape[1] % group == 0 &&
         x.shape[1] / group > 1;
}
BlockedUse blocked_conv(const Graph& g, const Node& n) {
  return runs_on_dnnl(g, n, 0) ? BlockedUse{1u, 1u, false} : BlockedUse{};
}
BlockedUse blocked_conv_grad(const Graph& g, const Node& n) {
  return runs_on_dnnl(g, n, 1) ? BlockedUse{3u, 1u, false} : BlockedUse{};
}

// 2 * out * (C / group * kernel): each output element is a multiply-add over that many weights.
double conv_flops(const Graph& g, const Node& n) {
  if (n.inputs.size() < 2 || input_shape(g, n, 1).empty()) return 0;
  const Shape& w = input_shape(g, n, 1);
  return 2 * output_elements(g, n) * static_cast<double>(numel(w) / std::max<int64_t>(1, w[0]));
}

const OpDef kOps[] = {
    {.name = "Conv",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_conv,
     .prepare = prepare_conv,
     .kernel = conv_kernel,
     .grad = grad_conv,
     .flops = conv_flops,
     .blocked = blocked_conv,
     .bf16_out = true},
    {.name = "ConvGrad",
     .domain = "graft",
     .min_in = 3,
     .max_in = 3,
     .max_out = 3,
     .infer = infer_conv_grad,
     .prepare = prepare_conv,
     .kernel = conv_grad_kernel,
     .blocked = blocked_conv_grad},
};

}  // namespace

bool convolutions_take_blocked_layouts() { return opsutil::dnnl_conv_blocked_ok(); }

void register_conv_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
