// Unary math beyond unary.cpp's basics: the trigonometric and hyperbolic functions and their
// inverses (ONNX's Tan, Asin, Acos, Atan, Sinh, Cosh, Asinh, Acosh, Atanh), rounding (Floor,
// Ceil, Round: half to even, as PyTorch; graft's Trunc), and graft's Expm1 and Log1p, which keep
// their precision near 0 where exp(x) - 1 and log(1 + x) lose it. Scalar libm per element,
// threaded; gradients are compositions of table ops, zero for the rounding ops (as in PyTorch).
#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

constexpr int64_t kMath = 16;  // a libm call costs about 16 adds (the parallel split's unit)

template <class Op>
void math_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* x = c.in(0).data<T>();
    T* y = c.out(0).data<T>();
    parallel_elems(c.in(0).numel(), kMath, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) y[i] = Op::template f<T>(x[i]);
    });
  });
}
void infer_math(InferCtx& c) {
  require_float(c, 0);
  infer_same(c);
}

#define GRAFT_MATH_OP(Name, expr)  \
  struct Name {                    \
    template <class T>             \
    static T f(T x) {              \
      return static_cast<T>(expr); \
    }                              \
  };
GRAFT_MATH_OP(TanF, std::tan(x))
GRAFT_MATH_OP(AsinF, std::asin(x))
GRAFT_MATH_OP(AcosF, std::acos(x))
GRAFT_MATH_OP(AtanF, std::atan(x))
GRAFT_MATH_OP(SinhF, std::sinh(x))
GRAFT_MATH_OP(CoshF, std::cosh(x))
GRAFT_MATH_OP(AsinhF, std::asinh(x))
GRAFT_MATH_OP(AcoshF, std::acosh(x))
GRAFT_MATH_OP(AtanhF, std::atanh(x))
GRAFT_MATH_OP(FloorF, std::floor(x))
GRAFT_MATH_OP(CeilF, std::ceil(x))
GRAFT_MATH_OP(RoundF, std::nearbyint(x))  // the default rounding mode: half to even
GRAFT_MATH_OP(TruncF, std::trunc(x))
GRAFT_MATH_OP(Expm1F, std::expm1(x))
GRAFT_MATH_OP(Log1pF, std::log1p(x))
#undef GRAFT_MATH_OP

// dX = dY * f'(x), f' written with the table's ops on x (or on y where that is cheaper).
int one(GradBuilder& g) { return g.scalar(1, g.val(g.x(0)).dtype); }
int sq(GradBuilder& g, int v) { return g.emit1("Mul", {v, v}); }
void set_mul(GradBuilder& g, int d) { g.set_dx(0, g.emit1("Mul", {g.dy(0), d})); }
void set_div(GradBuilder& g, int d) { g.set_dx(0, g.emit1("Div", {g.dy(0), d})); }

void grad_tan(GradBuilder& g) { set_mul(g, g.emit1("Add", {one(g), sq(g, g.y(0))})); }  // 1 + y^2
void grad_asin(GradBuilder& g) {  // 1 / sqrt(1 - x^2)
  set_div(g, g.emit1("Sqrt", {g.emit1("Sub", {one(g), sq(g, g.x(0))})}));
}
void grad_acos(GradBuilder& g) {  // -1 / sqrt(1 - x^2)
  g.set_dx(
      0, g.emit1("Neg",
                 {g.emit1("Div",
                          {g.dy(0), g.emit1("Sqrt", {g.emit1("Sub", {one(g), sq(g, g.x(0))})})})}));
}
void grad_atan(GradBuilder& g) { set_div(g, g.emit1("Add", {one(g), sq(g, g.x(0))})); }
void grad_sinh(GradBuilder& g) { set_mul(g, g.emit1("Cosh", {g.x(0)})); }
void grad_cosh(GradBuilder& g) { set_mul(g, g.emit1("Sinh", {g.x(0)})); }
void grad_asinh(GradBuilder& g) {
  set_div(g, g.emit1("Sqrt", {g.emit1("Add", {sq(g, g.x(0)), one(g)})}));
}
void grad_acosh(GradBuilder& g) {
  set_div(g, g.emit1("Sqrt", {g.emit1("Sub", {sq(g, g.x(0)), one(g)})}));
}
void grad_atanh(GradBuilder& g) { set_div(g, g.emit1("Sub", {one(g), sq(g, g.x(0))})); }
void grad_expm1(GradBuilder& g) { set_mul(g, g.emit1("Add", {g.y(0), one(g)})); }
void grad_log1p(GradBuilder& g) { set_div(g, g.emit1("Add", {g.x(0), one(g)})); }
// Piecewise constant: zero almost everywhere, as PyTorch's.
void grad_rounding(GradBuilder& g) { set_mul(g, g.scalar(0, g.val(g.dy(0)).dtype)); }

const OpDef kOps[] = {
    {.name = "Tan", .infer = infer_math, .kernel = math_kernel<TanF>, .grad = grad_tan},
    {.name = "Asin", .infer = infer_math, .kernel = math_kernel<AsinF>, .grad = grad_asin},
    {.name = "Acos", .infer = infer_math, .kernel = math_kernel<AcosF>, .grad = grad_acos},
    {.name = "Atan", .infer = infer_math, .kernel = math_kernel<AtanF>, .grad = grad_atan},
    {.name = "Sinh", .infer = infer_math, .kernel = math_kernel<SinhF>, .grad = grad_sinh},
    {.name = "Cosh", .infer = infer_math, .kernel = math_kernel<CoshF>, .grad = grad_cosh},
    {.name = "Asinh", .infer = infer_math, .kernel = math_kernel<AsinhF>, .grad = grad_asinh},
    {.name = "Acosh", .infer = infer_math, .kernel = math_kernel<AcoshF>, .grad = grad_acosh},
    {.name = "Atanh", .infer = infer_math, .kernel = math_kernel<AtanhF>, .grad = grad_atanh},
    {.name = "Floor", .infer = infer_math, .kernel = math_kernel<FloorF>, .grad = grad_rounding},
    {.name = "Ceil", .infer = infer_math, .kernel = math_kernel<CeilF>, .grad = grad_rounding},
    {.name = "Round", .infer = infer_math, .kernel = math_kernel<RoundF>, .grad = grad_rounding},
    {.name = "Trunc",
     .domain = "graft",
     .infer = infer_math,
     .kernel = math_kernel<TruncF>,
     .grad = grad_rounding},
    {.name = "Expm1",
     .domain = "graft",
     .infer = infer_math,
     .kernel = math_kernel<Expm1F>,
     .grad = grad_expm1},
    {.name = "Log1p",
     .domain = "graft",
     .infer = infer_math,
     .kernel = math_kernel<Log1pF>,
     .grad = grad_log1p},
};

}  // namespace

void register_math_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
