// Recurrent ops: LSTM and GRU (ONNX opset 14 semantics: directions forward, reverse and
// bidirectional; layout 0 and 1; sequence_lens; initial states), and graft's LSTMGrad / GRUGrad.
//
// The forward is one GEMM for the input projection of every time step (X @ W^T), then one small
// GEMM per step for the recurrence (h @ R^T) and the elementwise cell. It keeps nothing for the
// backward beyond its output Y: since Y holds every step's hidden state, the backward rebuilds the
// previous-state matrix H_prev from Y and the initial state, recomputes every step's gates with
// two large GEMMs (X @ W^T + H_prev @ R^T), replays the cell-state recurrence elementwise, and
// then runs back through time with one small GEMM per step (dgates @ R). The weight gradients are
// three large GEMMs over all steps (dgates^T @ X, dgates^T @ H_prev, and dgates @ W for dX).
// PyTorch's CPU LSTM instead saves every step's gates; graft saves less and pays two GEMMs.
//
// Kernels work in time-major order ([T, B, ...] inputs, [T, D, B, H] outputs); layout 1 is
// transposed into and out of workspace buffers. Steps at or past a batch row's sequence length
// leave that row's state unchanged and write zeros to Y, as ONNX specifies.
//
// Supported: the default activations (LSTM: sigmoid, tanh, tanh; GRU: sigmoid, tanh), no clip,
// input_forget = 0, no peepholes; GRU with linear_before_reset 0 or 1 (PyTorch exports 1).
#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

enum class Cell { Lstm, Gru };
int n_gates(Cell k) { return k == Cell::Lstm ? 4 : 3; }

// The attributes of LSTM, GRU and their gradients (LSTMGrad and GRUGrad carry the forward's).
enum class Dir { Forward, Reverse, Bidirectional, Other };
struct RnnAttrs {
  Dir dir = Dir::Forward;
  std::string direction = "forward";  // as given (for the error on an unknown one)
  int64_t hidden_size = -1;
  int layout = 0;
  bool linear_before_reset = false;  // GRU
  bool has_activations = false, has_clip = false;
  int64_t input_forget = 0;
  // Does direction d run back in time?
  bool reverse(int64_t d) const {
    return dir == Dir::Reverse || (dir == Dir::Bidirectional && d == 1);
  }
};
RnnAttrs rnn_attrs(const Node& n) {
  const std::string where = n.label();
  RnnAttrs a;
  a.direction = n.attrs.get_string("direction", "forward", where);
  a.dir = a.direction == "forward"         ? Dir::Forward
          : a.direction == "reverse"       ? Dir::Reverse
          : a.direction == "bidirectional" ? Dir::Bidirectional
                                           : Dir::Other;
  a.hidden_size = n.attrs.get_int("hidden_size", -1, where);
  a.layout = static_cast<int>(n.attrs.get_int("layout", 0, where));
  a.linear_before_reset = n.attrs.get_int("linear_before_reset", 0, where) != 0;
  a.has_activations = n.attrs.has("activations");
  a.has_clip = n.attrs.has("clip");
  a.input_forget = n.attrs.get_int("input_forget", 0, where);
  return a;
}
std::shared_ptr<const void> prepare_rnn(const Node& n) { return prepared(rnn_attrs(n)); }

// The dimensions of one LSTM / GRU node.
struct Dims {
  int64_t T = 0, B = 0, I = 0, H = 0, D = 1;
  int layout = 0;
};

Dims dims_of(const Shape& x, const Shape& w, int64_t H, int layout) {
  Dims m;
  m.layout = layout;
  m.T = x[layout == 0 ? 0 : 1];
  m.B = x[layout == 0 ? 1 : 0];
  m.I = x[2];
  m.D = w[0];
  m.H = H;
  return m;
}

Shape state_shape(const Dims& m) {
  return m.layout == 0 ? Shape{m.D, m.B, m.H} : Shape{m.B, m.D, m.H};
}
Shape y_shape(const Dims& m) {
  return m.layout == 0 ? Shape{m.T, m.D, m.B, m.H} : Shape{m.B, m.T, m.D, m.H};
}

// Checks the node's attributes and inputs; returns its dimensions. Inputs: X, W, R, B,
// sequence_lens, initial_h (and LSTM: initial_c, P).
Dims infer_rnn(InferCtx& c, Cell kind) {
  require_float(c, 0);
  const RnnAttrs a = rnn_attrs(c.node());
  if (a.dir == Dir::Other)
    c.error(ErrorKind::InvalidModel, "direction '" + a.direction +
                                         "' is not one of forward, reverse, "
                                         "bidirectional");
  if (a.has_activations)
    c.error(ErrorKind::Unsupported, "custom activations are not supported (only the defaults)");
  if (a.has_clip) c.error(ErrorKind::Unsupported, "the clip attribute is not supported");
  if (a.input_forget != 0) c.error(ErrorKind::Unsupported, "input_forget = 1 is not supported");
  if (kind == Cell::Lstm && c.has_in(7))
    c.error(ErrorKind::Unsupported, "peephole weights (input P) are not supported");
  if (kind == Cell::Lstm && a.linear_before_reset)
    c.error(ErrorKind::InvalidModel, "linear_before_reset is a GRU attribute");
  const int layout = a.layout;
  if (layout != 0 && layout != 1) c.error(ErrorKind::InvalidModel, "layout must be 0 or 1");
  const int64_t H = a.hidden_size;
  const Shape &x = c.shape(0), &w = c.shape(1), &r = c.shape(2);
  c.check(x.size() == 3, "X must be 3-D, got " + shape_str(x));
  const int64_t G = n_gates(kind), D = a.dir == Dir::Bidirectional ? 2 : 1;
  c.check(H > 0, "hidden_size must be given and positive");
  for (int i = 1; i <= 2; ++i)
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::Unsupported, "mixed dtypes are not supported");
  c.check(w == Shape{D, G * H, x[2]},
          "W must be " + shape_str({D, G * H, x[2]}) + ", got " + shape_str(w));
  c.check(r == Shape{D, G * H, H},
          "R must be " + shape_str({D, G * H, H}) + ", got " + shape_str(r));
  Dims m = dims_of(x, w, H, layout);
  if (c.has_in(3)) {
    c.check(c.shape(3) == Shape{D, 2 * G * H}, "B must be " + shape_str({D, 2 * G * H}));
    if (c.dtype(3) != c.dtype(0)) c.error(ErrorKind::Unsupported, "mixed dtypes are not supported");
  }
  if (c.has_in(4)) {
    c.check(is_int(c.dtype(4)), "sequence_lens must be an integer tensor");
    c.check(c.shape(4) == Shape{m.B}, "sequence_lens must be [batch_size]");
  }
  const int n_states = kind == Cell::Lstm ? 2 : 1;
  for (int i = 5; i < 5 + n_states; ++i)
    if (c.has_in(i)) {
      c.check(c.shape(i) == state_shape(m), std::string(i == 5 ? "initial_h" : "initial_c") +
                                                " must be " + shape_str(state_shape(m)));
      if (c.dtype(i) != c.dtype(0))
        c.error(ErrorKind::Unsupported, "mixed dtypes are not supported");
    }
  return m;
}

void infer_lstm(InferCtx& c) {
  Dims m = infer_rnn(c, Cell::Lstm);
  c.set_out(0, c.dtype(0), y_shape(m));
  c.set_out(1, c.dtype(0), state_shape(m));
  c.set_out(2, c.dtype(0), state_shape(m));
}
void infer_gru(InferCtx& c) {
  Dims m = infer_rnn(c, Cell::Gru);
  c.set_out(0, c.dtype(0), y_shape(m));
  c.set_out(1, c.dtype(0), state_shape(m));
}

// [A, Bn, inner] -> [Bn, A, inner] (and back, with the roles swapped): layout 1 <-> time-major.
template <class T>
void swap01(const T* src, T* dst, int64_t A, int64_t Bn, int64_t inner) {
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < Bn; ++b)
      std::copy(src + (a * Bn + b) * inner, src + (a * Bn + b + 1) * inner,
                dst + (b * A + a) * inner);
}

// dst[0, n) = src[0, n), or zeros when src is absent (an optional initial state or gradient).
template <class T>
void copy_or_zero(const T* src, int64_t n, T* dst) {
  if (src)
    std::copy_n(src, n, dst);
  else
    std::fill_n(dst, n, T(0));
}
// Writes a time-major [a, b, inner] buffer to `out` in the node's layout (layout 1: [b, a, inner]).
template <class T>
void store_layout(const T* src, Tensor* out, int layout, int64_t a, int64_t b, int64_t inner) {
  if (!out) return;
  if (layout == 0)
    std::copy_n(src, a * b * inner, out->data<T>());
  else
    swap01(src, out->data<T>(), a, b, inner);
}

// A tensor in time-major order: the input itself (layout 0), or a transposed workspace copy.
// `a` and `b` are the leading dims as stored for layout 1 ([a, b, inner] -> [b, a, inner]).
template <class T>
struct TimeMajor {
  Tensor buf;
  T* p = nullptr;
  TimeMajor(const Tensor* t, int layout, int64_t a, int64_t b, int64_t inner, Allocator& al,
            bool copy_in = true) {
    if (!t) return;
    if (layout == 0) {
      p = const_cast<T*>(t->data<T>());
      return;
    }
    buf = Tensor::empty({b, a, inner}, t->dtype(), al, Category::Workspace, "rnn_time_major");
    p = buf.data<T>();
    if (copy_in) swap01(t->data<T>(), p, a, b, inner);
  }
  // Writes a workspace copy back to the layout-1 tensor `t`.
  void store(Tensor* t, int layout, int64_t a, int64_t b, int64_t inner) const {
    if (t && layout == 1) swap01(p, t->data<T>(), b, a, inner);
  }
};

std::vector<int64_t> seq_lens(const KernelCtx& c, const Dims& m) {
  std::vector<int64_t> len(m.B, m.T);
  if (!c.has_in(4)) return len;
  const Tensor& s = c.in(4);
  for (int64_t b = 0; b < m.B; ++b) {
    len[b] = s.dtype() == DType::I32 ? s.data<int32_t>()[b] : s.data<int64_t>()[b];
    if (len[b] < 0 || len[b] > m.T)
      c.error(ErrorKind::InvalidArgument, "sequence_lens[" + std::to_string(b) +
                                              "] = " + std::to_string(len[b]) + " is outside [0, " +
                                              std::to_string(m.T) + "]");
  }
  return len;
}

template <class T>
T sigm(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Rebuilds the state each step of direction d started from: H_prev[t, b] = Y[t -+ 1, d, b], or
// the initial state (zeros when absent) at the direction's first step of row b.
template <class T>
void prev_states(const T* y, const T* h0, const Dims& m, int64_t d, bool rev,
                 const std::vector<int64_t>& len, T* hp) {
  for (int64_t t = 0; t < m.T; ++t)
    for (int64_t b = 0; b < m.B; ++b) {
      const int64_t tp = rev ? t + 1 : t - 1;
      T* dst = hp + (t * m.B + b) * m.H;
      if (tp >= 0 && tp < len[b])
        std::copy_n(y + ((tp * m.D + d) * m.B + b) * m.H, m.H, dst);
      else
        copy_or_zero(h0 ? h0 + (d * m.B + b) * m.H : nullptr, m.H, dst);
    }
}

// Adds a bias row of length n to every one of `rows` rows of width n.
template <class T>
void add_rows(T* a, int64_t rows, int64_t n, const T* bias) {
  if (!bias) return;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) a[i * n + j] += bias[j];
}
template <class T>
void col_sums(const T* a, int64_t rows, int64_t n, T* out) {
  std::fill_n(out, n, T(0));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n; ++j) out[j] += a[i * n + j];
}

Dims kernel_dims(const KernelCtx& c) {
  const RnnAttrs& a = c.attrs<RnnAttrs>();
  return dims_of(c.in(0).shape(), c.in(1).shape(), a.hidden_size, a.layout);
}
const Tensor* opt_in(const KernelCtx& c, int i) { return c.has_in(i) ? &c.in(i) : nullptr; }
Tensor* opt_out(const KernelCtx& c, int i) { return c.has_out(i) ? &c.out(i) : nullptr; }

// ---- LSTM (gate order i, o, f, c)
// i = s(x Wi + h Ri + bi), o = s(...), f = s(...), g = tanh(...); c' = f c + i g; h' = o tanh(c')
void lstm_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Dims m = kernel_dims(c);
    const RnnAttrs& ra = c.attrs<RnnAttrs>();
    const int64_t T_ = m.T, B = m.B, H = m.H, G = 4 * H;
    const auto len = seq_lens(c, m);
    TimeMajor<T> x(&c.in(0), m.layout, B, T_, m.I, c.alloc);
    TimeMajor<T> h0(opt_in(c, 5), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> c0(opt_in(c, 6), m.layout, B, m.D, H, c.alloc);
    Tensor ybuf =
        Tensor::empty({T_, m.D, B, H}, c.in(0).dtype(), c.alloc, Category::Workspace, "rnn_y");
    T* y = ybuf.data<T>();
    Tensor xw = Tensor::empty({T_ * B, G}, c.in(0).dtype(), c.alloc, Category::Workspace, "rnn_xw");
    Tensor hr = Tensor::empty({B, G}, c.in(0).dtype(), c.alloc, Category::Workspace, "rnn_hr");
    Tensor hb = Tensor::empty({m.D, B, H}, c.in(0).dtype(), c.alloc, Category::Workspace, "h");
    Tensor cb = Tensor::empty({m.D, B, H}, c.in(0).dtype(), c.alloc, Category::Workspace, "c");
    for (int64_t d = 0; d < m.D; ++d) {
      const bool rev = ra.reverse(d);
      const T* W = c.in(1).data<T>() + d * G * m.I;
      const T* R = c.in(2).data<T>() + d * G * H;
      const T* bw = c.has_in(3) ? c.in(3).data<T>() + d * 2 * G : nullptr;
      T *h = hb.data<T>() + d * B * H, *cs = cb.data<T>() + d * B * H;
      copy_or_zero(h0.p ? h0.p + d * B * H : nullptr, B * H, h);
      copy_or_zero(c0.p ? c0.p + d * B * H : nullptr, B * H, cs);
      gemm<T>(false, true, T_ * B, G, m.I, T(1), x.p, W, T(0), xw.data<T>());
      if (bw) {
        add_rows(xw.data<T>(), T_ * B, G, bw);
        add_rows(xw.data<T>(), T_ * B, G, bw + G);
      }
      for (int64_t s = 0; s < T_; ++s) {
        const int64_t t = rev ? T_ - 1 - s : s;
        gemm<T>(false, true, B, G, H, T(1), h, R, T(0), hr.data<T>());
        for (int64_t b = 0; b < B; ++b) {
          T* yr = y + ((t * m.D + d) * B + b) * H;
          if (t >= len[b]) {
            std::fill_n(yr, H, T(0));
            continue;
          }
          const T* a0 = xw.data<T>() + (t * B + b) * G;
          const T* a1 = hr.data<T>() + b * G;
          for (int64_t j = 0; j < H; ++j) {
            const T i = sigm(a0[j] + a1[j]), o = sigm(a0[H + j] + a1[H + j]);
            const T f = sigm(a0[2 * H + j] + a1[2 * H + j]);
            const T g = std::tanh(a0[3 * H + j] + a1[3 * H + j]);
            T& cc = cs[b * H + j];
            cc = f * cc + i * g;
            h[b * H + j] = yr[j] = o * std::tanh(cc);
          }
        }
      }
    }
    store_layout(y, opt_out(c, 0), m.layout, T_ * m.D, B, H);
    store_layout(hb.data<T>(), opt_out(c, 1), m.layout, m.D, B, H);
    store_layout(cb.data<T>(), opt_out(c, 2), m.layout, m.D, B, H);
  });
}

// LSTMGrad(X, W, R, B, sequence_lens, initial_h, initial_c, Y, dY, dY_h, dY_c)
//   -> dX, dW, dR, dB, dinitial_h, dinitial_c   (the LSTM's attributes)
void infer_lstm_grad(InferCtx& c) {
  const RnnAttrs a = rnn_attrs(c.node());
  Dims m = dims_of(c.shape(0), c.shape(1), a.hidden_size, a.layout);
  const DType dt = c.dtype(0);
  c.set_out(0, dt, c.shape(0));
  c.set_out(1, dt, c.shape(1));
  c.set_out(2, dt, c.shape(2));
  c.set_out(3, dt, {m.D, 8 * m.H});
  c.set_out(4, dt, state_shape(m));
  c.set_out(5, dt, state_shape(m));
}

void lstm_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Dims m = kernel_dims(c);
    const RnnAttrs& ra = c.attrs<RnnAttrs>();
    const int64_t T_ = m.T, B = m.B, H = m.H, G = 4 * H, TB = m.T * m.B;
    const DType dt = c.in(0).dtype();
    const auto len = seq_lens(c, m);
    auto ws = [&](Shape s, const char* name) {
      return Tensor::empty(std::move(s), dt, c.alloc, Category::Workspace, name);
    };
    TimeMajor<T> x(&c.in(0), m.layout, B, T_, m.I, c.alloc);
    TimeMajor<T> h0(opt_in(c, 5), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> c0(opt_in(c, 6), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> y(&c.in(7), m.layout, B, T_ * m.D, H, c.alloc);
    TimeMajor<T> dy(opt_in(c, 8), m.layout, B, T_ * m.D, H, c.alloc);
    TimeMajor<T> dyh(opt_in(c, 9), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> dyc(opt_in(c, 10), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> dx(opt_out(c, 0), m.layout, B, T_, m.I, c.alloc, false);
    TimeMajor<T> dh0(opt_out(c, 4), m.layout, B, m.D, H, c.alloc, false);
    TimeMajor<T> dc0(opt_out(c, 5), m.layout, B, m.D, H, c.alloc, false);
    Tensor hp = ws({TB, H}, "rnn_hprev"), a = ws({TB, G}, "rnn_gates"), cs = ws({TB, H}, "rnn_c");
    Tensor da = ws({TB, G}, "rnn_dgates"), dh = ws({B, H}, "dh"), dc = ws({B, H}, "dc");
    Tensor dhn = ws({B, H}, "dh_next");
    for (int64_t d = 0; d < m.D; ++d) {
      const bool rev = ra.reverse(d);
      const T* W = c.in(1).data<T>() + d * G * m.I;
      const T* R = c.in(2).data<T>() + d * G * H;
      const T* bw = c.has_in(3) ? c.in(3).data<T>() + d * 2 * G : nullptr;
      const T* c0d = c0.p ? c0.p + d * B * H : nullptr;
      prev_states(y.p, h0.p, m, d, rev, len, hp.data<T>());
      // Gates: X W^T + H_prev R^T + biases, then the activations, in place.
      T* A = a.data<T>();
      gemm<T>(false, true, TB, G, m.I, T(1), x.p, W, T(0), A);
      gemm<T>(false, true, TB, G, H, T(1), hp.data<T>(), R, T(1), A);
      if (bw) {
        add_rows(A, TB, G, bw);
        add_rows(A, TB, G, bw + G);
      }
      for (int64_t r = 0; r < TB; ++r)
        for (int64_t j = 0; j < G; ++j) {
          T& v = A[r * G + j];
          v = j < 3 * H ? sigm(v) : std::tanh(v);
        }
      // The cell states, replayed in the direction's order.
      auto cprev = [&](int64_t t, int64_t b) -> const T* {
        const int64_t tp = rev ? t + 1 : t - 1;
        if (tp >= 0 && tp < len[b]) return cs.data<T>() + (tp * B + b) * H;
        return c0d ? c0d + b * H : nullptr;
      };
      for (int64_t s = 0; s < T_; ++s) {
        const int64_t t = rev ? T_ - 1 - s : s;
        for (int64_t b = 0; b < B; ++b) {
          if (t >= len[b]) continue;
          const T* g = A + (t * B + b) * G;
          const T* cp = cprev(t, b);
          T* cc = cs.data<T>() + (t * B + b) * H;
          for (int64_t j = 0; j < H; ++j)
            cc[j] = g[2 * H + j] * (cp ? cp[j] : T(0)) + g[j] * g[3 * H + j];
        }
      }
      // Back through time.
      T *pdh = dh.data<T>(), *pdc = dc.data<T>(), *dA = da.data<T>();
      copy_or_zero(dyh.p ? dyh.p + d * B * H : nullptr, B * H, pdh);
      copy_or_zero(dyc.p ? dyc.p + d * B * H : nullptr, B * H, pdc);
      for (int64_t s = T_ - 1; s >= 0; --s) {
        const int64_t t = rev ? T_ - 1 - s : s;
        for (int64_t b = 0; b < B; ++b) {
          T* dg = dA + (t * B + b) * G;
          if (t >= len[b]) {
            std::fill_n(dg, G, T(0));
            continue;
          }
          const T* g = A + (t * B + b) * G;
          const T* cc = cs.data<T>() + (t * B + b) * H;
          const T* cp = cprev(t, b);
          const T* dyr = dy.p ? dy.p + ((t * m.D + d) * B + b) * H : nullptr;
          for (int64_t j = 0; j < H; ++j) {
            const T i = g[j], o = g[H + j], f = g[2 * H + j], gg = g[3 * H + j];
            const T dht = pdh[b * H + j] + (dyr ? dyr[j] : T(0));
            const T tc = std::tanh(cc[j]);
            const T dC = pdc[b * H + j] + dht * o * (T(1) - tc * tc);
            dg[j] = dC * gg * i * (T(1) - i);
            dg[H + j] = dht * tc * o * (T(1) - o);
            dg[2 * H + j] = dC * (cp ? cp[j] : T(0)) * f * (T(1) - f);
            dg[3 * H + j] = dC * i * (T(1) - gg * gg);
            pdc[b * H + j] = dC * f;
          }
        }
        gemm<T>(false, false, B, H, G, T(1), dA + t * B * G, R, T(0), dhn.data<T>());
        for (int64_t b = 0; b < B; ++b)
          if (t < len[b]) std::copy_n(dhn.data<T>() + b * H, H, pdh + b * H);
      }
      if (dh0.p) std::copy_n(pdh, B * H, dh0.p + d * B * H);
      if (dc0.p) std::copy_n(pdc, B * H, dc0.p + d * B * H);
      if (dx.p) gemm<T>(false, false, TB, m.I, G, T(1), dA, W, T(d > 0), dx.p);
      if (c.has_out(1))
        gemm<T>(true, false, G, m.I, TB, T(1), dA, x.p, T(0), c.out(1).data<T>() + d * G * m.I);
      if (c.has_out(2))
        gemm<T>(true, false, G, H, TB, T(1), dA, hp.data<T>(), T(0),
                c.out(2).data<T>() + d * G * H);
      if (c.has_out(3)) {
        T* db = c.out(3).data<T>() + d * 2 * G;
        col_sums(dA, TB, G, db);
        std::copy_n(db, G, db + G);
      }
    }
    dx.store(opt_out(c, 0), m.layout, B, T_, m.I);
    dh0.store(opt_out(c, 4), m.layout, B, m.D, H);
    dc0.store(opt_out(c, 5), m.layout, B, m.D, H);
  });
}

// ---- GRU (gate order z, r, h)
// z = s(x Wz + h Rz + bz), r = s(...); n = tanh(x Wh + bWh + r (h Rh + bRh))  [lbr = 1]
//                                      n = tanh(x Wh + bWh + (r h) Rh + bRh)  [lbr = 0]
// h' = (1 - z) n + z h
void gru_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Dims m = kernel_dims(c);
    const RnnAttrs& ra = c.attrs<RnnAttrs>();
    const bool lbr = ra.linear_before_reset;
    const int64_t T_ = m.T, B = m.B, H = m.H, G = 3 * H;
    const DType dt = c.in(0).dtype();
    const auto len = seq_lens(c, m);
    auto ws = [&](Shape s, const char* name) {
      return Tensor::empty(std::move(s), dt, c.alloc, Category::Workspace, name);
    };
    TimeMajor<T> x(&c.in(0), m.layout, B, T_, m.I, c.alloc);
    TimeMajor<T> h0(opt_in(c, 5), m.layout, B, m.D, H, c.alloc);
    Tensor ybuf = ws({T_, m.D, B, H}, "rnn_y"), xw = ws({T_ * B, G}, "rnn_xw");
    Tensor hr = ws({B, G}, "rnn_hr"), hb = ws({m.D, B, H}, "h"), rh = ws({B, H}, "r_h");
    T* y = ybuf.data<T>();
    for (int64_t d = 0; d < m.D; ++d) {
      const bool rev = ra.reverse(d);
      const T* W = c.in(1).data<T>() + d * G * m.I;
      const T* R = c.in(2).data<T>() + d * G * H;
      const T* bw = c.has_in(3) ? c.in(3).data<T>() + d * 2 * G : nullptr;
      const T* br = bw ? bw + G : nullptr;
      T* h = hb.data<T>() + d * B * H;
      copy_or_zero(h0.p ? h0.p + d * B * H : nullptr, B * H, h);
      gemm<T>(false, true, T_ * B, G, m.I, T(1), x.p, W, T(0), xw.data<T>());
      add_rows(xw.data<T>(), T_ * B, G, bw);
      T* HR = hr.data<T>();
      for (int64_t s = 0; s < T_; ++s) {
        const int64_t t = rev ? T_ - 1 - s : s;
        // HR = h R^T + bR (lbr = 0: only the z and r columns here; the h column after r h).
        gemm_ld<T>(false, true, B, lbr ? G : 2 * H, H, T(1), h, H, R, H, T(0), HR, G);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t j = 0; j < (lbr ? G : 2 * H); ++j) HR[b * G + j] += br ? br[j] : T(0);
        if (!lbr) {
          for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < H; ++j) {
              const T r = sigm(xw.data<T>()[(t * B + b) * G + H + j] + HR[b * G + H + j]);
              rh.data<T>()[b * H + j] = r * h[b * H + j];
            }
          gemm_ld<T>(false, true, B, H, H, T(1), rh.data<T>(), H, R + 2 * H * H, H, T(0),
                     HR + 2 * H, G);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < H; ++j) HR[b * G + 2 * H + j] += br ? br[2 * H + j] : T(0);
        }
        for (int64_t b = 0; b < B; ++b) {
          T* yr = y + ((t * m.D + d) * B + b) * H;
          if (t >= len[b]) {
            std::fill_n(yr, H, T(0));
            continue;
          }
          const T* a0 = xw.data<T>() + (t * B + b) * G;
          const T* a1 = HR + b * G;
          for (int64_t j = 0; j < H; ++j) {
            const T z = sigm(a0[j] + a1[j]), r = sigm(a0[H + j] + a1[H + j]);
            const T n = std::tanh(a0[2 * H + j] + (lbr ? r * a1[2 * H + j] : a1[2 * H + j]));
            T& hh = h[b * H + j];
            hh = yr[j] = (T(1) - z) * n + z * hh;
          }
        }
      }
    }
    store_layout(y, opt_out(c, 0), m.layout, T_ * m.D, B, H);
    store_layout(hb.data<T>(), opt_out(c, 1), m.layout, m.D, B, H);
  });
}

// GRUGrad(X, W, R, B, sequence_lens, initial_h, Y, dY, dY_h) -> dX, dW, dR, dB, dinitial_h
void infer_gru_grad(InferCtx& c) {
  const RnnAttrs a = rnn_attrs(c.node());
  Dims m = dims_of(c.shape(0), c.shape(1), a.hidden_size, a.layout);
  const DType dt = c.dtype(0);
  c.set_out(0, dt, c.shape(0));
  c.set_out(1, dt, c.shape(1));
  c.set_out(2, dt, c.shape(2));
  c.set_out(3, dt, {m.D, 6 * m.H});
  c.set_out(4, dt, state_shape(m));
}

void gru_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Dims m = kernel_dims(c);
    const RnnAttrs& ra = c.attrs<RnnAttrs>();
    const bool lbr = ra.linear_before_reset;
    const int64_t T_ = m.T, B = m.B, H = m.H, G = 3 * H, TB = m.T * m.B;
    const DType dt = c.in(0).dtype();
    const auto len = seq_lens(c, m);
    auto ws = [&](Shape s, const char* name) {
      return Tensor::empty(std::move(s), dt, c.alloc, Category::Workspace, name);
    };
    TimeMajor<T> x(&c.in(0), m.layout, B, T_, m.I, c.alloc);
    TimeMajor<T> h0(opt_in(c, 5), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> y(&c.in(6), m.layout, B, T_ * m.D, H, c.alloc);
    TimeMajor<T> dy(opt_in(c, 7), m.layout, B, T_ * m.D, H, c.alloc);
    TimeMajor<T> dyh(opt_in(c, 8), m.layout, B, m.D, H, c.alloc);
    TimeMajor<T> dx(opt_out(c, 0), m.layout, B, T_, m.I, c.alloc, false);
    TimeMajor<T> dh0(opt_out(c, 4), m.layout, B, m.D, H, c.alloc, false);
    Tensor hp = ws({TB, H}, "rnn_hprev"), xw = ws({TB, G}, "rnn_xw"), hr = ws({TB, G}, "rnn_hr");
    Tensor rh = ws({TB, H}, "rnn_r_h"), dxg = ws({TB, G}, "rnn_dgates");
    Tensor drg = ws({lbr ? TB : 0, G}, "rnn_dgates_r"), dh = ws({B, H}, "dh");
    Tensor direct = ws({B, H}, "dh_direct"), tmp = ws({B, H}, "dh_tmp");
    for (int64_t d = 0; d < m.D; ++d) {
      const bool rev = ra.reverse(d);
      const T* W = c.in(1).data<T>() + d * G * m.I;
      const T* R = c.in(2).data<T>() + d * G * H;
      const T* bw = c.has_in(3) ? c.in(3).data<T>() + d * 2 * G : nullptr;
      const T* br = bw ? bw + G : nullptr;
      T *Hp = hp.data<T>(), *XW = xw.data<T>(), *HR = hr.data<T>(), *RH = rh.data<T>();
      prev_states(y.p, h0.p, m, d, rev, len, Hp);
      // Recompute the gates of every step: XW holds z, r, n after this block; HR holds the
      // recurrent pre-activations (HR's h column is what r multiplies when lbr = 1).
      gemm<T>(false, true, TB, G, m.I, T(1), x.p, W, T(0), XW);
      add_rows(XW, TB, G, bw);
      gemm_ld<T>(false, true, TB, lbr ? G : 2 * H, H, T(1), Hp, H, R, H, T(0), HR, G);
      for (int64_t r = 0; r < TB; ++r)
        for (int64_t j = 0; j < (lbr ? G : 2 * H); ++j) {
          HR[r * G + j] += br ? br[j] : T(0);
          if (j < 2 * H) XW[r * G + j] = sigm(XW[r * G + j] + HR[r * G + j]);
        }
      if (!lbr) {
        for (int64_t r = 0; r < TB; ++r)
          for (int64_t j = 0; j < H; ++j) RH[r * H + j] = XW[r * G + H + j] * Hp[r * H + j];
        gemm_ld<T>(false, true, TB, H, H, T(1), RH, H, R + 2 * H * H, H, T(0), HR + 2 * H, G);
        for (int64_t r = 0; r < TB; ++r)
          for (int64_t j = 0; j < H; ++j) HR[r * G + 2 * H + j] += br ? br[2 * H + j] : T(0);
      }
      for (int64_t r = 0; r < TB; ++r)
        for (int64_t j = 0; j < H; ++j) {
          const T rr = XW[r * G + H + j], hh = HR[r * G + 2 * H + j];
          XW[r * G + 2 * H + j] = std::tanh(XW[r * G + 2 * H + j] + (lbr ? rr * hh : hh));
        }
      // Back through time.
      T *pdh = dh.data<T>(), *dX = dxg.data<T>(), *dR = lbr ? drg.data<T>() : nullptr;
      T *pdir = direct.data<T>(), *ptmp = tmp.data<T>();
      copy_or_zero(dyh.p ? dyh.p + d * B * H : nullptr, B * H, pdh);
      for (int64_t s = T_ - 1; s >= 0; --s) {
        const int64_t t = rev ? T_ - 1 - s : s;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t row = t * B + b;
          T* dg = dX + row * G;
          if (t >= len[b]) {
            std::fill_n(dg, G, T(0));
            if (dR) std::fill_n(dR + row * G, G, T(0));
            continue;
          }
          const T* g = XW + row * G;
          const T* hpr = Hp + row * H;
          const T* dyr = dy.p ? dy.p + ((t * m.D + d) * B + b) * H : nullptr;
          for (int64_t j = 0; j < H; ++j) {
            const T z = g[j], r = g[H + j], n = g[2 * H + j];
            const T dht = pdh[b * H + j] + (dyr ? dyr[j] : T(0));
            const T dan = dht * (T(1) - z) * (T(1) - n * n);
            dg[j] = dht * (hpr[j] - n) * z * (T(1) - z);
            dg[2 * H + j] = dan;
            pdir[b * H + j] = dht * z;
            if (lbr) {
              const T hh = HR[row * G + 2 * H + j];
              dg[H + j] = dan * hh * r * (T(1) - r);
              dR[row * G + j] = dg[j];
              dR[row * G + H + j] = dg[H + j];
              dR[row * G + 2 * H + j] = dan * r;
            }
          }
        }
        T* dnext = ptmp;
        if (lbr) {
          gemm<T>(false, false, B, H, G, T(1), dR + t * B * G, R, T(0), dnext);
        } else {
          // d(r h) = dan Rh; dr = d(r h) h_prev; the direct path gains d(r h) r.
          gemm_ld<T>(false, false, B, H, H, T(1), dX + t * B * G + 2 * H, G, R + 2 * H * H, H, T(0),
                     dnext, H);
          for (int64_t b = 0; b < B; ++b) {
            if (t >= len[b]) continue;
            const int64_t row = t * B + b;
            for (int64_t j = 0; j < H; ++j) {
              const T r = XW[row * G + H + j], drh = dnext[b * H + j];
              dX[row * G + H + j] = drh * Hp[row * H + j] * r * (T(1) - r);
              pdir[b * H + j] += drh * r;
            }
          }
          gemm_ld<T>(false, false, B, H, 2 * H, T(1), dX + t * B * G, G, R, H, T(0), dnext, H);
        }
        for (int64_t b = 0; b < B; ++b)
          if (t < len[b])
            for (int64_t j = 0; j < H; ++j) pdh[b * H + j] = dnext[b * H + j] + pdir[b * H + j];
      }
      if (dh0.p) std::copy_n(pdh, B * H, dh0.p + d * B * H);
      if (dx.p) gemm<T>(false, false, TB, m.I, G, T(1), dX, W, T(d > 0), dx.p);
      if (c.has_out(1))
        gemm<T>(true, false, G, m.I, TB, T(1), dX, x.p, T(0), c.out(1).data<T>() + d * G * m.I);
      if (c.has_out(2)) {
        T* dRw = c.out(2).data<T>() + d * G * H;
        if (lbr) {
          gemm<T>(true, false, G, H, TB, T(1), dR, Hp, T(0), dRw);
        } else {
          gemm_ld<T>(true, false, 2 * H, H, TB, T(1), dX, G, Hp, H, T(0), dRw, H);
          gemm_ld<T>(true, false, H, H, TB, T(1), dX + 2 * H, G, RH, H, T(0), dRw + 2 * H * H, H);
        }
      }
      if (c.has_out(3)) {
        T* db = c.out(3).data<T>() + d * 2 * G;
        col_sums(dX, TB, G, db);
        if (lbr)
          col_sums(dR, TB, G, db + G);
        else
          std::copy_n(db, G, db + G);
      }
    }
    dx.store(opt_out(c, 0), m.layout, B, T_, m.I);
    dh0.store(opt_out(c, 4), m.layout, B, m.D, H);
  });
}

// The gradient rules: one fused backward node reading the forward's inputs and its output Y.
std::vector<int> rnn_inputs(GradBuilder& g, int n) {
  std::vector<int> in;
  const Node& node = g.node();
  for (int i = 0; i < n; ++i)
    in.push_back(i < static_cast<int>(node.inputs.size()) ? node.inputs[i] : -1);
  return in;
}
void grad_lstm(GradBuilder& g) {
  std::vector<int> in = rnn_inputs(g, 7);
  in.push_back(g.y(0));
  for (int k = 0; k < 3; ++k) in.push_back(g.dy(k));
  auto outs = g.emit("LSTMGrad", in, g.node().attrs, 6, "graft");
  const int map[] = {0, 1, 2, 3, -1, 4, 5};
  for (int i = 0; i < 7; ++i)
    if (map[i] >= 0 && g.needs(i)) g.set_dx(i, outs[map[i]]);
}
void grad_gru(GradBuilder& g) {
  std::vector<int> in = rnn_inputs(g, 6);
  in.push_back(g.y(0));
  for (int k = 0; k < 2; ++k) in.push_back(g.dy(k));
  auto outs = g.emit("GRUGrad", in, g.node().attrs, 5, "graft");
  const int map[] = {0, 1, 2, 3, -1, 4};
  for (int i = 0; i < 6; ++i)
    if (map[i] >= 0 && g.needs(i)) g.set_dx(i, outs[map[i]]);
}

const OpDef kOps[] = {
    {.name = "LSTM",
     .min_in = 3,
     .max_in = 8,
     .max_out = 3,
     .infer = infer_lstm,
     .prepare = prepare_rnn,
     .kernel = lstm_kernel,
     .grad = grad_lstm,
     .nondiff_inputs = {4},
     .recompute = false},
    {.name = "GRU",
     .min_in = 3,
     .max_in = 6,
     .max_out = 2,
     .infer = infer_gru,
     .prepare = prepare_rnn,
     .kernel = gru_kernel,
     .grad = grad_gru,
     .nondiff_inputs = {4},
     .recompute = false},
    {.name = "LSTMGrad",
     .domain = "graft",
     .min_in = 3,  // X, W, R; Y (7) is always given; the rest are optional
     .max_in = 11,
     .max_out = 6,
     .infer = infer_lstm_grad,
     .prepare = prepare_rnn,
     .kernel = lstm_grad_kernel,
     .nondiff_inputs = {4}},
    {.name = "GRUGrad",
     .domain = "graft",
     .min_in = 3,  // X, W, R; Y (6) is always given; the rest are optional
     .max_in = 9,
     .max_out = 5,
     .infer = infer_gru_grad,
     .prepare = prepare_rnn,
     .kernel = gru_grad_kernel,
     .nondiff_inputs = {4}},
};

}  // namespace

void register_rnn_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
