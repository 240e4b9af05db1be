// Broadcasting elementwise ops of two or more inputs and their gradients: Add, Sub, Mul, Div,
// Pow, graft's Atan2, Equal, Less, LessOrEqual, Greater, GreaterOrEqual, And, Or, Xor (and Not),
// Where, Sum, Max, Min, with graft's MinMaxGrad. Ops of one input are in unary.cpp.
#include <cmath>
#include <limits>
#include <type_traits>

#include "elementwise.h"

namespace graft {
namespace {
using namespace opsutil;

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
    if (b.numel() == 1 && c.out(0).shape() == c.in(0).shape()) {
      // One exponent (x ** 3 in GELU's tanh form, x ** 2 in its gradient and in RMSNorm): small
      // integer and half powers by multiplication or sqrt, as PyTorch's pow with a scalar does,
      // in a loop the compiler vectorizes; other exponents by std::pow.
      const T e = static_cast<T>(b.at(0));
      const T* x = c.in(0).data<T>();
      T* y = c.out(0).data<T>();
      auto each = [&](int64_t cost, auto f) { map1(x, y, c.in(0).numel(), cost, f); };
      if (e == T(2))
        each(kCheap, [](T v) { return v * v; });
      else if (e == T(3))
        each(kCheap, [](T v) { return v * v * v; });
      else if (e == T(1))
        each(kCheap, [](T v) { return v; });
      else if (e == T(0.5))
        each(kCheap, [](T v) { return std::sqrt(v); });
      else
        each(kMath, [e](T v) { return std::pow(v, e); });
      return;
    }
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

// graft's Atan2(Y, X) = atan2(y, x), broadcasting (ONNX has no such op; torch.atan2).
void infer_atan2(InferCtx& c) {
  require_float(c, 0);
  infer_arith(c);
}
void atan2_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    binary_loop<T>(
        c.in(0), c.in(1), c.out(0), [](T y, T x) -> T { return std::atan2(y, x); }, kMath);
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

// ---- Where / Sum --------------------------------------------------------------------------------
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
    a.set_int("to", onnx_dtype_code_of(dt));
    b = g.emit1("Cast", {b}, a);
  }
  if (g.needs(0)) {
    int t = g.emit1("Pow", {g.x(0), g.emit1("Sub", {b, g.scalar(1, dt)})});
    g.set_dx(0, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), b}), t}));
  }
  if (g.needs(1) && is_float(g.val(g.x(1)).dtype))
    g.set_dx(1, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), g.y(0)}), g.emit1("Log", {g.x(0)})}));
}
// d atan2(y, x) = (x dy - y dx) / (x^2 + y^2), as PyTorch's (NaN at the origin, as there).
void grad_atan2(GradBuilder& g) {
  const int y = g.x(0), x = g.x(1);
  const int r2 = g.emit1("Add", {g.emit1("Mul", {x, x}), g.emit1("Mul", {y, y})});
  const int k = g.emit1("Div", {g.dy(0), r2});
  if (g.needs(0)) g.set_dx(0, g.emit1("Mul", {k, x}));
  if (g.needs(1)) g.set_dx(1, g.emit1("Neg", {g.emit1("Mul", {k, y})}));
}
void grad_where(GradBuilder& g) {
  int zero = g.scalar(0, g.val(g.dy(0)).dtype);
  if (g.needs(1)) g.set_dx(1, g.emit1("Where", {g.x(0), g.dy(0), zero}));
  if (g.needs(2)) g.set_dx(2, g.emit1("Where", {g.x(0), zero, g.dy(0)}));
}
void grad_sum(GradBuilder& g) {
  for (size_t i = 0; i < g.node().inputs.size(); ++i) g.set_dx(static_cast<int>(i), g.dy(0));
}
const OpDef kOps[] = {
    {.name = "Add",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Add>,
     .grad = grad_add,
     .inplace_input = 0,
     .pointwise = true,
     .blocked = blocked_elementwise},
    {.name = "Sub",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Sub>,
     .grad = grad_sub,
     .inplace_input = 0,
     .pointwise = true,
     .blocked = blocked_elementwise},
    {.name = "Mul",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Mul>,
     .grad = grad_mul,
     .inplace_input = 0,
     .pointwise = true,
     .blocked = blocked_elementwise},
    {.name = "Div",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_arith,
     .kernel = arith_kernel<Bin::Div>,
     .grad = grad_div,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Pow",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_pow,
     .kernel = pow_kernel,
     .grad = grad_pow,
     .inplace_input = 0,
     .pointwise = true},
    {.name = "Atan2",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_atan2,
     .kernel = atan2_kernel,
     .grad = grad_atan2,
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
     .inplace_input = 0,
     .blocked = blocked_elementwise},
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
    {.name = "MinMaxGrad",
     .domain = "graft",
     .min_in = 2,
     .max_in = 1 << 20,
     .infer = infer_minmax_grad,
     .prepare = prepare_minmax_grad,
     .kernel = minmax_grad_kernel},
};

}  // namespace

void register_binary_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
