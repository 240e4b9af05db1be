// TrainSession: runs a compiled training step (graft/compile.h) step after step, delivering each
// parameter's gradient per mode (src/train/delivery.h, Note [Gradient delivery]).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "delivery.h"
#include "graft/ops.h"
#include "graft/train.h"
#include "progress.h"

namespace graft {

std::unique_ptr<TrainSession> TrainSession::open(const std::string& path, const SessionOptions& opt,
                                                 const std::map<std::string, Shape>& input_shapes) {
  ImportOptions io;
  io.alloc = opt.alloc ? opt.alloc : &Allocator::global();
  return std::make_unique<TrainSession>(load_onnx(path, io), opt, input_shapes);
}

TrainSession::TrainSession(Graph g, const SessionOptions& opt,
                           const std::map<std::string, Shape>& input_shapes)
    : gp_(std::make_unique<Graph>(std::move(g))),
      g_(*gp_),
      opt_(opt),
      alloc_(opt.alloc ? opt.alloc : &Allocator::global()) {
  // ---- parameters that arrive as graph inputs (exported without weights) ----
  for (const std::string& name : opt.param_inputs) {
    int v = g_.find(name);
    GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "param_inputs: '" + name + "' is not a graph input of the model");
    Value& val = g_.values[v];
    GRAFT_CHECK(
        val.shape_known, ErrorKind::InvalidArgument,
        "param_inputs: '" + name + "' has a symbolic shape; a parameter's shape must be fixed");
    val.kind = ValueKind::Param;
    std::erase(g_.inputs, v);
  }
  CompileOptions co = opt;
  // Note [bf16 operands]: a bf16 session stores its products' saved operands in bfloat16
  // (GRAFT_BF16_OPERANDS=0: in float32, the A/B switch).
  const char* b16 = std::getenv("GRAFT_BF16_OPERANDS");
  co.bf16_operands = opt.bf16 && !(b16 && std::strcmp(b16, "0") == 0);
  c_ = compile_step(g_, opt, co, input_shapes);  // (allocates from opt.alloc, as alloc_ does)

  // ---- parameters: the session is their one home from here on ----
  param_of_value_.assign(g_.values.size(), -1);
  for (int v : g_.params()) {
    Parameter p;
    p.name = g_.values[v].name;
    p.value = v;
    p.data = std::move(g_.values[v].data);
    g_.values[v].data = Tensor();
    p.trainable = std::find(bg_.params.begin(), bg_.params.end(), v) != bg_.params.end();
    param_of_value_[v] = static_cast<int>(params_.size());
    params_.push_back(std::move(p));
  }
  param_of_sink_.assign(g_.nodes.size(), -1);
  for (size_t i = 0; i < bg_.params.size(); ++i)
    if (bg_.sinks[i] >= 0) param_of_sink_[bg_.sinks[i]] = param_of_value_[bg_.params[i]];

  // ---- delivery ----
  switch (opt.mode) {
    case GradMode::Hold:
    case GradMode::Accumulate:
      delivery_ = std::make_unique<IntoGrad>(*alloc_, opt.mode == GradMode::Accumulate);
      break;
    case GradMode::Hook:
      delivery_ = std::make_unique<HookDelivery>(hook_);
      break;
    case GradMode::Step: {
      auto d = std::make_unique<StepDelivery>(*alloc_, hook_);
      step_ = d.get();
      delivery_ = std::move(d);
      break;
    }
  }
  // ---- executor: it owns the plan from here on (exec_->plan()) ----
  exec_ = std::make_unique<Executor>(g_, std::move(c_.plan), *alloc_);
}

TrainSession::~TrainSession() = default;

std::string PlannedMemory::describe() const {
  std::vector<std::pair<int64_t, const char*>> parts{
      {parameters, "parameters"}, {gradients, "gradients"}, {optimizer_state, "optimizer state"},
      {inputs, "inputs"},         {constants, "constants"}, {activations, "activations"}};
  std::stable_sort(parts.begin(), parts.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string r;
  for (const auto& [b, n] : parts) {
    if (!b) continue;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
    r += (r.empty() ? "" : ", ") + std::string(n) + " " + buf;
  }
  return r;
}

PlannedMemory TrainSession::planned_memory(int64_t optimizer_state_bytes) const {
  auto bytes = [&](int v) { return g_.values[v].bytes(); };
  PlannedMemory m;
  for (const Parameter& p : params_) m.parameters += bytes(p.value);
  // Step mode updates each parameter as its gradient is complete and frees the gradient there:
  // the gradients are values of the plan, inside its activation peak, never all at once.
  m.gradients = opt_.mode == GradMode::Step ? 0 : gradient_bytes();
  m.optimizer_state = optimizer_state_bytes;
  for (int v : g_.inputs)
    if (std::find(bg_.output_grad_inputs.begin(), bg_.output_grad_inputs.end(), v) ==
        bg_.output_grad_inputs.end())
      m.inputs += bytes(v);
  for (const Value& v : g_.values)  // model constants and folded shapes held by graft's allocator
    if (v.kind == ValueKind::Constant && v.data.defined() && v.data.storage()->owner)
      m.constants += v.data.nbytes();
  // The plan releases forward outputs after their last read; the step's caller holds them (and the
  // loss) until the next step, so they count in full.
  m.activations = exec_->plan().planned_peak;
  std::vector<int> outs(g_.outputs.begin(), g_.outputs.end());
  if (bg_.loss >= 0) outs.push_back(bg_.loss);
  std::sort(outs.begin(), outs.end());
  outs.erase(std::unique(outs.begin(), outs.end()), outs.end());
  for (int o : outs)
    if (g_.values[o].kind == ValueKind::Intermediate) m.activations += bytes(o);
  return m;
}

std::vector<SavedValue> TrainSession::saved_for_backward() const {
  return graft::saved_for_backward(g_, exec_->plan());
}

std::vector<SavedValue> TrainSession::live_at_peak() const {
  return live_at(g_, exec_->plan(), exec_->plan().peak_step);
}

int64_t TrainSession::gradient_bytes() const {
  int64_t b = 0;
  for (int v : bg_.params) b += g_.values[v].bytes();
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
  const Value& v = g_.values[p.value];
  GRAFT_CHECK(
      data.defined() && data.dtype() == v.dtype && data.shape() == v.shape,
      ErrorKind::ShapeMismatch,
      "parameter '" + name + "' is " + dtype_name(v.dtype) + " " + shape_str(v.shape) +
          " but was given " +
          (data.defined() ? std::string(dtype_name(data.dtype())) + " " + shape_str(data.shape())
                          : "nothing"));
  GRAFT_CHECK(data.nbytes() == 0 || data.raw() != nullptr, ErrorKind::InvalidArgument,
              "parameter '" + name + "' was given a tensor with no memory (a null data pointer)");
  std::lock_guard<std::mutex> lk(bind_mu_);
  p.data = std::move(data);
}

void TrainSession::set_input(const std::string& name, Tensor t) {
  int v = g_.find(name);
  GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
              "the model has no input named '" + name + "'");
  GRAFT_CHECK(t.defined(), ErrorKind::InvalidArgument,
              "input '" + name + "' was given an undefined tensor");
  const Value& val = g_.values[v];
  GRAFT_CHECK(t.dtype() == val.dtype, ErrorKind::InvalidArgument,
              "'" + name + "' expects dtype " + dtype_name(val.dtype) + " but got " +
                  dtype_name(t.dtype()));
  GRAFT_CHECK(t.shape() == val.shape, ErrorKind::ShapeMismatch,
              "'" + name + "' was planned with shape " + shape_str(val.shape) + " but got " +
                  shape_str(t.shape()) + " (a new shape needs a new session)");
  GRAFT_CHECK(t.nbytes() == 0 || t.raw() != nullptr, ErrorKind::InvalidArgument,
              "input '" + name + "' was given a tensor of " + std::to_string(t.nbytes()) +
                  " bytes with no memory (a null data pointer)");
  default_inputs_[name] = std::move(t);
}

void TrainSession::set_step_optimizer(Optimizer* opt) {
  GRAFT_CHECK(opt_.mode == GradMode::Step, ErrorKind::InvalidArgument,
              std::string("set_step_optimizer: the session's gradient mode is ") +
                  grad_mode_name(opt_.mode) + "; the step-in-backward mode is 'step'");
  std::vector<int> index(params_.size(), -1);
  if (opt)
    for (size_t i = 0; i < params_.size(); ++i) index[i] = opt->index_of(params_[i]);
  if (opt)
    for (const Parameter* q : opt->params())
      GRAFT_CHECK(
          std::any_of(params_.begin(), params_.end(), [&](const Parameter& p) { return &p == q; }),
          ErrorKind::InvalidArgument,
          "set_step_optimizer: the optimizer updates '" + q->name +
              "', which is not a parameter of this session");
  step_->set_optimizer(opt, params_.data(), std::move(index));
}

Optimizer* TrainSession::step_optimizer() const { return step_ ? step_->optimizer() : nullptr; }

void TrainSession::set_clip_norm(double max_norm) {
  GRAFT_CHECK(max_norm >= 0 && std::isfinite(max_norm), ErrorKind::InvalidArgument,
              "the clipping norm must be finite and >= 0 (0: no clipping)");
  GRAFT_CHECK(max_norm == 0 || opt_.mode == GradMode::Step, ErrorKind::InvalidArgument,
              "set_clip_norm is for the step mode; in other modes call clip_grad_norm on the "
              "parameters before the optimizer's step");
  clip_norm_ = max_norm;
}

std::shared_ptr<StepState> TrainSession::forward(const std::map<std::string, Tensor>& inputs,
                                                 std::optional<uint64_t> seed,
                                                 bool keep_for_backward, std::optional<bool> bf16) {
  auto st = std::make_shared<StepState>();
  std::vector<std::pair<int, Tensor>> bind;
  std::unique_lock<std::mutex> bound(bind_mu_);  // the bindings, read once (bind_parameter)
  for (const Parameter& p : params_) {
    GRAFT_CHECK(p.data.defined(), ErrorKind::InvalidArgument,
                "parameter '" + p.name + "' has no data (bind_parameter shares memory for it)");
    GRAFT_CHECK(
        p.data.dtype() == g_.values[p.value].dtype && p.data.shape() == g_.values[p.value].shape,
        ErrorKind::ShapeMismatch,
        "parameter '" + p.name + "' holds " + dtype_name(p.data.dtype()) + " " +
            shape_str(p.data.shape()) + " but the model planned " +
            dtype_name(g_.values[p.value].dtype) + " " + shape_str(g_.values[p.value].shape) +
            " (assign a tensor of the planned shape, or build a new session)");
    bind.emplace_back(p.value, p.data);
  }
  bound.unlock();
  for (const auto& [name, t] : inputs) {
    int v = g_.find(name);
    GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "the model has no input named '" + name + "'");
  }
  for (int v : g_.inputs) {
    if (std::find(bg_.output_grad_inputs.begin(), bg_.output_grad_inputs.end(), v) !=
        bg_.output_grad_inputs.end())
      continue;  // fed by backward
    const std::string& name = g_.values[v].name;
    auto it = inputs.find(name);
    const Tensor* t = it != inputs.end() ? &it->second : nullptr;
    if (!t) {
      auto d = default_inputs_.find(name);
      GRAFT_CHECK(d != default_inputs_.end(), ErrorKind::InvalidArgument,
                  "input '" + name + "' was not given (set_input or pass it to forward)");
      t = &d->second;
    }
    bind.emplace_back(v, *t);
    st->inputs.push_back(*t);
  }
  st->seed = seed ? *seed : rng_++;
  RunOptions ro = opt_;
  ro.seed = st->seed;
  if (bf16) ro.bf16 = *bf16;
  GRAFT_CHECK(ro.bf16 || c_.bf16_operands == 0, ErrorKind::InvalidArgument,
              "this session keeps " + std::to_string(c_.bf16_operands) +
                  " product operands in bfloat16 (Note [bf16 operands], Note [bf16 gradient "
                  "operands]), "
                  "so its steps run in bf16; a float32 step needs a session built with float32 "
                  "precision (or GRAFT_BF16_OPERANDS=0)");
  if (StepProgress::enabled()) {  // Note [step progress]
    if (!progress_) progress_ = std::make_unique<StepProgress>();
    int64_t tokens = 0;  // the first integer input's elements: a language model's token ids
    for (const Tensor& t : st->inputs)
      if (is_int(t.dtype())) {
        tokens = t.numel();
        break;
      }
    progress_->begin(tokens);
    const int barrier = exec_->plan().barrier_step;
    ro.progress = [p = progress_.get(), barrier](int done, int total) {
      p->at(done, total, done > barrier);
    };
  }
  // Accumulate mode: a weight-gradient GEMM that feeds a sink adds straight into an existing
  // .grad (beta = 1), so no temporary of the weight's size exists (deliver sees its own .grad).
  SinkTargetFn target;
  const bool defer = defer_step_;
  if (step_)
    GRAFT_CHECK(step_->optimizer() || hook_, ErrorKind::InvalidArgument,
                "gradient mode 'step' applies the optimizer inside backward: call "
                "set_step_optimizer(&optimizer) before the first step");
  if (delivery_->adds_into_grad(defer))
    target = [this](int node) -> Tensor {
      const Parameter& p = params_[param_of_sink_[node]];
      return p.grad.defined() ? p.grad : Tensor();
    };
  st->defer_step = defer;
  st->run = exec_->start(
      bind, ro,
      [this, defer](int node, Tensor grad, bool exclusive) {
        Parameter& p = params_[param_of_sink_[node]];
        delivery_->deliver(p, std::move(grad), exclusive, defer);
        if (ready_) ready_(p);
      },
      std::move(target));
  exec_->run_to(*st->run, exec_->plan().barrier_step);
  if (opt_.profile) last_times_ = st->run->op_times();  // the forward's; backward() adds its own
  for (int o : g_.outputs) {
    Tensor t = st->run->value(o);
    // A constant (or folded) output is graft's own storage, shared by every step: the caller gets
    // a copy it owns, so editing it cannot change what later steps return.
    if (g_.values[o].kind == ValueKind::Constant && t.defined())
      t = t.clone(*alloc_, Category::Activation);
    st->outputs.push_back(t);
  }
  st->loss = bg_.loss >= 0 ? st->run->value(bg_.loss) : Tensor();
  st->forward_done = true;
  if (!keep_for_backward) {
    exec_->abort(*st->run);
    st->backward_done = true;
    if (progress_) progress_->end();
  }
  return st;
}

void TrainSession::backward(StepState& st, std::map<std::string, Tensor> output_grads) {
  GRAFT_CHECK(st.forward_done && st.run, ErrorKind::InvalidArgument,
              "backward of a step whose forward did not run");
  GRAFT_CHECK(!st.backward_done && st.run->active(), ErrorKind::InvalidArgument,
              "this step's backward already ran (or the step was cancelled); run a new forward");
  std::vector<Tensor> kept;
  for (const auto& [name, t] : output_grads) {
    auto it = std::find(opt_.output_grads.begin(), opt_.output_grads.end(), name);
    GRAFT_CHECK(it != opt_.output_grads.end(), ErrorKind::InvalidArgument,
                "'" + name + "' is not one of the outputs this session differentiates");
    exec_->feed(*st.run, bg_.output_grad_inputs[it - opt_.output_grads.begin()], t);
  }
  // The run holds the only handles now: each output gradient goes after its last read.
  output_grads.clear();
  st.backward_done = true;
  delivery_->begin_backward(st.defer_step);
  exec_->run_to(*st.run, static_cast<int>(exec_->plan().steps.size()));
  if (progress_) progress_->end();
  if (opt_.profile) last_times_ = st.run->op_times();
  kept = exec_->finish(*st.run);
  st.input_grads.clear();
  for (int k : c_.input_grad_keep) st.input_grads.push_back(k >= 0 ? kept[k] : Tensor());
  // Hold mode, the baseline: every gradient was alive until now; deliver them in parameter order,
  // releasing each (other modes hold none: grad_keep is all -1).
  for (size_t i = 0; i < bg_.params.size(); ++i) {
    const int k = c_.grad_keep[i];
    if (k < 0) continue;
    Parameter& p = params_[param_of_value_[bg_.params[i]]];
    Tensor grad = std::move(kept[k]);
    kept[k] = Tensor();
    const bool exclusive = grad.storage().use_count() == 1;
    delivery_->deliver(p, std::move(grad), exclusive, false);
    if (ready_) ready_(p);
  }
}

void TrainSession::forward() {
  GRAFT_CHECK(!in_run(), ErrorKind::InvalidArgument, "forward() called twice without backward()");
  // The previous step's outputs are dropped before this step allocates anything.
  cur_.reset();
  cur_ = forward({}, std::nullopt, true);
}

void TrainSession::backward(std::map<std::string, Tensor> output_grads) {
  GRAFT_CHECK(in_run(), ErrorKind::InvalidArgument, "backward() called without forward()");
  backward(*cur_, std::move(output_grads));
}

void TrainSession::cancel() {
  if (cur_ && cur_->run && cur_->run->active()) exec_->abort(*cur_->run);
  cur_.reset();
}

void TrainSession::release_outputs() {
  if (!cur_) return;
  cur_->outputs.clear();
  cur_->loss = Tensor();
}

double TrainSession::step() {
  Allocator::RunScope run(*alloc_);  // forward and backward: one run (Note [mapped block cache])
  if (opt_.mode == GradMode::Step && clip_norm_ > 0 && !defer_step_) {
    // Two passes over the batch: the norm, then the updates scaled by the clipping coefficient.
    // The second forward replays the first's random stream, so both see the same function.
    GRAFT_CHECK(!in_run(), ErrorKind::InvalidArgument, "step() called during a forward/backward");
    const uint64_t seed = rng_++;
    cur_.reset();
    step_->begin_norm_pass();
    try {
      cur_ = forward({}, seed, true);
      backward(*cur_);
    } catch (...) {
      step_->end_norm_pass();
      throw;
    }
    last_norm_ = step_->end_norm_pass();
    step_->set_clip_coef(clip_coef(last_norm_, clip_norm_));
    cur_.reset();
    try {
      cur_ = forward({}, seed, true);
      backward(*cur_);
    } catch (...) {
      step_->set_clip_coef(1);
      throw;
    }
    step_->set_clip_coef(1);
    if (bg_.loss < 0) return std::numeric_limits<double>::quiet_NaN();
    return cur_->loss.at(0);
  }
  forward();
  backward();
  if (bg_.loss < 0) return std::numeric_limits<double>::quiet_NaN();
  return cur_->loss.at(0);
}

std::vector<Tensor> TrainSession::outputs() const {
  return cur_ ? cur_->outputs : std::vector<Tensor>{};
}

Tensor TrainSession::output(const std::string& name) const {
  for (size_t i = 0; cur_ && i < g_.outputs.size() && i < cur_->outputs.size(); ++i)
    if (g_.values[g_.outputs[i]].name == name) return cur_->outputs[i];
  fail(ErrorKind::InvalidArgument, "no output named '" + name + "' from the last forward");
}

Tensor TrainSession::input_grad(const std::string& name) const {
  auto it = std::find(opt_.input_grads.begin(), opt_.input_grads.end(), name);
  GRAFT_CHECK(it != opt_.input_grads.end(), ErrorKind::InvalidArgument,
              "no gradient was requested for input '" + name + "'");
  size_t k = it - opt_.input_grads.begin();
  return cur_ && k < cur_->input_grads.size() ? cur_->input_grads[k] : Tensor();
}

std::vector<int> TrainSession::delivery_order() const {
  std::vector<std::pair<int, int>> order;  // (when, parameter)
  for (size_t i = 0; i < bg_.params.size(); ++i) {
    const int p = param_of_value_[bg_.params[i]];
    if (opt_.mode == GradMode::Hold) {
      if (c_.grad_keep[i] >= 0) order.emplace_back(p, p);
    } else if (bg_.sinks[i] >= 0) {
      order.emplace_back(exec_->plan().step_of(bg_.sinks[i]), p);
    }
  }
  std::sort(order.begin(), order.end());
  std::vector<int> out;
  for (const auto& [when, p] : order) out.push_back(p);
  return out;
}

void TrainSession::zero_grad(bool set_to_none) {
  for (auto& p : params_) {
    if (set_to_none)
      p.grad = Tensor();
    else if (p.grad.defined())
      std::memset(p.grad.raw(), 0, p.grad.nbytes());
  }
}

}  // namespace graft
