// How a parameter's complete gradient leaves a training step: one small class per gradient mode.
// Internal to src/train (TrainSession owns one; see Note [Gradient delivery] in delivery.cpp).
#pragma once

#include <functional>
#include <vector>

#include "graft/train.h"

namespace graft {

class Delivery {
 public:
  virtual ~Delivery() = default;
  // p's gradient is complete: at its sink during backward (accumulate, hook, step), or after the
  // backward (hold). `exclusive`: the run held the only reference to grad's block. `defer`: the
  // step's backward accumulates (step mode with micro-batches, StepState::defer_step).
  virtual void deliver(Parameter& p, Tensor grad, bool exclusive, bool defer) = 0;
  // Whether a weight-gradient GEMM feeding p's sink may add straight into an existing .grad.
  virtual bool adds_into_grad(bool defer) const {
    (void)defer;
    return false;
  }
  // A step's backward begins (after its forward); `defer` as above.
  virtual void begin_backward(bool defer) { (void)defer; }
};

// hold and accumulate: the gradient goes into .grad, adopted without a copy when .grad is None
// and the run held the only reference, otherwise added in place.
class IntoGrad final : public Delivery {
 public:
  IntoGrad(Allocator& alloc, bool accumulate) : alloc_(alloc), accumulate_(accumulate) {}
  void deliver(Parameter& p, Tensor grad, bool exclusive, bool defer) override;
  bool adds_into_grad(bool) const override { return accumulate_; }

 private:
  Allocator& alloc_;
  bool accumulate_;
};

// hook: the user's callback gets (parameter, gradient); graft drops its reference on return.
class HookDelivery final : public Delivery {
 public:
  explicit HookDelivery(const GradHook& hook) : hook_(hook) {}
  void deliver(Parameter& p, Tensor grad, bool, bool) override {
    if (hook_) hook_(p, grad);
  }

 private:
  const GradHook& hook_;  // the session's (set_hook may replace it)
};

// step: the optimizer's update (or a front end's per-parameter hook) applied the moment a
// gradient is complete, which is then freed; deferred micro-batches accumulate into .grad first;
// global-norm clipping runs a norm-only pass before the updating one (TrainSession::step).
class StepDelivery final : public Delivery {
 public:
  StepDelivery(Allocator& alloc, const GradHook& hook)
      : into_(alloc, true), alloc_(alloc), hook_(hook) {}
  void deliver(Parameter& p, Tensor grad, bool exclusive, bool defer) override;
  bool adds_into_grad(bool defer) const override { return defer; }
  void begin_backward(bool defer) override;

  // `index[i]`: the optimizer's index of session parameter i, -1 if it does not update it.
  void set_optimizer(Optimizer* opt, const Parameter* first, std::vector<int> index);
  Optimizer* optimizer() const { return opt_; }
  // The norm-only pass of a clipped step: gradients are reduced to their sum of squares.
  void begin_norm_pass() { norm_pass_ = true, sumsq_ = 0; }
  double end_norm_pass();  // the global norm; clears the pass
  bool in_norm_pass() const { return norm_pass_; }
  // The factor every gradient of the updating pass is scaled by (1: none).
  void set_clip_coef(double c) { clip_coef_ = c; }

 private:
  IntoGrad into_;
  Allocator& alloc_;
  const GradHook& hook_;
  Optimizer* opt_ = nullptr;
  const Parameter* first_ = nullptr;  // the session's parameters (index_ is by position)
  std::vector<int> index_;
  bool norm_pass_ = false;
  double sumsq_ = 0, clip_coef_ = 1;
};

// Sums of squares and scaling over float32 / float64 tensors (clipping).
double sum_squares(const Tensor& t);
void scale_inplace(Tensor& t, double c);
double clip_coef(double norm, double max_norm);

}  // namespace graft
