// graft training: a session (model + backward graph + plan + gradient delivery), parameters with
// persistent .grad buffers, and optimizers.
//
//   graft::SessionOptions o;  o.loss = "loss";  o.mode = graft::GradMode::Accumulate;
//   auto s = graft::TrainSession::open("model.onnx", o, {{"x", {32, 784}}});
//   graft::AdamW opt(s->trainable(), {.lr = 1e-3});
//   for (...) { s->set_input("x", x); s->set_input("y", y); double loss = s->step(); opt.step(); s->zero_grad(); }
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graft/autodiff.h"
#include "graft/exec.h"

namespace graft {

struct Parameter {
  std::string name;
  int value = -1;       // graph value id
  Tensor data;          // the weights (read in place by every run)
  Tensor grad;          // persistent gradient buffer; undefined = None (PyTorch's set_to_none)
  bool trainable = true;
};

// Receives a parameter's complete gradient during backward (hook mode). To keep it, keep the
// Tensor handle (it shares the block: no bytes are copied); graft drops its own reference when
// the callback returns, so a kept gradient is then the callee's alone, like PyTorch's
// AccumulateGrad stealing a fresh gradient for an empty .grad.
using GradHook = std::function<void(const Parameter& p, const Tensor& grad)>;

struct SessionOptions {
  std::string loss;                       // scalar loss output (or use output_grads)
  std::vector<std::string> output_grads;  // differentiate these outputs with given gradients
  std::vector<std::string> freeze;
  std::vector<std::string> input_grads;
  GradMode mode = GradMode::Accumulate;
  bool check_finite = false;  // stop at the first op producing NaN/Inf, naming it
  bool profile = false;
  bool timeline = false;      // tag allocator events with the executor step (recording itself is
                              // switched on with Allocator::set_timeline)
  int64_t max_memory = 0;     // refuse a plan whose peak exceeds this (bytes; 0 = no limit)
  Allocator* alloc = nullptr; // nullptr: Allocator::global()
};

class TrainSession {
 public:
  // Takes a loaded graph (parameters live in opt.alloc) and input shapes for symbolic dims.
  TrainSession(Graph g, const SessionOptions& opt, const std::map<std::string, Shape>& input_shapes = {});
  // Not movable: the executor refers to the graph. Hold sessions by unique_ptr.
  TrainSession(TrainSession&&) = delete;
  static std::unique_ptr<TrainSession> open(const std::string& path, const SessionOptions& opt,
                                            const std::map<std::string, Shape>& input_shapes = {});

  void set_input(const std::string& name, Tensor t);
  // Forward + backward; gradients are delivered per mode. Returns the loss (NaN without a loss).
  double step();
  // The same in two halves (the PyTorch front end): forward keeps what backward needs.
  void forward();
  void backward(const std::map<std::string, Tensor>& output_grads = {});
  // Drops an in-flight run (forward without backward), releasing what it saved.
  void cancel();
  // Drops the session's references to the last forward's outputs and loss (a caller that took
  // them, like the PyTorch front end, then decides how long they live).
  void release_outputs();
  bool in_run() const { return in_run_; }
  // Graph outputs of the last forward.
  std::vector<Tensor> outputs() const;
  Tensor output(const std::string& name) const;
  // Gradients of requested inputs from the last backward.
  Tensor input_grad(const std::string& name) const;

  void zero_grad(bool set_to_none = true);
  void set_hook(GradHook h) { hook_ = std::move(h); }

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  std::vector<Parameter*> trainable();
  Parameter& parameter(const std::string& name);
  // Shares external memory as a parameter's weights (zero-copy); shape and dtype must match.
  void bind_parameter(const std::string& name, Tensor data);

  const Graph& graph() const { return g_; }
  const Plan& plan() const { return exec_->plan(); }
  const BackwardGraph& backward_graph() const { return bg_; }
  Allocator& allocator() { return *alloc_; }
  GradMode mode() const { return opt_.mode; }
  const std::vector<OpTime>& op_times() const { return exec_->op_times(); }
  // Bytes of all trainable gradients (one full set), for memory reports.
  int64_t gradient_bytes() const;

 private:
  void deliver(Parameter& p, Tensor grad, bool exclusive);
  std::unique_ptr<Graph> gp_;  // the graph lives at a fixed address (the executor refers to it)
  Graph& g_;
  SessionOptions opt_;
  Allocator* alloc_;
  BackwardGraph bg_;
  std::unique_ptr<Executor> exec_;
  std::vector<Parameter> params_;
  std::vector<int> param_of_value_;  // value id -> index in params_, -1
  std::vector<int> keep_outputs_;    // indices into plan.keep of graph outputs
  std::map<std::string, int> kept_index_;
  std::vector<Tensor> last_kept_;
  std::vector<Tensor> forward_outputs_;
  Tensor loss_;
  GradHook hook_;
  bool in_run_ = false;
};

// Adds `src` into `dst` elementwise (same shape and dtype).
void add_inplace(Tensor& dst, const Tensor& src);

// --- optimizers ----------------------------------------------------------------------------------
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad(bool set_to_none = true);
  int64_t steps() const { return t_; }
  // For checkpoints (graft/checkpoint.h): the parameters updated, in order, and the step count.
  const std::vector<Parameter*>& params() const { return params_; }
  void set_steps(int64_t t) { t_ = t; }

 protected:
  std::vector<Parameter*> params_;
  int64_t t_ = 0;
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};
class SGD final : public Optimizer {
 public:
  SGD(std::vector<Parameter*> params, SGDOptions o, Allocator* alloc = nullptr);
  void step() override;
  SGDOptions options;
  // Momentum buffers, one per parameter (undefined until the parameter's first step).
  std::vector<Tensor>& momentum_buffer() { return buf_; }
  const std::vector<Tensor>& momentum_buffer() const { return buf_; }
  Allocator& allocator() const { return *alloc_; }

 private:
  Allocator* alloc_;
  std::vector<Tensor> buf_;  // momentum buffers (OptimizerState)
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};
class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<Parameter*> params, AdamWOptions o, Allocator* alloc = nullptr);
  void step() override;
  AdamWOptions options;
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // Steps taken per parameter (PyTorch's state['step']); 0 = no state yet.
  std::vector<int64_t>& param_steps() { return steps_; }
  const std::vector<int64_t>& param_steps() const { return steps_; }
  Allocator& allocator() const { return *alloc_; }

 private:
  Allocator* alloc_;
  std::vector<Tensor> m_, v_;  // OptimizerState
  std::vector<int64_t> steps_;  // per parameter, like PyTorch's state['step']
};

}  // namespace graft
