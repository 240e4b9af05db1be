// TrainSession: forward + backward over one plan, delivering parameter gradients per mode.
//
// Note [Gradient delivery]
// hold:       parameter gradients are kept values of the run; after backward ends they are added
//             into .grad (the old ORTModule behaviour: every gradient is alive at the end).
// accumulate: a graft.GradSink runs as soon as a gradient is complete (sink-first order, see the
//             planner); the gradient is added in place into .grad, or adopted as .grad without a
//             copy when .grad is None and the executor held the only reference; then released.
// hook:       the same moment, the user's callback gets (parameter, gradient view); graft releases
//             the buffer when the callback returns.
// All three run the same nodes in the same order, so their gradients are bit-identical.
#include <algorithm>
#include <cstring>
#include <limits>

#include "graft/ops.h"
#include "graft/train.h"

namespace graft {

void add_inplace(Tensor& dst, const Tensor& src) {
  GRAFT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), ErrorKind::Internal,
              "add_inplace: mismatched tensors");
  const int64_t n = dst.numel();
  if (dst.dtype() == DType::F32) {
    float* d = dst.data<float>();
    const float* s = src.data<float>();
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
  } else if (dst.dtype() == DType::F64) {
    double* d = dst.data<double>();
    const double* s = src.data<double>();
    for (int64_t i = 0; i < n; ++i) d[i] += s[i];
  } else {
    fail(ErrorKind::Internal, "add_inplace on a non-float tensor");
  }
}

std::unique_ptr<TrainSession> TrainSession::open(const std::string& path, const SessionOptions& opt,
                                                 const std::map<std::string, Shape>& input_shapes) {
  ImportOptions io;
  io.alloc = opt.alloc ? opt.alloc : &Allocator::global();
  return std::make_unique<TrainSession>(load_onnx(path, io), opt, input_shapes);
}

TrainSession::TrainSession(Graph g, const SessionOptions& opt, const std::map<std::string, Shape>& input_shapes)
    : gp_(std::make_unique<Graph>(std::move(g))), g_(*gp_), opt_(opt), alloc_(opt.alloc ? opt.alloc : &Allocator::global()) {
  infer_shapes(g_, input_shapes, alloc_);
  AutodiffOptions ao;
  ao.loss = opt.loss;
  ao.output_grads = opt.output_grads;
  ao.freeze = opt.freeze;
  ao.input_grads = opt.input_grads;
  ao.mode = opt.mode;
  ao.alloc = alloc_;
  bg_ = build_backward(g_, ao);

  PlanOptions po;
  po.phase_barrier = bg_.n_forward_nodes;
  auto keep = [&](int v, const std::string& key) {
    if (v < 0 || kept_index_.count(key)) return;
    kept_index_[key] = static_cast<int>(po.keep.size());
    po.keep.push_back(v);
  };
  // Outputs and the loss are read when forward ends; the executor releases them after their last
  // use (the session and the caller keep their own references), so a model output the backward
  // does not need is not held through backward.
  for (int o : g_.outputs) po.forward_outputs.push_back(o);
  if (bg_.loss >= 0) po.forward_outputs.push_back(bg_.loss);
  if (opt.mode == GradMode::Hold)
    for (size_t i = 0; i < bg_.params.size(); ++i) keep(bg_.param_grads[i], "grad:" + g_.values[bg_.params[i]].name);
  for (size_t i = 0; i < bg_.input_grads.size(); ++i) keep(bg_.input_grads[i], "igrad:" + opt.input_grads[i]);
  Plan plan = make_plan(g_, po);

  int64_t param_bytes = 0;
  param_of_value_.assign(g_.values.size(), -1);
  for (int v : g_.params()) {
    Parameter p;
    p.name = g_.values[v].name;
    p.value = v;
    p.data = g_.values[v].data;
    p.trainable = std::find(bg_.params.begin(), bg_.params.end(), v) != bg_.params.end();
    param_bytes += static_cast<int64_t>(p.data.nbytes());
    param_of_value_[v] = static_cast<int>(params_.size());
    params_.push_back(std::move(p));
  }
  if (opt.max_memory > 0) {
    int64_t total = plan.planned_peak + param_bytes + gradient_bytes();
    if (total > opt.max_memory) {
      // Name the biggest values alive at the planned peak.
      std::vector<std::pair<int64_t, std::string>> live;
      std::vector<bool> freed(g_.values.size(), false);
      for (int s = 0; s <= plan.peak_step; ++s) {
        const Node& n = g_.nodes[plan.steps[s].node];
        for (int o : n.outputs)
          if (o >= 0 && plan.buffer[o] == o && g_.values[o].kind == ValueKind::Intermediate)
            live.push_back({numel(g_.values[o].shape) * static_cast<int64_t>(dtype_size(g_.values[o].dtype)), g_.values[o].name});
        if (s < plan.peak_step)
          for (int b : plan.steps[s].buffer_frees) freed[b] = true;
      }
      std::erase_if(live, [&](const auto& e) { return freed[g_.find(e.second)]; });
      std::sort(live.rbegin(), live.rend());
      std::string top;
      for (size_t i = 0; i < live.size() && i < 3; ++i)
        top += (i ? ", " : "") + live[i].second + " (" + std::to_string(live[i].first) + " bytes)";
      fail(ErrorKind::OutOfMemory,
           "the planned step needs " + std::to_string(total) + " bytes (activations " +
               std::to_string(plan.planned_peak) + " at step " + std::to_string(plan.peak_step) +
               ", parameters " + std::to_string(param_bytes) + ", gradients " +
               std::to_string(gradient_bytes()) + "), over the budget of " + std::to_string(opt.max_memory) +
               " bytes; biggest live values: " + top);
    }
  }
  exec_ = std::make_unique<Executor>(g_, std::move(plan), *alloc_);
}

int64_t TrainSession::gradient_bytes() const {
  int64_t b = 0;
  for (int v : bg_.params) b += numel(g_.values[v].shape) * static_cast<int64_t>(dtype_size(g_.values[v].dtype));
  return b;
}

std::vector<Parameter*> TrainSession::trainable() {
  std::vector<Parameter*> r;
  for (auto& p : params_)
    if (p.trainable) r.push_back(&p);
  return r;
}

Parameter& TrainSession::parameter(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return p;
  fail(ErrorKind::InvalidArgument, "the model has no parameter named '" + name + "'");
}

void TrainSession::bind_parameter(const std::string& name, Tensor data) {
  Parameter& p = parameter(name);
  exec_->bind(p.value, data);
  g_.values[p.value].data = data;  // drop the imported copy: the bound memory is the parameter now
  p.data = std::move(data);
}

void TrainSession::set_input(const std::string& name, Tensor t) {
  int v = g_.find(name);
  GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
              "the model has no input named '" + name + "'");
  exec_->bind(v, std::move(t));
}

void TrainSession::deliver(Parameter& p, Tensor grad, bool exclusive) {
  if (opt_.mode == GradMode::Hook) {
    if (hook_) hook_(p, grad);
    return;
  }
  if (!p.grad.defined()) {
    if (exclusive && grad.storage()->owner == alloc_) {
      alloc_->recategorize(*grad.storage(), Category::Gradient);  // adopt: no copy
      p.grad = grad.reshaped(p.data.shape());
    } else {
      p.grad = grad.clone(*alloc_, Category::Gradient).reshaped(p.data.shape());
    }
    return;
  }
  add_inplace(p.grad, grad);
}

void TrainSession::forward() {
  GRAFT_CHECK(!in_run_, ErrorKind::InvalidArgument, "forward() called twice without backward()");
  // The previous step's outputs are dropped before this step allocates anything.
  release_outputs();
  last_kept_.clear();
  auto sink = [this](const Node& n, Tensor grad, bool exclusive) {
    deliver(params_[param_of_value_[n.attrs.get_int("param_value", -1)]], std::move(grad), exclusive);
  };
  RunOptions ro;
  ro.check_finite = opt_.check_finite;
  ro.profile = opt_.profile;
  ro.timeline = opt_.timeline;
  exec_->begin(ro, sink);
  in_run_ = true;
  try {
    exec_->run_to(exec_->plan().barrier_step);
  } catch (...) {
    exec_->abort();
    in_run_ = false;
    throw;
  }
  forward_outputs_.clear();
  for (int o : g_.outputs) forward_outputs_.push_back(exec_->current(o));
  loss_ = bg_.loss >= 0 ? exec_->current(bg_.loss) : Tensor();
}

void TrainSession::backward(const std::map<std::string, Tensor>& output_grads) {
  GRAFT_CHECK(in_run_, ErrorKind::InvalidArgument, "backward() called without forward()");
  std::vector<Tensor> kept;
  try {
    for (const auto& [name, t] : output_grads) {
      auto it = std::find(opt_.output_grads.begin(), opt_.output_grads.end(), name);
      GRAFT_CHECK(it != opt_.output_grads.end(), ErrorKind::InvalidArgument,
                  "'" + name + "' is not one of the outputs this session differentiates");
      exec_->feed(bg_.output_grad_inputs[it - opt_.output_grads.begin()], t);
    }
    exec_->run_to(static_cast<int>(exec_->plan().steps.size()));
    kept = exec_->finish();
  } catch (...) {
    exec_->abort();
    in_run_ = false;
    throw;
  }
  in_run_ = false;
  last_kept_ = std::move(kept);
  if (opt_.mode == GradMode::Hold) {
    // The baseline: every gradient was alive until now; deliver them in order, releasing each.
    for (size_t i = 0; i < bg_.params.size(); ++i) {
      auto it = kept_index_.find("grad:" + g_.values[bg_.params[i]].name);
      if (it == kept_index_.end()) continue;
      Tensor grad = std::move(last_kept_[it->second]);
      last_kept_[it->second] = Tensor();
      bool exclusive = grad.storage().use_count() == 1;
      deliver(params_[param_of_value_[bg_.params[i]]], std::move(grad), exclusive);
    }
  }
}

void TrainSession::cancel() {
  if (in_run_) exec_->abort();
  in_run_ = false;
  release_outputs();
  last_kept_.clear();
}

void TrainSession::release_outputs() {
  forward_outputs_.clear();
  loss_ = Tensor();
}

double TrainSession::step() {
  forward();
  backward();
  if (bg_.loss < 0) return std::numeric_limits<double>::quiet_NaN();
  return loss_.at(0);
}

std::vector<Tensor> TrainSession::outputs() const { return forward_outputs_; }

Tensor TrainSession::output(const std::string& name) const {
  for (size_t i = 0; i < g_.outputs.size() && i < forward_outputs_.size(); ++i)
    if (g_.values[g_.outputs[i]].name == name) return forward_outputs_[i];
  fail(ErrorKind::InvalidArgument, "no output named '" + name + "' from the last forward");
}

Tensor TrainSession::input_grad(const std::string& name) const {
  auto it = kept_index_.find("igrad:" + name);
  GRAFT_CHECK(it != kept_index_.end(), ErrorKind::InvalidArgument,
              "no gradient was requested for input '" + name + "'");
  return it->second < static_cast<int>(last_kept_.size()) ? last_kept_[it->second] : Tensor();
}

void TrainSession::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    if (set_to_none) p.grad = Tensor();
    else if (p.grad.defined()) std::memset(p.grad.raw(), 0, p.grad.nbytes());
  }
}

}  // namespace graft
