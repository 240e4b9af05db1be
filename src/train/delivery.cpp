// Gradient delivery, one class per mode (delivery.h).
//
// Note [Gradient delivery]
// hold:       parameter gradients are kept values of the run; after backward ends they are added
//             into .grad (the old ORTModule behaviour: every gradient is alive at the end).
// accumulate: a graft.GradSink runs as soon as a gradient is complete (sink-first order, see the
//             planner); the gradient is added in place into .grad, or adopted as .grad without a
//             copy when .grad is None and the executor held the only reference; then released.
// hook:       the same moment, the user's callback gets (parameter, gradient view); graft releases
//             the buffer when the callback returns.
// step:       the same moment, the optimizer updates the parameter and the gradient is freed.
// All run the same nodes in the same order, so their gradients are bit-identical.
#include "delivery.h"

#include <algorithm>
#include <cmath>

#include "graft/ops.h"

namespace graft {

void add_inplace(Tensor& dst, const Tensor& src) {
  GRAFT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), ErrorKind::ShapeMismatch,
              "add_inplace: cannot add " + std::string(dtype_name(src.dtype())) + " " +
                  shape_str(src.shape()) + " into " + dtype_name(dst.dtype()) + " " +
                  shape_str(dst.shape()));
  if (!is_float(dst.dtype())) fail(ErrorKind::Internal, "add_inplace on a non-float tensor");
  add_elements(dst, src);  // threaded, vectorized
}

void accumulate_grad(Parameter& p, const Tensor& grad) {
  if (!p.grad.defined())
    p.grad = grad.reshaped(p.data.shape());  // adopt: no copy
  else
    add_inplace(p.grad, grad);
}

void IntoGrad::deliver(Parameter& p, Tensor grad, bool exclusive, bool) {
  if (p.grad.defined())
    GRAFT_CHECK(
        p.grad.dtype() == grad.dtype() && p.grad.numel() == grad.numel(), ErrorKind::ShapeMismatch,
        "parameter '" + p.name + "': its .grad is " + dtype_name(p.grad.dtype()) + " " +
            shape_str(p.grad.shape()) + " but its gradient is " + dtype_name(grad.dtype()) + " " +
            shape_str(p.data.shape()) + " (assign a .grad of the parameter's shape, or None)");
  if (p.grad.defined() && grad.storage() == p.grad.storage()) return;  // added in place already
  if (!p.grad.defined()) {
    if (exclusive && grad.storage()->owner == &alloc_) {
      alloc_.recategorize(*grad.storage(), Category::Gradient);  // adopt: no copy
      p.grad = grad.reshaped(p.data.shape());
    } else {
      p.grad = grad.clone(alloc_, Category::Gradient).reshaped(p.data.shape());
    }
    return;
  }
  add_inplace(p.grad, grad);
}

namespace {
// The sum of squares of a + b (an accumulated .grad and a new gradient), without forming it.
double sum_squares_of_sum(const Tensor& a, const Tensor& b) {
  double acc = 0;
  if (a.dtype() == DType::F32) {
    const float *x = a.data<float>(), *y = b.data<float>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double v = static_cast<double>(x[i] + y[i]);
      acc += v * v;
    }
  } else if (a.dtype() == DType::F64) {
    const double *x = a.data<double>(), *y = b.data<double>();
    for (int64_t i = 0; i < a.numel(); ++i) acc += (x[i] + y[i]) * (x[i] + y[i]);
  }
  return acc;
}
}  // namespace

double sum_squares(const Tensor& t) {
  double acc = 0;
  if (t.dtype() == DType::F32) {
    const float* d = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) acc += static_cast<double>(d[i]) * d[i];
  } else if (t.dtype() == DType::F64) {
    const double* d = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) acc += d[i] * d[i];
  }
  return acc;
}

void scale_inplace(Tensor& t, double c) {
  if (t.dtype() == DType::F32) {
    float* d = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) d[i] = static_cast<float>(d[i] * c);
  } else if (t.dtype() == DType::F64) {
    double* d = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) d[i] *= c;
  }
}

double clip_coef(double norm, double max_norm) { return std::min(1.0, max_norm / (norm + 1e-6)); }

double clip_grad_norm(const std::vector<Parameter*>& params, double max_norm) {
  double sumsq = 0;
  for (const Parameter* p : params)
    if (p->grad.defined()) sumsq += sum_squares(p->grad);
  const double norm = std::sqrt(sumsq), c = clip_coef(norm, max_norm);
  if (c < 1)
    for (Parameter* p : params)
      if (p->grad.defined()) scale_inplace(p->grad, c);
  return norm;
}

void StepDelivery::set_optimizer(Optimizer* opt, const Parameter* first, std::vector<int> index) {
  opt_ = opt;
  first_ = first;
  index_ = std::move(index);
}

void StepDelivery::begin_backward(bool defer) {
  // One backward that is not deferred is one optimizer step (the norm pass updates nothing).
  if (!defer && opt_ && !norm_pass_) opt_->begin_step();
}

double StepDelivery::end_norm_pass() {
  norm_pass_ = false;
  return std::sqrt(sumsq_);
}

void StepDelivery::deliver(Parameter& p, Tensor grad, bool exclusive, bool defer) {
  if (norm_pass_) {  // clipping's first pass: the norm only
    sumsq_ += p.grad.defined() ? sum_squares_of_sum(p.grad, grad) : sum_squares(grad);
    return;
  }
  if (defer) {  // a micro-batch: accumulate as accumulate mode does
    into_.deliver(p, std::move(grad), exclusive, defer);
    return;
  }
  // The update, now; the gradient (and any .grad accumulated by deferred micro-batches) is freed
  // when this returns. A parameter the optimizer does not update keeps nothing.
  if (p.grad.defined()) {
    if (grad.storage() != p.grad.storage()) add_inplace(p.grad, grad);
    grad = p.grad;
    p.grad = Tensor();
  }
  if (clip_coef_ < 1) {
    if (!exclusive && grad.storage() != p.grad.storage())
      grad = grad.clone(alloc_, Category::Gradient);
    scale_inplace(grad, clip_coef_);
  }
  if (opt_) {
    const int i = index_[&p - first_];
    if (i >= 0) opt_->update(static_cast<size_t>(i), grad);
  } else if (hook_) {
    hook_(p, grad);  // a front end's own optimizer (GraftModule's torch.optim, per parameter)
  }
}

}  // namespace graft
