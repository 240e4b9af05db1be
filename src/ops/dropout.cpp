// Dropout (a Bernoulli mask scaled by 1 / (1 - ratio) in training mode, else the identity) and
// graft's RRelu (RReLU in training mode: a random slope per element), seeded by the run's seed
// (RunOptions::seed: a TrainSession's counter, rng_state()), drawn from graft's counter-based
// stream (opsutil::splitmix64) in parallel.

#include <cmath>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- Dropout ------------------------------------------------------------------------------------
// Identity unless training_mode is true and ratio > 0; then a Bernoulli mask scaled by 1/(1-p).
bool dropout_active(const Tensor* ratio, const Tensor* training, double& p) {
  p = ratio ? ratio->at(0) : 0.5;
  bool train = training && training->at(0) != 0;
  return train && p > 0;
}
// ratio and training_mode do not change the output shapes: they may be graph inputs, read by the
// kernel at run time (the gradient rule needs them constant).
void infer_dropout(InferCtx& c) {
  require_float(c, 0);
  if (c.has_in(1)) {
    if (!is_float(c.dtype(1))) c.error(ErrorKind::Unsupported, "ratio must be float32 or float64");
    c.check(numel(c.shape(1)) == 1, "ratio must be a scalar, got shape " + shape_str(c.shape(1)));
  }
  if (c.has_in(2)) {
    if (c.dtype(2) != DType::Bool) c.error(ErrorKind::InvalidModel, "training_mode must be bool");
    c.check(numel(c.shape(2)) == 1,
            "training_mode must be a scalar, got shape " + shape_str(c.shape(2)));
  }
  c.set_out(0, c.dtype(0), c.shape(0));
  c.set_out(1, DType::Bool, c.shape(0));
  double p = c.const_in(1) ? c.const_in(1)->at(0) : 0.5;
  if (p < 0 || p >= 1)
    c.error(ErrorKind::InvalidModel, "ratio " + std::to_string(p) + " is not in [0, 1)");
}
struct DropoutAttrs {
  uint64_t stream = 0;  // node_stream of the seed attribute and the node's name
};
std::shared_ptr<const void> prepare_dropout(const Node& n) {
  return prepared(DropoutAttrs{node_stream(n.attrs.get_int("seed", 0, n.label()), n.name)});
}
void dropout_kernel(KernelCtx& c) {
  const Tensor& x = c.in(0);
  double p;
  bool active =
      dropout_active(c.has_in(1) ? &c.in(1) : nullptr, c.has_in(2) ? &c.in(2) : nullptr, p);
  if (c.has_in(1) && !(p >= 0 && p < 1))
    c.error(ErrorKind::InvalidArgument, "ratio " + std::to_string(p) + " is not in [0, 1)");
  bool* mask = c.has_out(1) ? c.out(1).data<bool>() : nullptr;
  dispatch_float(x.dtype(), c, [&]<class T>() {
    const T* px = x.data<T>();
    T* py = c.out(0).data<T>();
    if (!active) {
      if (py != px) std::copy(px, px + x.numel(), py);
      if (mask) std::fill(mask, mask + x.numel(), true);
      return;
    }
    // Note [attention dropout]'s stream (opsutil::keep_at): drawn by position, so in parallel.
    const uint64_t base = stream_base(c.seed, c.attrs<DropoutAttrs>().stream);
    const uint64_t threshold = keep_threshold(p);
    const T scale = static_cast<T>(1.0 / (1.0 - p));
    parallel_for(x.numel(), 8, [&](int, int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const bool k = keep_at(base, static_cast<uint64_t>(i), threshold);
        if (mask) mask[i] = k;
        py[i] = k ? px[i] * scale : T(0);
      }
    });
  });
}
void grad_dropout(GradBuilder& g) {
  const Node& n = g.node();
  auto in_t = [&](int i) -> const Tensor* {
    if (i >= static_cast<int>(n.inputs.size()) || n.inputs[i] < 0) return nullptr;
    const Value& v = g.val(n.inputs[i]);
    if (v.kind != ValueKind::Constant || !v.data.defined())
      fail(ErrorKind::Unsupported, n.label() + ": the gradient of Dropout needs a constant " +
                                       (i == 1 ? "ratio" : "training_mode") + "; '" + v.name +
                                       "' is computed at run time");
    return &v.data;
  };
  double p;
  if (!dropout_active(in_t(1), in_t(2), p)) {
    g.set_dx(0, g.dy(0));
    return;
  }
  int mask = g.y(1);
  DType dt = g.val(g.dy(0)).dtype;
  Attrs a;
  a.set_int("to", onnx_dtype_code_of(dt));
  int m = g.emit1("Cast", {mask}, a);
  g.set_dx(0, g.emit1("Mul", {g.emit1("Mul", {g.dy(0), m}), g.scalar(1.0 / (1.0 - p), dt)}));
}

// ---- graft's RRelu ------------------------------------------------------------------------------
// RRelu(X; lower, upper, seed) -> Y, Slope: PyTorch's rrelu in training mode. Where x <= 0 the
// slope is drawn uniformly from [lower, upper) (graft's stream, not PyTorch's generator, as
// Dropout's masks), elsewhere it is 1; Y = X * Slope. Its gradient is dY * Slope (the slope kept,
// as eager keeps its noise tensor).
struct RReluAttrs {
  double lower = 1.0 / 8, upper = 1.0 / 3;
  uint64_t stream = 0;
};
RReluAttrs rrelu_attrs(const Node& n) {
  const std::string where = n.label();
  RReluAttrs a;
  a.lower = n.attrs.get_float("lower", 1.0 / 8, where);
  a.upper = n.attrs.get_float("upper", 1.0 / 3, where);
  a.stream = node_stream(n.attrs.get_int("seed", 0, where), n.name);
  if (!(a.lower <= a.upper) || !std::isfinite(a.lower) || !std::isfinite(a.upper))
    fail_at(ErrorKind::InvalidModel, n.name,
            where + ": RRelu needs finite lower <= upper (got " + std::to_string(a.lower) + ", " +
                std::to_string(a.upper) + ")");
  return a;
}
std::shared_ptr<const void> prepare_rrelu(const Node& n) { return prepared(rrelu_attrs(n)); }
void infer_rrelu(InferCtx& c) {
  require_float(c, 0);
  rrelu_attrs(c.node());
  c.set_out(0, c.dtype(0), c.shape(0));
  c.set_out(1, c.dtype(0), c.shape(0));
}
void rrelu_kernel(KernelCtx& c) {
  const RReluAttrs& a = c.attrs<RReluAttrs>();
  const uint64_t base = stream_base(c.seed, a.stream);
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const T* px = c.in(0).data<T>();
    T* py = c.out(0).data<T>();
    T* ps = c.has_out(1) ? c.out(1).data<T>() : nullptr;
    parallel_for(c.in(0).numel(), 8, [&](int, int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        T s = T(1);
        if (px[i] <= T(0))
          s = static_cast<T>(a.lower +
                             (a.upper - a.lower) * uniform_at(base, static_cast<uint64_t>(i)));
        if (ps) ps[i] = s;
        py[i] = px[i] * s;
      }
    });
  });
}
void grad_rrelu(GradBuilder& g) { g.set_dx(0, g.emit1("Mul", {g.dy(0), g.y(1)})); }

const OpDef kOps[] = {
    {.name = "RRelu",
     .domain = "graft",
     .max_out = 2,
     .infer = infer_rrelu,
     .prepare = prepare_rrelu,
     .kernel = rrelu_kernel,
     .grad = grad_rrelu,
     .foldable = false,
     .random = true,
     .recompute = false},
    {.name = "Dropout",
     .max_in = 3,
     .max_out = 2,
     .infer = infer_dropout,
     .prepare = prepare_dropout,
     .kernel = dropout_kernel,
     .grad = grad_dropout,
     .foldable = false,
     .nondiff_inputs = {1, 2},
     .random = true,
     .recompute = false},
};

}  // namespace

void register_dropout_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
