// Optimizers, updating parameters in place with PyTorch 1.13's formulas (torch.optim.SGD and
// torch.optim.AdamW, single-tensor path), so graft and eager PyTorch stay in step.
#include <cmath>
#include <cstring>

#include "graft/train.h"

namespace graft {

void Optimizer::zero_grad(bool set_to_none) {
  for (Parameter* p : params_) {
    if (set_to_none) p->grad = Tensor();
    else if (p->grad.defined()) std::memset(p->grad.raw(), 0, p->grad.nbytes());
  }
}

namespace {
template <class F>
void by_dtype(const Tensor& t, F&& f) {
  if (t.dtype() == DType::F32) f.template operator()<float>();
  else if (t.dtype() == DType::F64) f.template operator()<double>();
  else fail(ErrorKind::InvalidArgument, "optimizers update float parameters only");
}
}  // namespace

SGD::SGD(std::vector<Parameter*> params, SGDOptions o, Allocator* alloc)
    : options(o), alloc_(alloc ? alloc : &Allocator::global()) {
  GRAFT_CHECK(o.lr >= 0 && o.momentum >= 0 && o.weight_decay >= 0, ErrorKind::InvalidArgument,
              "SGD: lr, momentum and weight_decay must be >= 0");
  GRAFT_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), ErrorKind::InvalidArgument,
              "SGD: nesterov needs momentum > 0 and dampening = 0");
  params_ = std::move(params);
  buf_.resize(params_.size());
}

void SGD::step() {
  ++t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad.defined()) continue;  // like PyTorch: a parameter with grad None is skipped
    by_dtype(p.data, [&]<class T>() {
      T* w = p.data.data<T>();
      const T* g = p.grad.data<T>();
      const int64_t n = p.data.numel();
      const T lr = static_cast<T>(options.lr), wd = static_cast<T>(options.weight_decay),
              mom = static_cast<T>(options.momentum), damp = static_cast<T>(1 - options.dampening);
      if (options.momentum == 0) {
        for (int64_t k = 0; k < n; ++k) w[k] -= lr * (wd != T(0) ? g[k] + wd * w[k] : g[k]);
        return;
      }
      bool fresh = !buf_[i].defined();
      if (fresh) buf_[i] = Tensor::empty(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState, p.name + ".momentum");
      T* b = buf_[i].data<T>();
      for (int64_t k = 0; k < n; ++k) {
        T d = wd != T(0) ? g[k] + wd * w[k] : g[k];
        b[k] = fresh ? d : mom * b[k] + damp * d;
        d = options.nesterov ? d + mom * b[k] : b[k];
        w[k] -= lr * d;
      }
    });
  }
}

AdamW::AdamW(std::vector<Parameter*> params, AdamWOptions o, Allocator* alloc)
    : options(o), alloc_(alloc ? alloc : &Allocator::global()) {
  GRAFT_CHECK(o.lr >= 0 && o.eps >= 0 && o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
              ErrorKind::InvalidArgument, "AdamW: need lr >= 0, eps >= 0, 0 <= betas < 1");
  params_ = std::move(params);
  m_.resize(params_.size());
  v_.resize(params_.size());
  steps_.assign(params_.size(), 0);
}

void AdamW::step() {
  ++t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Parameter& p = *params_[i];
    if (!p.grad.defined()) continue;
    if (!m_[i].defined()) {
      m_[i] = Tensor::zeros(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState, p.name + ".exp_avg");
      v_[i] = Tensor::zeros(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState, p.name + ".exp_avg_sq");
    }
    const int64_t step = ++steps_[i];
    by_dtype(p.data, [&]<class T>() {
      T* w = p.data.data<T>();
      const T* g = p.grad.data<T>();
      T* m = m_[i].data<T>();
      T* v = v_[i].data<T>();
      const int64_t n = p.data.numel();
      const double bc1 = 1 - std::pow(options.beta1, static_cast<double>(step));
      const double bc2 = 1 - std::pow(options.beta2, static_cast<double>(step));
      const T decay = static_cast<T>(1 - options.lr * options.weight_decay);
      const T b1 = static_cast<T>(options.beta1), b2 = static_cast<T>(options.beta2);
      const T c1 = static_cast<T>(1 - options.beta1), c2 = static_cast<T>(1 - options.beta2);
      const T step_size = static_cast<T>(options.lr / bc1);
      const T sqrt_bc2 = static_cast<T>(std::sqrt(bc2));
      const T eps = static_cast<T>(options.eps);
      for (int64_t k = 0; k < n; ++k) {
        w[k] *= decay;
        m[k] = m[k] * b1 + g[k] * c1;
        v[k] = v[k] * b2 + g[k] * g[k] * c2;
        T denom = std::sqrt(v[k]) / sqrt_bc2 + eps;
        w[k] -= step_size * (m[k] / denom);
      }
    });
  }
}

}  // namespace graft
