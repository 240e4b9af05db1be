// Elementwise ops of one input and their gradients: unary math (Neg, Reciprocal, Sqrt, Exp, Sin,
// Cos, Log, Erf, Tanh, Sigmoid), Relu, Abs, Sign, Clip, HardSigmoid, HardSwish, Gelu, graft's Silu,
// Identity, graft's StopGradient and Cast, with graft's fused gradient kernels (ReluGrad,
// SigmoidGrad, TanhGrad, ErfGrad, GeluGrad, SiluGrad, HardGrad, ClipGrad). More unary math is in
// math.cpp; ops of several inputs are in binary.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "elementwise.h"
#include "vmath.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- unary --------------------------------------------------------------------------------------
// float32 transcendentals through vmath (vectorized; see vmath.h) when the CPU has AVX2 or
// AVX-512: Op::kVec names the function. A vector element costs about a quarter of a libm call.
constexpr int64_t kVecMath = 4;
// False (nothing done) for float64 and without vmath: the caller's scalar loop runs.
template <class T>
bool vec_map(vmath::Fn f, const T* x, T* y, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (!vmath::active()) return false;
    parallel_elems(n, kVecMath, [&](int64_t b, int64_t e) { vmath::map(f, x + b, y + b, e - b); });
    return true;
  } else {
    return false;
  }
}
template <class T>
bool vec_map2(vmath::Fn2 f, const T* g, const T* x, T* y, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (!vmath::active()) return false;
    parallel_elems(n, 2 * kVecMath,
                   [&](int64_t b, int64_t e) { vmath::map2(f, g + b, x + b, y + b, e - b); });
    return true;
  } else {
    return false;
  }
}

template <class Op>
void unary_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    const int64_t n = c.in(0).numel();
    if constexpr (requires { Op::kVec; })
      if (vec_map(Op::kVec, x, y, n)) return;
    map1(x, y, n, Op::kWork, [](T v) { return Op::f(v); });
  });
}
struct NegF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T x) {
    return -x;
  }
};
struct ReciprocalF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T x) {
    return T(1) / x;
  }
};
struct SqrtF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T x) {
    return std::sqrt(x);
  }
};
struct ExpF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn kVec = vmath::Fn::Exp;
  template <class T>
  static T f(T x) {
    return std::exp(x);
  }
};
struct SinF {
  static constexpr int64_t kWork = kMath;
  template <class T>
  static T f(T x) {
    return std::sin(x);
  }
};
struct CosF {
  static constexpr int64_t kWork = kMath;
  template <class T>
  static T f(T x) {
    return std::cos(x);
  }
};
struct LogF {
  static constexpr int64_t kWork = kMath;
  template <class T>
  static T f(T x) {
    return std::log(x);
  }
};
struct ErfF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn kVec = vmath::Fn::Erf;
  template <class T>
  static T f(T x) {
    return std::erf(x);
  }
};
struct TanhF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn kVec = vmath::Fn::Tanh;
  template <class T>
  static T f(T x) {
    return std::tanh(x);
  }
};
struct SigmoidF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn kVec = vmath::Fn::Sigmoid;
  template <class T>
  static T f(T x) {
    return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x));
  }
};
struct ReluF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T x) {
    return x > T(0) ? x : T(0);
  }
};

void infer_unary_float(InferCtx& c) {
  require_float(c, 0);
  infer_same(c);
}

// Neg also accepts integers (shape arithmetic in exported graphs).
void neg_kernel(KernelCtx& c) {
  if (dispatch_int(c.in(0).dtype(), [&]<class T>() {
        const T* x = c.in(0).data<T>();
        map1(x, c.out(0).data<T>(), c.in(0).numel(), kCheap, [](T v) -> T { return -v; });
      }))
    return;
  unary_kernel<NegF>(c);
}
void infer_neg(InferCtx& c) {
  require_numeric(c, 0);
  infer_same(c);
}

// ---- Cast ---------------------------------------------------------------------------------------
void infer_cast(InferCtx& c) {
  int64_t to = c.attr_int("to", -1);
  DType dt;
  if (!dtype_of_onnx_elem(to, dt))
    c.error(ErrorKind::Unsupported,
            "cast to ONNX type " + std::to_string(to) +
                " is not supported (float32, float64, int64, int32, bool only)");
  c.set_out(0, dt, c.shape(0));
}
void cast_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  Tensor& y = c.out(0);
  dispatch(x.dtype(), [&]<class S>() {
    const S* px = x.data<S>();
    dispatch(y.dtype(), [&]<class D>() {
      D* py = y.data<D>();
      map1(px, py, x.numel(), kCheap, [](S s) -> D {
        if constexpr (std::is_same_v<D, bool>) {
          return s != S(0);
        } else if constexpr (std::is_floating_point_v<S> && std::is_same_v<D, int64_t>) {
          // NaN or out of range is undefined in C++; give what x86 (and so numpy) gives.
          const double v = static_cast<double>(s);
          return v >= -9.2233720368547758e18 && v < 9.2233720368547758e18 ? static_cast<int64_t>(v)
                                                                          : INT64_MIN;
        } else if constexpr (std::is_floating_point_v<S> && std::is_same_v<D, int32_t>) {
          const double v = static_cast<double>(s);
          return v > -2147483649.0 && v < 2147483648.0 ? static_cast<int32_t>(v) : INT32_MIN;
        } else {
          return static_cast<D>(s);
        }
      });
    });
  });
}

// ---- Abs / Sign (float and int64) -------------------------------------------------------------
void infer_signed(InferCtx& c) {
  require_numeric(c, 0);
  infer_same(c);
}
template <bool kSign>
void abs_sign_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    map1(c.in(0).data<T>(), c.out(0).data<T>(), c.in(0).numel(), kCheap, [](T v) -> T {
      if constexpr (kSign)
        return v > T(0) ? T(1) : v < T(0) ? T(-1) : T(0);
      else
        return v < T(0) ? -v : v;
    });
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
void grad_abs(GradBuilder& g) { g.set_dx(0, g.emit1("Mul", {g.dy(0), g.emit1("Sign", {g.x(0)})})); }

// ---- Clip(x, min?, max?) ------------------------------------------------------------------------
void infer_clip(InferCtx& c) {
  require_numeric(c, 0);
  for (int i = 1; i < 3; ++i)
    if (c.has_in(i)) {
      c.check(numel(c.shape(i)) == 1, "min and max must be scalars");
      if (c.dtype(i) != c.dtype(0))
        c.error(ErrorKind::InvalidModel, "min / max differ in dtype from the input");
    }
  infer_same(c);
}
// PyTorch's clamp: y = min(max(x, lo), hi); the gradient passes where lo <= x <= hi.
void clip_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    const T lo = c.has_in(1) ? c.in(1).data<T>()[0] : std::numeric_limits<T>::lowest();
    const T hi = c.has_in(2) ? c.in(2).data<T>()[0] : std::numeric_limits<T>::max();
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    map1(x, y, c.in(0).numel(), kCheap, [lo, hi](T v) { return std::min(std::max(v, lo), hi); });
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
// ClipGrad(dy, x, min?, max?) -> dx
void clip_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T lo = c.has_in(2) ? c.in(2).data<T>()[0] : std::numeric_limits<T>::lowest();
    const T hi = c.has_in(3) ? c.in(3).data<T>()[0] : std::numeric_limits<T>::max();
    const T *dy = c.in(0).data<T>(), *x = c.in(1).data<T>();
    T* dx = c.out(0).data<T>();
    map2(dy, x, dx, c.in(0).numel(), kCheap,
         [lo, hi](T d, T v) { return v >= lo && v <= hi ? d : T(0); });
  });
}
void grad_clip(GradBuilder& g) {
  const Node& n = g.node();
  std::vector<int> ins{g.dy(0), g.x(0)};
  for (int i = 1; i < 3; ++i)
    ins.push_back(i < static_cast<int>(n.inputs.size()) ? n.inputs[i] : -1);
  while (!ins.empty() && ins.back() < 0) ins.pop_back();
  g.set_dx(0, g.emit1("ClipGrad", ins, {}, "graft"));
}

// ---- HardSigmoid / HardSwish ------------------------------------------------------------------
// HardSigmoid's and HardGrad's attributes.
struct HardAttrs {
  double alpha = 0.2, beta = 0.5;  // HardSigmoid: max(0, min(1, alpha * x + beta))
  bool swish = false;              // HardGrad: kind = 1 (HardSwish's), else HardSigmoid's
};
HardAttrs hard_attrs(const Node& n) {
  const std::string where = n.label();
  return {n.attrs.get_float("alpha", 0.2, where), n.attrs.get_float("beta", 0.5, where),
          n.attrs.get_int("kind", 0, where) == 1};
}
std::shared_ptr<const void> prepare_hard(const Node& n) { return prepared(hard_attrs(n)); }
void hard_sigmoid_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T a = static_cast<T>(c.attrs<HardAttrs>().alpha),
            b = static_cast<T>(c.attrs<HardAttrs>().beta);
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    map1(x, y, c.in(0).numel(), kCheap,
         [&](T v) { return std::min(T(1), std::max(T(0), a * v + b)); });
  });
}
void hard_swish_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    map1(x, y, c.in(0).numel(), kCheap,
         [](T v) { return v * std::min(T(1), std::max(T(0), v / T(6) + T(0.5))); });
  });
}
// HardGrad(dy, x; kind = 0 sigmoid (alpha, beta) | 1 swish) -> dx, as PyTorch's backward.
void hard_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const HardAttrs& ha = c.attrs<HardAttrs>();
    const bool swish = ha.swish;
    const T a = static_cast<T>(ha.alpha), b = static_cast<T>(ha.beta);
    const T *dy = c.in(0).data<T>(), *x = c.in(1).data<T>();
    T* dx = c.out(0).data<T>();
    if (swish)
      map2(dy, x, dx, c.in(0).numel(), kCheap, [](T d, T v) {
        return v < T(-3) ? T(0) : v <= T(3) ? d * (v / T(3) + T(0.5)) : d;
      });
    else
      map2(dy, x, dx, c.in(0).numel(), kCheap, [a, b](T d, T v) {
        const T z = a * v + b;
        return z > T(0) && z < T(1) ? d * a : T(0);
      });
  });
}
void grad_hard_sigmoid(GradBuilder& g) {
  Attrs a;
  a.set_int("kind", 0);
  const HardAttrs h = hard_attrs(g.node());
  a.set_float("alpha", h.alpha);
  a.set_float("beta", h.beta);
  g.set_dx(0, g.emit1("HardGrad", {g.dy(0), g.x(0)}, a, "graft"));
}
void grad_hard_swish(GradBuilder& g) {
  Attrs a;
  a.set_int("kind", 1);
  g.set_dx(0, g.emit1("HardGrad", {g.dy(0), g.x(0)}, a, "graft"));
}
void infer_grad_same1(InferCtx& c) {
  require_float(c, 0);
  c.check(c.shape(0) == c.shape(1), "dy and x differ in shape");
  infer_same(c);
}

// ---- Gelu, Silu ---------------------------------------------------------------------------------
// Gelu as ONNX opset 20 defines it (approximate "none" | "tanh"); graft's Silu = x * sigmoid(x).
// Exported graphs spell them as 5 and 2 nodes; the training rewrite (autodiff/rewrite.cpp) fuses
// them so that the backward keeps only x, as PyTorch's GeluBackward and SiluBackward do.
bool gelu_tanh(const Node& n) {
  const std::string a = n.attrs.get_string("approximate", "none", n.label());
  if (a != "none" && a != "tanh")
    fail_at(ErrorKind::InvalidModel, n.name, n.label() + ": approximate must be none or tanh");
  return a == "tanh";
}
struct GeluAttrs {
  bool tanh = false;  // approximate = "tanh" (else "none": erf)
};
std::shared_ptr<const void> prepare_gelu(const Node& n) {
  return prepared(GeluAttrs{gelu_tanh(n)});
}
constexpr double kSqrt2Pi = 0.7978845608028654;  // sqrt(2 / pi)
template <class T>
T gelu_f(bool th, T v) {
  if (th) return T(0.5) * v * (T(1) + std::tanh(T(kSqrt2Pi) * (v + T(0.044715) * v * v * v)));
  return T(0.5) * v * (T(1) + std::erf(v * T(M_SQRT1_2)));
}
template <class T>
T gelu_grad_f(bool th, T g, T v) {
  if (th) {
    const T t = std::tanh(T(kSqrt2Pi) * (v + T(0.044715) * v * v * v));
    return g * (T(0.5) * (T(1) + t) +
                T(0.5) * v * (T(1) - t * t) * T(kSqrt2Pi) * (T(1) + T(3 * 0.044715) * v * v));
  }
  return g * (T(0.5) * (T(1) + std::erf(v * T(M_SQRT1_2))) +
              v * std::exp(T(-0.5) * v * v) * T(0.3989422804014327));  // 1 / sqrt(2 pi)
}
// Note [bf16 activations]: a matrix product's output that a bf16 step stores in bfloat16 for the
// GELU after it. Gelu and GeluGrad widen X a block at a time into the stack and run the float32
// code on it (the vector functions pad the tail of any block, so each element's result does not
// depend on where a block starts): exactly the results for a float32 X of the same values.
constexpr int64_t kWidenBlock = 1024;
template <class Fn>
void widened_blocks(const uint16_t* x, int64_t n, int64_t work, Fn&& fn) {
  parallel_elems(n, work, [&](int64_t b, int64_t e) {
    float buf[kWidenBlock];
    for (int64_t i = b; i < e; i += kWidenBlock) {
      const int64_t m = std::min(kWidenBlock, e - i);
      for (int64_t k = 0; k < m; ++k) buf[k] = bf16_to_float(x[i + k]);
      fn(i, m, buf);
    }
  });
}
void gelu_kernel(KernelCtx& c) {
  const bool th = c.attrs<GeluAttrs>().tanh;
  const vmath::Fn f = th ? vmath::Fn::GeluTanh : vmath::Fn::GeluErf;
  const int64_t n = c.in(0).numel();
  if (c.in(0).dtype() == DType::BF16) {
    float* y = c.out(0).data<float>();
    const int64_t work = vmath::active() ? kVecMath : kMath;
    widened_blocks(c.in(0).data<uint16_t>(), n, work, [&](int64_t i, int64_t m, const float* x) {
      if (vmath::active())
        vmath::map(f, x, y + i, m);
      else
        for (int64_t k = 0; k < m; ++k) y[i + k] = gelu_f(th, x[k]);
    });
    return;
  }
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    if (vec_map(f, x, y, n)) return;
    map1(x, y, n, kMath, [th](T v) { return gelu_f(th, v); });
  });
}
// GeluGrad(dy, x) -> dx (the Gelu's approximate attribute).
void gelu_grad_kernel(KernelCtx& c) {
  const bool th = c.attrs<GeluAttrs>().tanh;
  const vmath::Fn2 f = th ? vmath::Fn2::GeluTanhGrad : vmath::Fn2::GeluErfGrad;
  const int64_t n = c.in(0).numel();
  if (c.in(1).dtype() == DType::BF16) {
    if (c.in(0).dtype() != DType::F32)
      c.error(ErrorKind::Internal, "a bfloat16 X with a gradient that is not float32");
    const float* dy = c.in(0).data<float>();
    float* dx = c.out(0).data<float>();
    widened_blocks(c.in(1).data<uint16_t>(), n, 2 * (vmath::active() ? kVecMath : kMath),
                   [&](int64_t i, int64_t m, const float* x) {
                     if (vmath::active())
                       vmath::map2(f, dy + i, x, dx + i, m);
                     else
                       for (int64_t k = 0; k < m; ++k) dx[i + k] = gelu_grad_f(th, dy[i + k], x[k]);
                   });
    return;
  }
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T *dy = c.in(0).data<T>(), *x = c.in(1).data<T>();
    T* dx = c.out(0).data<T>();
    if (vec_map2(f, dy, x, dx, n)) return;
    map2(dy, x, dx, n, 2 * kMath, [th](T g, T v) { return gelu_grad_f(th, g, v); });
  });
}
// X may be a bfloat16 activation (Note [bf16 activations]); Y is then float32.
void infer_gelu(InferCtx& c) { c.set_out(0, float_or_bf16(c, 0), c.shape(0)); }
void grad_gelu(GradBuilder& g) {
  Attrs a;
  a.set_string("approximate", gelu_tanh(g.node()) ? "tanh" : "none");
  g.set_dx(0, g.emit1("GeluGrad", {g.dy(0), g.x(0)}, a, "graft"));
}
struct SiluF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn kVec = vmath::Fn::Silu;
  template <class T>
  static T f(T x) {
    return x * SigmoidF::f(x);
  }
};
struct SiluGradF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn2 kVec = vmath::Fn2::SiluGrad;
  template <class T>
  static T f(T dy, T x) {
    const T s = SigmoidF::f(x);
    return dy * s * (T(1) + x * (T(1) - s));
  }
};
void grad_silu(GradBuilder& g) { g.set_dx(0, g.emit1("SiluGrad", {g.dy(0), g.x(0)}, {}, "graft")); }

// ---- fused gradient kernels ---------------------------------------------------------------------
// (dy, t) -> dx, elementwise.
template <class Op>
void grad2_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T *d = c.in(0).data<T>(), *t = c.in(1).data<T>();
    T* dx = c.out(0).data<T>();
    const int64_t n = c.in(0).numel();
    if constexpr (requires { Op::kVec; })
      if (vec_map2(Op::kVec, d, t, dx, n)) return;
    map2(d, t, dx, n, Op::kWork, [](T a, T b) { return Op::f(a, b); });
  });
}
struct ReluGradF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T dy, T y) {
    return y > T(0) ? dy : T(0);
  }
};
struct SigmoidGradF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T dy, T y) {
    return dy * y * (T(1) - y);
  }
};
struct TanhGradF {
  static constexpr int64_t kWork = kCheap;
  template <class T>
  static T f(T dy, T y) {
    return dy * (T(1) - y * y);
  }
};
struct ErfGradF {
  static constexpr int64_t kWork = kMath;
  static constexpr vmath::Fn2 kVec = vmath::Fn2::ErfGrad;
  template <class T>
  static T f(T dy, T x) {
    return dy * T(1.1283791670955126) * std::exp(-x * x);  // 2/sqrt(pi)
  }
};
void infer_grad2(InferCtx& c) {
  require_float(c, 0);
  c.check(c.shape(0) == c.shape(1), "dy and saved tensor differ in shape");
  infer_same(c);
}

// ---- gradient rules ---------------------------------------------------------------------------
void grad_neg(GradBuilder& g) { g.set_dx(0, g.emit1("Neg", {g.dy(0)})); }
void grad_reciprocal(GradBuilder& g) {
  g.set_dx(0, g.emit1("Neg", {g.emit1("Mul", {g.dy(0), g.emit1("Mul", {g.y(0), g.y(0)})})}));
}
void grad_sqrt(GradBuilder& g) {
  DType dt = g.val(g.x(0)).dtype;
  g.set_dx(0, g.emit1("Div", {g.emit1("Mul", {g.dy(0), g.scalar(0.5, dt)}), g.y(0)}));
}
void grad_exp(GradBuilder& g) { g.set_dx(0, g.emit1("Mul", {g.dy(0), g.y(0)})); }
void grad_log(GradBuilder& g) { g.set_dx(0, g.emit1("Div", {g.dy(0), g.x(0)})); }
// sin' = cos, cos' = -sin (rotary position embeddings computed from a buffer).
void grad_sin(GradBuilder& g) { g.set_dx(0, g.emit1("Mul", {g.dy(0), g.emit1("Cos", {g.x(0)})})); }
void grad_cos(GradBuilder& g) {
  g.set_dx(0, g.emit1("Neg", {g.emit1("Mul", {g.dy(0), g.emit1("Sin", {g.x(0)})})}));
}
void grad_erf(GradBuilder& g) { g.set_dx(0, g.emit1("ErfGrad", {g.dy(0), g.x(0)}, {}, "graft")); }
void grad_tanh(GradBuilder& g) { g.set_dx(0, g.emit1("TanhGrad", {g.dy(0), g.y(0)}, {}, "graft")); }
void grad_sigmoid(GradBuilder& g) {
  g.set_dx(0, g.emit1("SigmoidGrad", {g.dy(0), g.y(0)}, {}, "graft"));
}
// Note [bf16 activations]: Y may be a bfloat16 value the plan stored (a ReLU output that only
// products and this gradient read); its sign is the float32 Y's, except a positive Y below
// 2^-133, which rounds to zero and passes no gradient.
// dx = y > 0 ? d : 0 over [b, e), branch-free (a mask on d's bits; Note [ISA clones]).
GRAFT_ISA_CLONES void relu_grad_bf16(const float* d, const uint16_t* y, float* dx, int64_t b,
                                     int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    uint32_t bits;
    std::memcpy(&bits, d + i, 4);
    bits &= bf16_to_float(y[i]) > 0.f ? ~uint32_t{0} : uint32_t{0};
    std::memcpy(dx + i, &bits, 4);
  }
}
void relu_grad_kernel(KernelCtx& c) {
  if (c.in(1).dtype() != DType::BF16) return grad2_kernel<ReluGradF>(c);
  if (c.in(0).dtype() != DType::F32)
    c.error(ErrorKind::Internal, "a bfloat16 Y with a gradient that is not float32");
  const float* d = c.in(0).data<float>();
  const uint16_t* y = c.in(1).data<uint16_t>();
  float* dx = c.out(0).data<float>();
  parallel_elems(c.in(0).numel(), kCheap,
                 [&](int64_t b, int64_t e) { relu_grad_bf16(d, y, dx, b, e); });
}
// Note [bf16 writers]: a bfloat16 Y (kBf16OutAttr) is rounded as it is written, a block at a time,
// to the bits RoundToBf16 gives the float32 Y.
void relu_kernel(KernelCtx& c) {
  if (c.out(0).dtype() != DType::BF16) return unary_kernel<ReluF>(c);
  if (c.in(0).dtype() != DType::F32)
    c.error(ErrorKind::Internal, "a bfloat16 output of an input that is not float32");
  const float* x = c.in(0).data<float>();
  uint16_t* y = c.out(0).data<uint16_t>();
  parallel_elems(c.in(0).numel(), kCheap, [&](int64_t b, int64_t e) {
    constexpr int64_t kBlock = 1024;
    float buf[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t m = std::min(kBlock, e - i0);
      for (int64_t i = 0; i < m; ++i) buf[i] = ReluF::f(x[i0 + i]);
      round_to_bf16_here(buf, m, y + i0);
    }
  });
}
void grad_relu(GradBuilder& g) { g.set_dx(0, g.emit1("ReluGrad", {g.dy(0), g.y(0)}, {}, "graft")); }
void grad_identity(GradBuilder& g) { g.set_dx(0, g.dy(0)); }
// StopGradient's input never needs a gradient (nondiff_inputs): nothing flows back through it.
void grad_stop(GradBuilder&) {}
// A piecewise-constant op (Sign): its gradient is zero almost everywhere, as in PyTorch.
void grad_zero(GradBuilder& g) {
  g.set_dx(0, g.emit1("Mul", {g.dy(0), g.scalar(0, g.val(g.dy(0)).dtype)}));
}
void grad_cast(GradBuilder& g) {
  DType src = g.val(g.x(0)).dtype;
  if (!is_float(src)) return;
  Attrs a;
  a.set_int("to", onnx_dtype_code_of(src));
  g.set_dx(0, g.emit1("Cast", {g.dy(0)}, a));
}

const OpDef kOps[] = {
    {.name = "Neg",
     .infer = infer_neg,
     .kernel = neg_kernel,
     .grad = grad_neg,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Reciprocal",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ReciprocalF>,
     .grad = grad_reciprocal,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Sqrt",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SqrtF>,
     .grad = grad_sqrt,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Exp",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ExpF>,
     .grad = grad_exp,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Sin",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SinF>,
     .grad = grad_sin,
     .pointwise = true},
    {.name = "Cos",
     .infer = infer_unary_float,
     .kernel = unary_kernel<CosF>,
     .grad = grad_cos,
     .pointwise = true},
    {.name = "Log",
     .infer = infer_unary_float,
     .kernel = unary_kernel<LogF>,
     .grad = grad_log,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Erf",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ErfF>,
     .grad = grad_erf,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Tanh",
     .infer = infer_unary_float,
     .kernel = unary_kernel<TanhF>,
     .grad = grad_tanh,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Sigmoid",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SigmoidF>,
     .grad = grad_sigmoid,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Relu",
     .infer = infer_unary_float,
     .kernel = relu_kernel,
     .grad = grad_relu,
     .inplace_input = 0,
     .pointwise = true,
     .blocked = blocked_elementwise,
     .bf16_out = true},
    {.name = "Identity",
     .infer = infer_same,
     .grad = grad_identity,
     .alias = true,
     .copy_like = true,
     .blocked = blocked_elementwise},
    // graft's own: the value as it is, a constant for autodiff (where eager's autograd stops a
    // gradient: detach(), torch.no_grad; python/graft/_aten.py, Note [capture]).
    {.name = "StopGradient",
     .domain = "graft",
     .infer = infer_same,
     .grad = grad_stop,
     .alias = true,
     .nondiff_inputs = {0}},
    {.name = "Cast",
     .infer = infer_cast,
     .kernel = cast_kernel,
     .grad = grad_cast,
     .copy_like = true,
     .pointwise = true},
    // pointwise with kinks
    {.name = "Abs",
     .infer = infer_signed,
     .kernel = abs_sign_kernel<false>,
     .grad = grad_abs,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Sign",
     .infer = infer_signed,
     .kernel = abs_sign_kernel<true>,
     .grad = grad_zero,
     .inplace_input = 0},
    {.name = "Clip",
     .max_in = 3,
     .infer = infer_clip,
     .kernel = clip_kernel,
     .grad = grad_clip,
     .inplace_input = 0,
     .nondiff_inputs = {1, 2},
     .pointwise = true},
    {.name = "HardSigmoid",
     .infer = infer_unary_float,
     .prepare = prepare_hard,
     .kernel = hard_sigmoid_kernel,
     .grad = grad_hard_sigmoid,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "HardSwish",
     .infer = infer_unary_float,
     .kernel = hard_swish_kernel,
     .grad = grad_hard_swish,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "ClipGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 4,
     .infer = infer_grad_same1,
     .kernel = clip_grad_kernel,
     .inplace_input = 0},
    {.name = "HardGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad_same1,
     .prepare = prepare_hard,
     .kernel = hard_grad_kernel,
     .inplace_input = 0},
    // graft's fused gradient kernels: (dy, saved) -> dx
    {.name = "ReluGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = relu_grad_kernel,
     .inplace_input = 0,
     .blocked = blocked_elementwise},
    {.name = "SigmoidGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = grad2_kernel<SigmoidGradF>,
     .inplace_input = 0},
    {.name = "Gelu",
     .infer = infer_gelu,
     .prepare = prepare_gelu,
     .kernel = gelu_kernel,
     .grad = grad_gelu,
     .pointwise = true},
    {.name = "GeluGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .prepare = prepare_gelu,
     .kernel = gelu_grad_kernel,
     .inplace_input = 0},
    {.name = "Silu",
     .domain = "graft",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SiluF>,
     .grad = grad_silu,
     .pointwise = true},
    {.name = "SiluGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = grad2_kernel<SiluGradF>,
     .inplace_input = 0},
    {.name = "TanhGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = grad2_kernel<TanhGradF>,
     .inplace_input = 0},
    {.name = "ErfGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = grad2_kernel<ErfGradF>,
     .inplace_input = 0},
};

}  // namespace

void register_unary_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
