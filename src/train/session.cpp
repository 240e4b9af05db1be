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
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include "graft/ops.h"
#include "graft/train.h"

namespace graft {

void add_inplace(Tensor& dst, const Tensor& src) {
  GRAFT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), ErrorKind::ShapeMismatch,
              "add_inplace: cannot add " + std::string(dtype_name(src.dtype())) + " " +
                  shape_str(src.shape()) + " into " + dtype_name(dst.dtype()) + " " +
                  shape_str(dst.shape()));
  if (!is_float(dst.dtype())) fail(ErrorKind::Internal, "add_inplace on a non-float tensor");
  add_elements(dst, src);  // threaded, vectorized (src/ops/util.cpp)
}

void accumulate_grad(Parameter& p, const Tensor& grad) {
  if (!p.grad.defined())
    p.grad = grad.reshaped(p.data.shape());  // adopt: no copy
  else
    add_inplace(p.grad, grad);
}

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
  // ---- shapes: bind input shapes, infer every node, fold constants ----
  infer_shapes(g_, input_shapes, alloc_);
  // ---- autodiff: keep for backward what eager PyTorch keeps, no copies of weights ----
  rewrite_for_training(g_);
  AutodiffOptions ao = opt;
  ao.alloc = alloc_;
  bg_ = build_backward(g_, ao);
  rematerialize_param_copies(g_, bg_);
  if (opt.mode == GradMode::Step) order_updates_after_reads(g_, bg_);

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

  // ---- plan ----
  PlanOptions po;
  po.phase_barrier = bg_.n_forward_nodes;
  // Outputs and the loss are read when forward ends; the executor releases them after their last
  // use (the session and the caller keep their own references), so a model output the backward
  // does not need is not held through backward, and backward never writes into one.
  for (int o : g_.outputs) po.forward_outputs.push_back(o);
  if (bg_.loss >= 0) po.forward_outputs.push_back(bg_.loss);
  po.release_inputs = bg_.output_grad_inputs;  // dropped at their last read (backward() below)
  auto keep = [&](int v) -> int {
    if (v < 0) return -1;
    for (size_t k = 0; k < po.keep.size(); ++k)
      if (po.keep[k] == v) return static_cast<int>(k);
    po.keep.push_back(v);
    return static_cast<int>(po.keep.size()) - 1;
  };
  held_keep_.assign(params_.size(), -1);
  if (opt.mode == GradMode::Hold)
    for (size_t i = 0; i < bg_.params.size(); ++i)
      held_keep_[param_of_value_[bg_.params[i]]] = keep(bg_.param_grads[i]);
  for (int v : bg_.input_grads) igrad_keep_.push_back(keep(v));
  Plan plan = make_plan(g_, po);
  if (opt.activation_budget > 0 && plan.planned_peak > opt.activation_budget)
    plan = plan_under_budget(std::move(plan), po);
  check_budget(plan);
  // ---- executor ----
  exec_ = std::make_unique<Executor>(g_, std::move(plan), *alloc_);
}

// Note [Recompute under a budget]
// What the forward keeps for the backward is grouped by buffer (a value and its views). A group is
// a candidate when it can be recomputed in backward from what stays kept: every node on the way
// (its producer, and the producers of forward values that were not kept, back to kept values,
// parameters, inputs and constants) is deterministic (no Dropout or random op: replaying would
// need its draw) and no member is a graph output. Each candidate gets a cost: the FLOPs of the
// nodes it re-runs (2*M*N*K for a GEMM, 2*out*kernel for a convolution) plus 8 per byte they read
// and write (a CPU's rough FLOP-per-byte balance, so memory-bound kernels are not free), and the
// candidates are taken in the order of bytes freed per unit of cost, best first: elementwise
// results (cheap, as big as their input) before attention probabilities (a batched GEMM each)
// before projections (a GEMM over the hidden size). For k = 0, 1, ... the first k groups are
// dropped and recomputed (on a copy of the graph: recompute_in_backward, which also recomputes the
// values in between, planned late so each recomputation happens just before its first use) and
// planned; the chosen k is the smallest whose activation peak fits the budget. So the planned peak
// is <= the budget whenever some k fits, and the peak is monotone in the budget: a smaller budget
// picks a k whose peak is at most the larger budget's peak (both are the first fitting k in one
// fixed sequence). Results are bit-identical: the recomputed kernels are deterministic and see the
// same inputs.
namespace {
double node_cost(const Graph& g, const Node& n) {
  auto bytes = [&](int v) { return v < 0 ? 0.0 : static_cast<double>(g.values[v].bytes()); };
  auto shape = [&](int k) -> const Shape& { return g.values[n.inputs[k]].shape; };
  double moved = 0;
  for (int v : n.inputs) moved += bytes(v);
  double out = 0;
  for (int v : n.outputs)
    if (v >= 0) {
      moved += bytes(v);
      out += static_cast<double>(numel(g.values[v].shape));
    }
  double flops = 0;
  if ((n.op == "MatMul" || n.op == "FusedMatMul" || n.op == "Gemm") && n.inputs.size() >= 2 &&
      !shape(0).empty()) {
    const Shape& a = shape(0);
    const bool ta = n.attrs.get_int("transA", 0) != 0;
    const int64_t k = a.size() >= 2 && ta ? a[a.size() - 2] : a.back();
    flops = 2 * out * static_cast<double>(k);
  } else if (n.op == "Conv" && n.inputs.size() >= 2 && !shape(1).empty()) {
    const Shape& w = shape(1);
    flops = 2 * out * static_cast<double>(numel(w) / std::max<int64_t>(1, w[0]));
  } else if (n.op == "Einsum") {
    flops = 2 * out * 64;  // rough: graft's Einsums here are small contractions
  }
  return flops + 8 * moved;
}
}  // namespace

std::vector<std::vector<int>> TrainSession::recompute_candidates(const Plan& p) const {
  static const std::set<std::string> random = {
      "Dropout",   "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
      "Bernoulli", "Multinomial",
      "PythonOp",           // a custom autograd.Function: may draw random numbers, or keep state
      "LSTM",      "GRU"};  // (recurrences: deterministic, but not worth re-running)
  const int nf = bg_.n_forward_nodes;
  const size_t nv = g_.values.size();
  std::vector<bool> saved(nv, false);
  std::map<int, std::vector<int>> members;  // buffer root -> its values kept for backward
  for (size_t v = 0; v < nv; ++v) {
    const Value& val = g_.values[v];
    if (val.kind != ValueKind::Intermediate || val.producer < 0 || val.producer >= nf) continue;
    if (p.last_use[v] >= p.barrier_step) {
      saved[v] = true;
      members[p.buffer[v]].push_back(static_cast<int>(v));
    }
  }
  std::set<int> outs(g_.outputs.begin(), g_.outputs.end());
  struct Cand {
    double ratio;
    int root;
    std::vector<int> values;
  };
  std::vector<Cand> cand;
  for (const auto& [root, vals] : members) {
    // The nodes a recomputation of this group re-runs, with every other kept value still kept.
    std::set<int> nodes;
    std::vector<int> todo(vals.begin(), vals.end());
    bool ok = true;
    for (int v : vals) ok = ok && !outs.count(v);
    todo.push_back(root);
    while (ok && !todo.empty()) {
      const int v = todo.back();
      todo.pop_back();
      const Value& val = g_.values[v];
      if (val.kind != ValueKind::Intermediate || val.producer < 0 || val.producer >= nf) continue;
      if (!nodes.insert(val.producer).second) continue;
      const Node& n = g_.nodes[val.producer];
      const OpDef& d = op_for(n);
      if (d.sink || (!d.kernel && !d.alias) || random.count(n.op)) {
        ok = false;
        break;
      }
      for (int x : n.inputs)
        if (x >= 0 && !(saved[x] && p.buffer[x] != root)) todo.push_back(x);
    }
    if (!ok) continue;
    double cost = 1;
    for (int ni : nodes) cost += node_cost(g_, g_.nodes[ni]);
    const Value& rv = g_.values[root];
    const double bytes = static_cast<double>(rv.bytes());
    cand.push_back({bytes / cost, root, vals});
  }
  std::sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) {
    return a.ratio != b.ratio ? a.ratio > b.ratio : a.root < b.root;
  });
  if (cand.size() > 256) cand.resize(256);  // bound the search (each trial is one plan)
  std::vector<std::vector<int>> out;
  for (Cand& c : cand) out.push_back(std::move(c.values));
  return out;
}

Plan TrainSession::plan_under_budget(Plan plan, PlanOptions& po) {
  const int64_t budget = opt_.activation_budget;
  const std::vector<std::vector<int>> cand = recompute_candidates(plan);
  std::vector<bool> available(g_.values.size(), false);  // kept for backward by the forward
  for (size_t v = 0; v < g_.values.size(); ++v)
    available[v] = plan.last_use[v] >= plan.barrier_step;
  int64_t best = plan.planned_peak;
  std::vector<int> drop;
  for (size_t k = 1; k <= cand.size(); ++k) {
    drop.insert(drop.end(), cand[k - 1].begin(), cand[k - 1].end());
    Graph trial = g_;
    PlanOptions tpo = po;
    tpo.late_gradient_free = true;
    for (int ni : recompute_in_backward(trial, bg_, drop, available)) tpo.late_nodes.push_back(ni);
    if (opt_.mode == GradMode::Step) order_updates_after_reads(trial, bg_);
    Plan tp = make_plan(trial, tpo);
    best = std::min(best, tp.planned_peak);
    if (tp.planned_peak <= budget) {
      std::vector<int> late = recompute_in_backward(g_, bg_, drop, available);
      if (opt_.mode == GradMode::Step) order_updates_after_reads(g_, bg_);
      po.late_nodes.insert(po.late_nodes.end(), late.begin(), late.end());
      po.late_gradient_free = true;
      recomputed_ = static_cast<int>(late.size());
      return make_plan(g_, po);
    }
  }
  fail(ErrorKind::InvalidArgument,
       "activation_budget " + std::to_string(budget) + " bytes cannot be met: the smallest " +
           "activation peak recomputing in backward reaches is " + std::to_string(best) +
           " bytes (" + std::to_string(cand.size()) +
           " kept buffers can be recomputed); raise the budget to at least that");
}

void TrainSession::check_budget(const Plan& plan) const {
  if (opt_.max_memory <= 0) return;
  int64_t param_bytes = 0;
  for (const Parameter& p : params_) param_bytes += g_.values[p.value].bytes();
  int64_t total = plan.planned_peak + param_bytes + gradient_bytes();
  if (total <= opt_.max_memory) return;
  // Name the biggest values alive at the planned peak.
  const std::vector<SavedValue> live = live_at(plan, plan.peak_step);
  std::string top;
  for (size_t i = 0; i < live.size() && i < 3; ++i)
    top += (i ? ", " : "") + live[i].value + " (" + std::to_string(live[i].bytes) + " bytes)";
  fail(ErrorKind::OutOfMemory,
       "the planned step needs " + std::to_string(total) + " bytes (activations " +
           std::to_string(plan.planned_peak) + " at step " + std::to_string(plan.peak_step) +
           ", parameters " + std::to_string(param_bytes) + ", gradients " +
           std::to_string(gradient_bytes()) + "), over the budget of " +
           std::to_string(opt_.max_memory) + " bytes; biggest live values: " + top);
}

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
  m.gradients = gradient_bytes();
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

std::vector<TrainSession::SavedValue> TrainSession::saved_for_backward() const {
  const Plan& p = exec_->plan();
  std::vector<int> step_of_node(g_.nodes.size(), -1);
  for (size_t k = 0; k < p.steps.size(); ++k) step_of_node[p.steps[k].node] = static_cast<int>(k);
  std::vector<bool> seen(g_.values.size(), false);
  std::vector<SavedValue> out;
  for (size_t v = 0; v < g_.values.size(); ++v) {
    const Value& val = g_.values[v];
    if (val.kind != ValueKind::Intermediate || val.producer < 0) continue;
    const int made = step_of_node[val.producer];
    if (made < 0 || made >= p.barrier_step || p.last_use[v] < p.barrier_step) continue;
    const int root = p.buffer[v] >= 0 ? p.buffer[v] : static_cast<int>(v);
    if (seen[root]) continue;
    seen[root] = true;
    const Value& rv = g_.values[root];
    if (rv.kind != ValueKind::Intermediate || rv.producer < 0) continue;  // a view of an input
    const Node& n = g_.nodes[val.producer];
    out.push_back({val.name, n.op, n.name, rv.bytes()});
  }
  std::sort(out.begin(), out.end(),
            [](const SavedValue& a, const SavedValue& b) { return a.bytes > b.bytes; });
  return out;
}

std::vector<TrainSession::SavedValue> TrainSession::live_at(const Plan& plan, int step) const {
  std::vector<SavedValue> out;
  std::vector<bool> freed(g_.values.size(), false);
  std::vector<int> made;
  for (int s = 0; s <= step && s < static_cast<int>(plan.steps.size()); ++s) {
    const Node& n = g_.nodes[plan.steps[s].node];
    for (int o : n.outputs)
      if (o >= 0 && plan.buffer[o] == o && g_.values[o].kind == ValueKind::Intermediate)
        made.push_back(o);
    if (s < step)
      for (int b : plan.steps[s].buffer_frees) freed[b] = true;
  }
  for (int o : made) {
    if (freed[o]) continue;
    const Value& v = g_.values[o];
    const Node& n = g_.nodes[v.producer];
    out.push_back({v.name, n.op, n.name, v.bytes()});
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const SavedValue& a, const SavedValue& b) { return a.bytes > b.bytes; });
  return out;
}

std::vector<TrainSession::SavedValue> TrainSession::live_at_peak() const {
  return live_at(exec_->plan(), exec_->plan().peak_step);
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
  step_opt_ = opt;
  step_index_ = std::move(index);
}

namespace {
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
double clip_coef(double norm, double max_norm) { return std::min(1.0, max_norm / (norm + 1e-6)); }
}  // namespace

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

void TrainSession::set_clip_norm(double max_norm) {
  GRAFT_CHECK(max_norm >= 0 && std::isfinite(max_norm), ErrorKind::InvalidArgument,
              "the clipping norm must be finite and >= 0 (0: no clipping)");
  GRAFT_CHECK(max_norm == 0 || opt_.mode == GradMode::Step, ErrorKind::InvalidArgument,
              "set_clip_norm is for the step mode; in other modes call clip_grad_norm on the "
              "parameters before the optimizer's step");
  clip_norm_ = max_norm;
}

void TrainSession::deliver(Parameter& p, Tensor grad, bool exclusive, bool defer_step) {
  if (opt_.mode == GradMode::Hook) {
    if (hook_) hook_(p, grad);
    return;
  }
  if (opt_.mode == GradMode::Step && norm_pass_) {  // clipping's first pass: the norm only
    sumsq_ += p.grad.defined() ? sum_squares_of_sum(p.grad, grad) : sum_squares(grad);
    return;
  }
  if (opt_.mode == GradMode::Step && !defer_step) {
    // The update, now; the gradient (and any .grad accumulated by deferred micro-batches) is
    // freed when this returns. A parameter the optimizer does not update keeps nothing.
    if (p.grad.defined()) {
      if (grad.storage() != p.grad.storage()) add_inplace(p.grad, grad);
      grad = p.grad;
      p.grad = Tensor();
    }
    if (clip_coef_ < 1) {
      if (!exclusive && grad.storage() != p.grad.storage())
        grad = grad.clone(*alloc_, Category::Gradient);
      scale_inplace(grad, clip_coef_);
    }
    if (step_opt_) {
      const int i = step_index_[&p - params_.data()];
      if (i >= 0) step_opt_->update(static_cast<size_t>(i), grad);
    } else if (hook_) {
      hook_(p, grad);  // a front end's own optimizer (GraftModule's torch.optim, per parameter)
    }
    return;
  }
  if (p.grad.defined())
    GRAFT_CHECK(
        p.grad.dtype() == grad.dtype() && p.grad.numel() == grad.numel(), ErrorKind::ShapeMismatch,
        "parameter '" + p.name + "': its .grad is " + dtype_name(p.grad.dtype()) + " " +
            shape_str(p.grad.shape()) + " but its gradient is " + dtype_name(grad.dtype()) + " " +
            shape_str(p.data.shape()) + " (assign a .grad of the parameter's shape, or None)");
  if (p.grad.defined() && grad.storage() == p.grad.storage()) return;  // added in place already
  if (!p.grad.defined()) {
    if (exclusive && grad.storage()->owner == alloc_) {
      alloc_->recategorize(*grad.storage(), Category::Gradient);  // adopt: no copy
      p.grad = grad.reshaped(g_.values[p.value].shape);
    } else {
      p.grad = grad.clone(*alloc_, Category::Gradient).reshaped(g_.values[p.value].shape);
    }
    return;
  }
  add_inplace(p.grad, grad);
}

std::shared_ptr<StepState> TrainSession::forward(const std::map<std::string, Tensor>& inputs,
                                                 std::optional<uint64_t> seed,
                                                 bool keep_for_backward, std::optional<bool> bf16) {
  auto st = std::make_shared<StepState>();
  std::vector<std::pair<int, Tensor>> bind;
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
  st->seed = seed ? *seed : next_dropout_seed();
  RunOptions ro = opt_;
  ro.seed = st->seed;
  if (bf16) ro.bf16 = *bf16;
  // Accumulate mode: a weight-gradient GEMM that feeds a sink adds straight into an existing
  // .grad (beta = 1), so no temporary of the weight's size exists (deliver sees its own .grad).
  SinkTargetFn target;
  const bool defer = defer_step_;
  if (opt_.mode == GradMode::Step)
    GRAFT_CHECK(step_opt_ || hook_, ErrorKind::InvalidArgument,
                "gradient mode 'step' applies the optimizer inside backward: call "
                "set_step_optimizer(&optimizer) before the first step");
  if (opt_.mode == GradMode::Accumulate || (opt_.mode == GradMode::Step && defer))
    target = [this](int node) -> Tensor {
      const Parameter& p = params_[param_of_sink_[node]];
      return p.grad.defined() ? p.grad : Tensor();
    };
  st->defer_step = defer;
  st->run = exec_->start(
      bind, ro,
      [this, defer](int node, Tensor grad, bool exclusive) {
        Parameter& p = params_[param_of_sink_[node]];
        deliver(p, std::move(grad), exclusive, defer);
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
  if (opt_.mode == GradMode::Step && !st.defer_step && step_opt_ && !norm_pass_)
    step_opt_->count_step();
  exec_->run_to(*st.run, static_cast<int>(exec_->plan().steps.size()));
  if (opt_.profile) last_times_ = st.run->op_times();
  kept = exec_->finish(*st.run);
  st.input_grads.clear();
  for (int k : igrad_keep_) st.input_grads.push_back(k >= 0 ? kept[k] : Tensor());
  if (opt_.mode == GradMode::Hold) {
    // The baseline: every gradient was alive until now; deliver them in order, releasing each.
    for (size_t i = 0; i < params_.size(); ++i) {
      if (held_keep_[i] < 0) continue;
      Tensor grad = std::move(kept[held_keep_[i]]);
      kept[held_keep_[i]] = Tensor();
      bool exclusive = grad.storage().use_count() == 1;
      deliver(params_[i], std::move(grad), exclusive, false);
      if (ready_) ready_(params_[i]);
    }
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
  // Forward and backward back to back, nothing else between them: one reuse scope, so the
  // backward's blocks may be kept up to the step's live peak (Note [block reuse within a run]).
  Allocator::ReuseScope reuse(*alloc_);
  if (opt_.mode == GradMode::Step && clip_norm_ > 0 && !defer_step_) {
    // Two passes over the batch: the norm, then the updates scaled by the clipping coefficient.
    // The second forward replays the first's random stream, so both see the same function.
    GRAFT_CHECK(!in_run(), ErrorKind::InvalidArgument, "step() called during a forward/backward");
    const uint64_t seed = next_dropout_seed();
    cur_.reset();
    sumsq_ = 0;
    norm_pass_ = true;
    try {
      cur_ = forward({}, seed, true);
      backward(*cur_);
    } catch (...) {
      norm_pass_ = false;
      throw;
    }
    norm_pass_ = false;
    last_norm_ = std::sqrt(sumsq_);
    clip_coef_ = clip_coef(last_norm_, clip_norm_);
    cur_.reset();
    try {
      cur_ = forward({}, seed, true);
      backward(*cur_);
    } catch (...) {
      clip_coef_ = 1;
      throw;
    }
    clip_coef_ = 1;
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
      if (held_keep_[p] >= 0) order.emplace_back(p, p);
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
