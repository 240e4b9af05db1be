// Elementwise ops: unary math, broadcasting binary ops, comparisons and logic, Abs, Sign, Clip,
// Max, Min, HardSigmoid, HardSwish, Gelu, graft's Silu, Where, Sum, Cast, and their gradients.
//
// Every op's schema, shape function, kernel and gradient rule are in the table at the bottom.
#include <cmath>
#include <limits>
#include <type_traits>

#include "util.h"
#include "vmath.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- unary --------------------------------------------------------------------------------------
// Element operations per element, for the parallel split: a libm call costs ~16 adds.
constexpr int64_t kCheap = 1, kMath = 16;

// y[i] = f(x[i]) over n elements, threaded; a plain loop the compiler can vectorize.
template <class T, class U, class F>
void map1(const T* x, U* y, int64_t n, int64_t work, F f) {
  parallel_elems(n, work, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] = f(x[i]);
  });
}
// z[i] = f(x[i], y[i]) over n elements, threaded.
// (f captures its scalars by value: a captured reference is reloaded in every iteration, since a
// store to z might change it, and the loop stays scalar; perf found ClipGrad so in mobilenet_v2.)
template <class T, class U, class F>
void map2(const T* x, const T* y, U* z, int64_t n, int64_t work, F f) {
  parallel_elems(n, work, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) z[i] = f(x[i], y[i]);
  });
}

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

// ---- binary with broadcasting -------------------------------------------------------------------
// out = f(a, b) with numpy broadcasting, threaded. Same shapes and a scalar side are flat loops;
// anything else runs by rows (bcast_rows): each side is contiguous or one value along a row (a
// bias add, a per-row mean), so the row loops are plain and vectorizable.
template <class T, class F>
void binary_loop(const Tensor& a, const Tensor& b, Tensor& out, F f, int64_t work = kCheap) {
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  using O = decltype(f(T(), T()));
  O* po = out.data<O>();
  const int64_t n = out.numel();
  if (a.shape() == out.shape() && b.shape() == out.shape()) {
    map2(pa, pb, po, n, work, f);
  } else if (a.shape() == out.shape() && b.numel() == 1) {
    const T s = pb[0];
    map1(pa, po, n, work, [f, s](T x) { return f(x, s); });
  } else if (b.shape() == out.shape() && a.numel() == 1) {
    const T s = pa[0];
    map1(pb, po, n, work, [f, s](T y) { return f(s, y); });
  } else {
    const auto p = bcast_rows<2>(out.shape(), {&a.shape(), &b.shape()});
    for_each_row<2>(p, work, [&](int64_t o, const std::array<int64_t, 2>& off, int64_t len) {
      const T* x = pa + off[0];
      const T* y = pb + off[1];
      O* z = po + o;
      if (p.ist[0] && p.ist[1]) {
        for (int64_t j = 0; j < len; ++j) z[j] = f(x[j], y[j]);
      } else if (p.ist[0]) {
        const T s = *y;
        for (int64_t j = 0; j < len; ++j) z[j] = f(x[j], s);
      } else if (p.ist[1]) {
        const T s = *x;
        for (int64_t j = 0; j < len; ++j) z[j] = f(s, y[j]);
      } else {
        std::fill(z, z + len, f(*x, *y));
      }
    });
  }
}

enum class Bin { Add, Sub, Mul, Div };
template <Bin op>
void arith_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    binary_loop<T>(c.in(0), c.in(1), c.out(0), [](T x, T y) -> T {
      if constexpr (op == Bin::Add) return x + y;
      if constexpr (op == Bin::Sub) return x - y;
      if constexpr (op == Bin::Mul) return x * y;
      if constexpr (op == Bin::Div) return x / y;
    });
  };
  switch (c.in(0).dtype()) {
    case DType::F32:
      run.template operator()<float>();
      break;
    case DType::F64:
      run.template operator()<double>();
      break;
    case DType::I64:
    case DType::I32:
      dispatch_int(c.in(0).dtype(), [&]<class T>() {
        if (op == Bin::Div) {
          const T* b = c.in(1).data<T>();
          for (int64_t i = 0; i < c.in(1).numel(); ++i)
            if (b[i] == 0) c.error(ErrorKind::InvalidArgument, "integer division by zero");
        }
        run.template operator()<T>();
      });
      break;
    default:
      c.error(ErrorKind::Unsupported, "bool arithmetic is not supported");
  }
}

void infer_arith(InferCtx& c) {
  if (c.dtype(0) != c.dtype(1))
    c.error(ErrorKind::InvalidModel, std::string("inputs have different dtypes (") +
                                         dtype_name(c.dtype(0)) + " and " + dtype_name(c.dtype(1)) +
                                         ")");
  if (c.dtype(0) == DType::Bool)
    c.error(ErrorKind::Unsupported, "bool arithmetic is not supported");
  c.set_out(0, c.dtype(0), broadcast_all(c));
}

// Pow(X, Y) has X's dtype. X: float32, float64 or int64; Y: any of those.
void infer_pow(InferCtx& c) {
  require_numeric(c, 0);
  if (!is_float(c.dtype(1)) && c.dtype(1) != DType::I64)
    c.error(ErrorKind::Unsupported, std::string("exponent has dtype ") + dtype_name(c.dtype(1)) +
                                        "; graft supports float32, float64 and int64 exponents");
  c.set_out(0, c.dtype(0), broadcast_all(c));
}
// int64 base: exact integer powers for an int64 exponent; for a float exponent the result is
// computed in double and truncated toward zero (numpy's pow(x, y).astype(int64)).
int64_t ipow(int64_t x, int64_t y, const KernelCtx& c) {
  if (y < 0) {
    if (x == 0) c.error(ErrorKind::InvalidArgument, "integer Pow: 0 raised to a negative power");
    if (x == 1) return 1;
    if (x == -1) return (y % 2) ? -1 : 1;
    return 0;
  }
  uint64_t e = static_cast<uint64_t>(y), b = static_cast<uint64_t>(x), acc = 1;
  while (e) {  // wraps modulo 2^64 on overflow, like numpy's int64 power
    if (e & 1) acc *= b;
    b *= b;
    e >>= 1;
  }
  return static_cast<int64_t>(acc);
}
void pow_int_kernel(KernelCtx& c) {
  const Tensor &a = c.in(0), &b = c.in(1);
  std::array<std::vector<int64_t>, 2> st{bcast_strides(a.shape(), c.out(0).shape()),
                                         bcast_strides(b.shape(), c.out(0).shape())};
  const int64_t* pa = a.data<int64_t>();
  int64_t* po = c.out(0).data<int64_t>();
  for_each_bcast<2>(c.out(0).shape(), st, [&](int64_t i, const std::array<int64_t, 2>& o) {
    if (b.dtype() == DType::I64) {
      po[i] = ipow(pa[o[0]], b.data<int64_t>()[o[1]], c);
      return;
    }
    const double v = std::trunc(std::pow(static_cast<double>(pa[o[0]]), b.at(o[1])));
    if (!(v >= -9.2233720368547758e18 && v < 9.2233720368547758e18))
      c.error(ErrorKind::InvalidArgument,
              "integer Pow: result " + std::to_string(v) + " does not fit in int64");
    po[i] = static_cast<int64_t>(v);
  });
}
void pow_kernel(KernelCtx& c) {
  if (c.in(0).dtype() == DType::I64) return pow_int_kernel(c);
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& b = c.in(1);
    if (b.dtype() == c.in(0).dtype()) {
      binary_loop<T>(
          c.in(0), b, c.out(0),
          [](T x, T y) -> T { return y == T(2)   ? x * x
                                     : y == T(1) ? x
                                                 : std::pow(x, y); }, kMath);
      return;
    }
    // Mixed exponent dtype: convert it to T first (small: exponents are usually scalars).
    Tensor bt = Tensor::empty(b.shape(), c.in(0).dtype(), c.alloc, Category::Workspace);
    for (int64_t i = 0; i < b.numel(); ++i) bt.data<T>()[i] = static_cast<T>(b.at(i));
    binary_loop<T>(
        c.in(0), bt, c.out(0), [](T x, T y) -> T { return std::pow(x, y); }, kMath);
  });
}

void infer_equal(InferCtx& c) {
  if (c.dtype(0) != c.dtype(1)) c.error(ErrorKind::InvalidModel, "inputs have different dtypes");
  c.set_out(0, DType::Bool, broadcast_all(c));
}
void equal_kernel(KernelCtx& c) {
  dispatch(c.in(0).dtype(), [&]<class T>() {
    binary_loop<T>(c.in(0), c.in(1), c.out(0), [](T x, T y) -> bool { return x == y; });
  });
}

// ---- Where / Sum / Cast
// --------------------------------------------------------------------------
void infer_where(InferCtx& c) {
  if (c.dtype(0) != DType::Bool) c.error(ErrorKind::InvalidModel, "condition must be bool");
  if (c.dtype(1) != c.dtype(2)) c.error(ErrorKind::InvalidModel, "X and Y have different dtypes");
  c.set_out(0, c.dtype(1), broadcast_all(c));
}
void where_kernel(KernelCtx& c) {
  dispatch(c.in(1).dtype(), [&]<class T>() {
    const Shape& os = c.out(0).shape();
    const bool* pc = c.in(0).data<bool>();
    const T* px = c.in(1).data<T>();
    const T* py = c.in(2).data<T>();
    T* po = c.out(0).data<T>();
    const auto p = bcast_rows<3>(os, {&c.in(0).shape(), &c.in(1).shape(), &c.in(2).shape()});
    const int64_t sc = p.ist[0], sx = p.ist[1], sy = p.ist[2];
    for_each_row<3>(p, kCheap, [&](int64_t o, const std::array<int64_t, 3>& off, int64_t len) {
      const bool* cc = pc + off[0];
      const T* x = px + off[1];
      const T* y = py + off[2];
      T* z = po + o;
      if (sc && sx && sy)
        for (int64_t j = 0; j < len; ++j) z[j] = cc[j] ? x[j] : y[j];
      else if (sc && sx)
        for (int64_t j = 0; j < len; ++j) z[j] = cc[j] ? x[j] : *y;
      else if (sc && sy)
        for (int64_t j = 0; j < len; ++j) z[j] = cc[j] ? *x : y[j];
      else
        for (int64_t j = 0; j < len; ++j) z[j] = cc[j * sc] ? x[j * sx] : y[j * sy];
    });
  });
}

void infer_sum(InferCtx& c) {
  for (int i = 1; i < c.n_in(); ++i)
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "inputs have different dtypes");
  require_float(c, 0);
  c.set_out(0, c.dtype(0), broadcast_all(c));
}
void sum_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    Tensor& out = c.out(0);
    T* po = out.data<T>();
    const int64_t n = out.numel();
    for (int k = 0; k < static_cast<int>(c.ins.size()); ++k) {
      const Tensor& a = c.in(k);
      const T* pa = a.data<T>();
      if (k == 0 && pa == po) continue;  // in place on input 0
      if (a.shape() == out.shape()) {
        if (k == 0)
          map1(pa, po, n, kCheap, [](T v) { return v; });
        else
          map2(po, pa, po, n, kCheap, [](T x, T y) { return x + y; });
      } else {
        auto st = bcast_strides(a.shape(), out.shape());
        for_each_bcast<1>(out.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
          po[i] = (k == 0 ? T(0) : po[i]) + pa[o[0]];
        });
      }
    }
  });
}

int onnx_dtype_code(DType d) { return onnx_elem_type(d); }
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

// ---- comparisons and logic (no gradients) -----------------------------------------------------
enum class Cmp { Less, LessEq, Greater, GreaterEq };
template <Cmp op>
void compare_kernel(KernelCtx& c) {
  dispatch(c.in(0).dtype(), [&]<class T>() {
    binary_loop<T>(c.in(0), c.in(1), c.out(0), [](T x, T y) -> bool {
      if constexpr (op == Cmp::Less) return x < y;
      if constexpr (op == Cmp::LessEq) return x <= y;
      if constexpr (op == Cmp::Greater) return x > y;
      if constexpr (op == Cmp::GreaterEq) return x >= y;
    });
  });
}
void infer_logic(InferCtx& c) {
  for (int i = 0; i < c.n_in(); ++i)
    if (c.dtype(i) != DType::Bool) c.error(ErrorKind::InvalidModel, "inputs must be bool");
  c.set_out(0, DType::Bool, broadcast_all(c));
}
enum class Logic { And, Or, Xor };
template <Logic op>
void logic_kernel(KernelCtx& c) {
  binary_loop<bool>(c.in(0), c.in(1), c.out(0), [](bool x, bool y) -> bool {
    if constexpr (op == Logic::And) return x && y;
    if constexpr (op == Logic::Or) return x || y;
    if constexpr (op == Logic::Xor) return x != y;
  });
}
void not_kernel(KernelCtx& c) {
  const bool* x = c.in(0).data<bool>();
  bool* y = c.out(0).data<bool>();
  map1(x, y, c.in(0).numel(), kCheap, [](bool v) { return !v; });
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

// ---- Max / Min (variadic, broadcasting)
// ----------------------------------------------------------
void infer_minmax(InferCtx& c) {
  for (int i = 1; i < c.n_in(); ++i)
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "inputs have different dtypes");
  require_numeric(c, 0);
  c.set_out(0, c.dtype(0), broadcast_all(c));
}
template <bool kMax>
void minmax_kernel(KernelCtx& c) {
  auto run = [&]<class T>() {
    Tensor& out = c.out(0);
    T* po = out.data<T>();
    for (int k = 0; k < static_cast<int>(c.ins.size()); ++k) {
      const T* pa = c.in(k).data<T>();
      auto st = bcast_strides(c.in(k).shape(), out.shape());
      for_each_bcast<1>(out.shape(), {st}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        T v = pa[o[0]];
        po[i] = k == 0 ? v : kMax ? std::max(po[i], v) : std::min(po[i], v);
      });
    }
  };
  dispatch_numeric(c.in(0).dtype(), c, run);
}
// MinMaxGrad(dy, x_0, ..., x_n-1; index = i, is_min) -> dx_i of the broadcast shape: dy where x_i
// is the extreme, split evenly between the inputs that tie (PyTorch's maximum / minimum). The
// extreme is recomputed from the inputs, so the forward's output is not kept (as in PyTorch).
void infer_minmax_grad(InferCtx& c) { c.set_out(0, c.dtype(0), c.shape(0)); }
struct MinMaxGradAttrs {
  int index = 0;  // the input whose gradient this is
  bool is_min = false;
};
std::shared_ptr<const void> prepare_minmax_grad(const Node& n) {
  return prepared(MinMaxGradAttrs{static_cast<int>(n.attrs.get_int("index", 0, n.label())),
                                  n.attrs.get_int("is_min", 0, n.label()) != 0});
}
void minmax_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const int idx = c.attrs<MinMaxGradAttrs>().index;
    const Shape& os = c.out(0).shape();
    const bool is_min = c.attrs<MinMaxGradAttrs>().is_min;
    const int n = static_cast<int>(c.ins.size()) - 1;
    std::vector<std::vector<int64_t>> st(n);
    for (int k = 0; k < n; ++k) st[k] = bcast_strides(c.in(1 + k).shape(), os);
    const T* dy = c.in(0).data<T>();
    std::vector<T> y(numel(os));
    for (int k = 0; k < n; ++k) {
      const T* xk = c.in(1 + k).data<T>();
      for_each_bcast<1>(os, {st[k]}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        const T v = xk[o[0]];
        if (k == 0 || (is_min ? v < y[i] : v > y[i])) y[i] = v;
      });
    }
    T* dx = c.out(0).data<T>();
    // Offsets per input for each output element, one input at a time.
    std::vector<int64_t> ties(numel(os), 0);
    std::vector<char> mine(numel(os), 0);
    for (int k = 0; k < n; ++k) {
      const T* xk = c.in(1 + k).data<T>();
      for_each_bcast<1>(os, {st[k]}, [&](int64_t i, const std::array<int64_t, 1>& o) {
        bool hit = xk[o[0]] == y[i];
        ties[i] += hit;
        if (k == idx) mine[i] = hit;
      });
    }
    for (int64_t i = 0; i < numel(os); ++i)
      dx[i] = mine[i] ? dy[i] / static_cast<T>(ties[i]) : T(0);
  });
}
void grad_minmax(GradBuilder& g) {
  const Node& n = g.node();
  for (int i = 0; i < static_cast<int>(n.inputs.size()); ++i) {
    if (!g.needs(i)) continue;
    std::vector<int> ins{g.dy(0)};
    ins.insert(ins.end(), n.inputs.begin(), n.inputs.end());
    Attrs a;
    a.set_int("index", i);
    a.set_int("is_min", n.op == "Min");
    g.set_dx(i, g.emit1("MinMaxGrad", ins, a, "graft"));
  }
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
void gelu_kernel(KernelCtx& c) {
  const bool th = c.attrs<GeluAttrs>().tanh;
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    const int64_t n = c.in(0).numel();
    if (vec_map(th ? vmath::Fn::GeluTanh : vmath::Fn::GeluErf, x, y, n)) return;
    if (th)
      map1(x, y, n, kMath, [](T v) {
        return T(0.5) * v * (T(1) + std::tanh(T(kSqrt2Pi) * (v + T(0.044715) * v * v * v)));
      });
    else
      map1(x, y, n, kMath, [](T v) { return T(0.5) * v * (T(1) + std::erf(v * T(M_SQRT1_2))); });
  });
}
// GeluGrad(dy, x) -> dx (the Gelu's approximate attribute).
void gelu_grad_kernel(KernelCtx& c) {
  const bool th = c.attrs<GeluAttrs>().tanh;
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T *dy = c.in(0).data<T>(), *x = c.in(1).data<T>();
    T* dx = c.out(0).data<T>();
    const int64_t n = c.in(0).numel();
    if (vec_map2(th ? vmath::Fn2::GeluTanhGrad : vmath::Fn2::GeluErfGrad, dy, x, dx, n)) return;
    if (th)
      map2(dy, x, dx, n, kMath, [](T g, T v) {
        const T t = std::tanh(T(kSqrt2Pi) * (v + T(0.044715) * v * v * v));
        return g * (T(0.5) * (T(1) + t) +
                    T(0.5) * v * (T(1) - t * t) * T(kSqrt2Pi) * (T(1) + T(3 * 0.044715) * v * v));
      });
    else
      map2(dy, x, dx, n, 2 * kMath, [](T g, T v) {
        return g * (T(0.5) * (T(1) + std::erf(v * T(M_SQRT1_2))) +
                    v * std::exp(T(-0.5) * v * v) * T(0.3989422804014327));  // 1 / sqrt(2 pi)
      });
  });
}
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
void grad_add(GradBuilder& g) {
  g.set_dx(0, g.dy(0));
  g.set_dx(1, g.dy(0));
}
void grad_sub(GradBuilder& g) {
  g.set_dx(0, g.dy(0));
  if (g.needs(1)) g.set_dx(1, g.emit1("Neg", {g.dy(0)}));
}
void grad_mul(GradBuilder& g) {
  if (g.needs(0)) g.set_dx(0, g.emit1("Mul", {g.dy(0), g.x(1)}));
  if (g.needs(1)) g.set_dx(1, g.emit1("Mul", {g.dy(0), g.x(0)}));
}
void grad_div(GradBuilder& g) {
  int da = g.emit1("Div", {g.dy(0), g.x(1)});  // dy / b
  if (g.needs(0)) g.set_dx(0, da);
  if (g.needs(1)) g.set_dx(1, g.emit1("Neg", {g.emit1("Mul", {da, g.y(0)})}));  // -(dy/b)*(a/b)
}
void grad_pow(GradBuilder& g) {
  DType dt = g.val(g.x(0)).dtype;
  if (!is_float(dt)) return;  // integer powers carry no gradient
  int b = g.x(1);
  if (g.val(b).dtype != dt) {
    Attrs a;
    a.set_int("to", onnx_dtype_code(dt));
    b = g.emit1("Cast", {b}, a);
  }
  if (g.needs(0)) {
    int t = g.emit1("Pow", {g.x(0), g.emit1("Sub", {b, g.scalar(1, dt)})});
    g.set_dx(0, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), b}), t}));
  }
  if (g.needs(1) && is_float(g.val(g.x(1)).dtype))
    g.set_dx(1, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), g.y(0)}), g.emit1("Log", {g.x(0)})}));
}
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
void grad_relu(GradBuilder& g) { g.set_dx(0, g.emit1("ReluGrad", {g.dy(0), g.y(0)}, {}, "graft")); }
void grad_identity(GradBuilder& g) { g.set_dx(0, g.dy(0)); }
// StopGradient's input never needs a gradient (nondiff_inputs): nothing flows back through it.
void grad_stop(GradBuilder&) {}
// A piecewise-constant op (Sign): its gradient is zero almost everywhere, as in PyTorch.
void grad_zero(GradBuilder& g) {
  g.set_dx(0, g.emit1("Mul", {g.dy(0), g.scalar(0, g.val(g.dy(0)).dtype)}));
}
void grad_where(GradBuilder& g) {
  int zero = g.scalar(0, g.val(g.dy(0)).dtype);
  if (g.needs(1)) g.set_dx(1, g.emit1("Where", {g.x(0), g.dy(0), zero}));
  if (g.needs(2)) g.set_dx(2, g.emit1("Where", {g.x(0), zero, g.dy(0)}));
}
void grad_sum(GradBuilder& g) {
  for (size_t i = 0; i < g.node().inputs.size(); ++i) g.set_dx(static_cast<int>(i), g.dy(0));
}
void grad_cast(GradBuilder& g) {
  DType src = g.val(g.x(0)).dtype;
  if (!is_float(src)) return;
  Attrs a;
  a.set_int("to", onnx_dtype_code(src));
  g.set_dx(0, g.emit1("Cast", {g.dy(0)}, a));
}

const OpDef kOps[] = {
    {.name = "Neg", .infer = infer_neg, .kernel = neg_kernel, .grad = grad_neg, .inplace_input = 0},
    {.name = "Reciprocal",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ReciprocalF>,
     .grad = grad_reciprocal,
     .inplace_input = 0},
    {.name = "Sqrt",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SqrtF>,
     .grad = grad_sqrt,
     .inplace_input = 0},
    {.name = "Exp",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ExpF>,
     .grad = grad_exp,
     .inplace_input = 0},
    {.name = "Sin", .infer = infer_unary_float, .kernel = unary_kernel<SinF>, .grad = grad_sin},
    {.name = "Cos", .infer = infer_unary_float, .kernel = unary_kernel<CosF>, .grad = grad_cos},
    {.name = "Log",
     .infer = infer_unary_float,
     .kernel = unary_kernel<LogF>,
     .grad = grad_log,
     .inplace_input = 0},
    {.name = "Erf",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ErfF>,
     .grad = grad_erf,
     .inplace_input = 0},
    {.name = "Tanh",
     .infer = infer_unary_float,
     .kernel = unary_kernel<TanhF>,
     .grad = grad_tanh,
     .inplace_input = 0},
    {.name = "Sigmoid",
     .infer = infer_unary_float,
     .kernel = unary_kernel<SigmoidF>,
     .grad = grad_sigmoid,
     .inplace_input = 0},
    {.name = "Relu",
     .infer = infer_unary_float,
     .kernel = unary_kernel<ReluF>,
     .grad = grad_relu,
     .inplace_input = 0},
    {.name = "Identity",
     .infer = infer_same,
     .grad = grad_identity,
     .alias = true,
     .copy_like = true},
    // graft's own: the value as it is, a constant for autodiff (where eager's autograd stops a
    // gradient: detach(), torch.no_grad; python/graft/_aten.py, Note [capture]).
    {.name = "StopGradient",
     .domain = "graft",
     .infer = infer_same,
     .grad = grad_stop,
     .alias = true,
     .nondiff_inputs = {0}},
    {.name = "Add",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Add>,
     .grad = grad_add,
     .inplace_input = 0},
    {.name = "Sub",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Sub>,
     .grad = grad_sub,
     .inplace_input = 0},
    {.name = "Mul",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Mul>,
     .grad = grad_mul,
     .inplace_input = 0},
    {.name = "Div",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Div>,
     .grad = grad_div,
     .inplace_input = 0},
    {.name = "Pow",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_pow,
     .kernel = pow_kernel,
     .grad = grad_pow,
     .inplace_input = 0},
    {.name = "Equal", .min_in = 2, .max_in = 2, .infer = infer_equal, .kernel = equal_kernel},
    {.name = "Where",
     .min_in = 3,
     .max_in = 3,
     .infer = infer_where,
     .kernel = where_kernel,
     .grad = grad_where,
     .inplace_input = 1,  // over x (reads each element before writing it)
     .nondiff_inputs = {0}},
    {.name = "Sum",
     .max_in = 1 << 20,
     .infer = infer_sum,
     .kernel = sum_kernel,
     .grad = grad_sum,
     .inplace_input = 0},
    {.name = "Cast",
     .infer = infer_cast,
     .kernel = cast_kernel,
     .grad = grad_cast,
     .copy_like = true},
    // comparisons and logic
    {.name = "Less",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_equal,
     .kernel = compare_kernel<Cmp::Less>},
    {.name = "LessOrEqual",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_equal,
     .kernel = compare_kernel<Cmp::LessEq>},
    {.name = "Greater",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_equal,
     .kernel = compare_kernel<Cmp::Greater>},
    {.name = "GreaterOrEqual",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_equal,
     .kernel = compare_kernel<Cmp::GreaterEq>},
    {.name = "And",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_logic,
     .kernel = logic_kernel<Logic::And>},
    {.name = "Or",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_logic,
     .kernel = logic_kernel<Logic::Or>},
    {.name = "Xor",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_logic,
     .kernel = logic_kernel<Logic::Xor>},
    {.name = "Not", .infer = infer_logic, .kernel = not_kernel},
    // pointwise with kinks
    {.name = "Abs",
     .infer = infer_signed,
     .kernel = abs_sign_kernel<false>,
     .grad = grad_abs,
     .inplace_input = 0},
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
     .nondiff_inputs = {1, 2}},
    {.name = "Max",
     .max_in = 1 << 20,
     .infer = infer_minmax,
     .kernel = minmax_kernel<true>,
     .grad = grad_minmax},
    {.name = "Min",
     .max_in = 1 << 20,
     .infer = infer_minmax,
     .kernel = minmax_kernel<false>,
     .grad = grad_minmax},
    {.name = "HardSigmoid",
     .infer = infer_unary_float,
     .prepare = prepare_hard,
     .kernel = hard_sigmoid_kernel,
     .grad = grad_hard_sigmoid,
     .inplace_input = 0},
    {.name = "HardSwish",
     .infer = infer_unary_float,
     .kernel = hard_swish_kernel,
     .grad = grad_hard_swish,
     .inplace_input = 0},
    {.name = "ClipGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 4,
     .infer = infer_grad_same1,
     .kernel = clip_grad_kernel,
     .inplace_input = 0},
    {.name = "MinMaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 1 << 20,
     .infer = infer_minmax_grad,
     .prepare = prepare_minmax_grad,
     .kernel = minmax_grad_kernel},
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
     .kernel = grad2_kernel<ReluGradF>,
     .inplace_input = 0},
    {.name = "SigmoidGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_grad2,
     .kernel = grad2_kernel<SigmoidGradF>,
     .inplace_input = 0},
    {.name = "Gelu",
     .infer = infer_unary_float,
     .prepare = prepare_gelu,
     .kernel = gelu_kernel,
     .grad = grad_gelu},
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
     .grad = grad_silu},
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

namespace opsutil {
int onnx_dtype_code_of(DType d) { return onnx_dtype_code(d); }
}  // namespace opsutil

void register_elementwise_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
