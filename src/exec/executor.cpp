// The executor (see include/graft/exec.h).
//
// An Executor is the immutable part of execution: the graph, the plan, each node's resolved
// op and its prepared attributes. Everything a run changes lives in its Run, so runs may overlap
// (several forwards in flight) and run on several threads; the shared Allocator is thread-safe.
#include <chrono>
#include <cmath>

#include "graft/exec.h"
#include "graft/ops.h"

namespace graft {

Executor::Executor(const Graph& g, Plan plan, Allocator& alloc)
    : g_(g), plan_(std::move(plan)), alloc_(alloc) {
  defs_.assign(g_.nodes.size(), nullptr);
  prepared_.assign(g_.nodes.size(), nullptr);
  for (const PlanStep& st : plan_.steps) {
    defs_[st.node] = &op_for(g_.nodes[st.node]);
    prepared_[st.node] = prepare_node(g_.nodes[st.node]);  // Note [prepared attributes] (ops.h)
  }
  feeds_sink_.assign(g_.nodes.size(), -1);
  auto cons = g_.consumers();
  std::vector<bool> kept(g_.values.size(), false);
  for (int v : plan_.keep) kept[v] = true;
  for (const PlanStep& st : plan_.steps) {
    const Node& n = g_.nodes[st.node];
    const OpDef& d = *defs_[st.node];
    if (!d.accumulate_out || st.inplace_in >= 0 || n.outputs.empty() || n.outputs[0] < 0) continue;
    if (n.inputs.size() > 2 && n.inputs[2] >= 0) continue;  // a Gemm's C
    const int o = n.outputs[0];
    if (kept[o] || cons[o].size() != 1) continue;
    const int s = cons[o][0];
    if (defs_[s] && defs_[s]->sink) feeds_sink_[st.node] = s;
  }
}

void Executor::check_binding(int v, const Tensor& t) const {
  const Value& val = g_.values[v];
  GRAFT_CHECK(val.kind == ValueKind::Input || val.kind == ValueKind::Param,
              ErrorKind::InvalidArgument, "'" + val.name + "' is not a graph input or parameter");
  GRAFT_CHECK(t.defined(), ErrorKind::InvalidArgument,
              "'" + val.name + "' was given an undefined tensor");
  GRAFT_CHECK(t.dtype() == val.dtype, ErrorKind::InvalidArgument,
              "'" + val.name + "' expects dtype " + dtype_name(val.dtype) + " but got " +
                  dtype_name(t.dtype()));
  GRAFT_CHECK(t.shape() == val.shape, ErrorKind::ShapeMismatch,
              "'" + val.name + "' was planned with shape " + shape_str(val.shape) + " but got " +
                  shape_str(t.shape()) + " (a new shape needs a new plan)");
  GRAFT_CHECK(t.nbytes() == 0 || t.raw() != nullptr, ErrorKind::InvalidArgument,
              "'" + val.name + "' was given a tensor of " + std::to_string(t.nbytes()) +
                  " bytes with no memory (a null data pointer)");
}

void Executor::bind(int v, Tensor t) {
  check_binding(v, t);
  bound_[v] = std::move(t);
}

bool all_finite(const Tensor& t) {
  if (t.dtype() == DType::F32) {
    const float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return false;
  } else if (t.dtype() == DType::F64) {
    const double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return false;
  }
  return true;
}

std::vector<Tensor> Executor::run(const RunOptions& opt, const SinkFn& sink) {
  std::vector<std::pair<int, Tensor>> b(bound_.begin(), bound_.end());
  auto r = start(b, opt, sink);
  run_to(*r, static_cast<int>(plan_.steps.size()));
  last_times_ = r->times_;
  return finish(*r);
}

std::unique_ptr<Run> Executor::start(const std::vector<std::pair<int, Tensor>>& bindings,
                                     const RunOptions& opt, SinkFn sink,
                                     SinkTargetFn target) const {
  auto r = std::make_unique<Run>();
  r->opt_ = opt;
  r->sink_ = std::move(sink);
  r->target_ = std::move(target);
  r->vals_.assign(g_.values.size(), Tensor());
  for (const auto& [v, t] : bindings) {
    check_binding(v, t);
    r->vals_[v] = t;
  }
  for (size_t v = 0; v < g_.values.size(); ++v) {
    const Value& val = g_.values[v];
    if (r->vals_[v].defined()) continue;
    if (val.kind == ValueKind::Constant || val.kind == ValueKind::Param) r->vals_[v] = val.data;
  }
  r->active_ = true;
  return r;
}

void Executor::feed(Run& r, int v, Tensor t) const {
  const Value& val = g_.values[v];
  GRAFT_CHECK(t.dtype() == val.dtype && t.shape() == val.shape, ErrorKind::ShapeMismatch,
              "'" + val.name + "' expects " + dtype_name(val.dtype) + " " + shape_str(val.shape) +
                  " but got " + dtype_name(t.dtype()) + " " + shape_str(t.shape()));
  GRAFT_CHECK(t.nbytes() == 0 || t.raw() != nullptr, ErrorKind::InvalidArgument,
              "'" + val.name + "' was given a tensor with no memory (a null data pointer)");
  r.vals_[v] = std::move(t);
}

void Executor::abort(Run& r) const {
  r.vals_.assign(r.vals_.size(), Tensor());
  r.next_ = static_cast<int>(plan_.steps.size());
  r.active_ = false;
  if (r.opt_.timeline) alloc_.set_step(-1);
}

void Executor::run_to(Run& r, int end_step) const {
  GRAFT_CHECK(r.active_, ErrorKind::InvalidArgument,
              "this run has ended (or failed); start a new one");
  try {
    using clock = std::chrono::steady_clock;
    Bf16MatmulScope precision(r.opt_.bf16);
    Allocator::RunScope run(alloc_);  // Note [mapped block cache] (core.cpp)
    std::vector<const Tensor*> ins;
    std::vector<Tensor*> outs;
    std::vector<Tensor>& vals = r.vals_;
    for (; r.next_ < end_step; ++r.next_) {
      const PlanStep& st = plan_.steps[r.next_];
      const Node& n = g_.nodes[st.node];
      const OpDef& d = *defs_[st.node];
      if (r.opt_.timeline) alloc_.set_step(r.next_);
      auto t0 = r.opt_.profile ? clock::now() : clock::time_point{};
      for (int v : n.inputs)
        if (v >= 0 && !vals[v].defined())
          fail_at(ErrorKind::InvalidArgument, n.name,
                  n.label() + " reads '" + g_.values[v].name +
                      "', which was not given (bind every graph input)");
      if (d.sink) {
        int v = n.inputs[0];
        Tensor grad = vals[v];
        bool releasing = false;
        for (int f : st.frees) releasing |= f == v;
        if (releasing) vals[v] = Tensor();
        bool exclusive = releasing && grad.storage().use_count() == 1;
        if (r.sink_) r.sink_(st.node, std::move(grad), exclusive);
      } else {
        ins.assign(n.inputs.size(), nullptr);
        for (size_t i = 0; i < n.inputs.size(); ++i)
          if (n.inputs[i] >= 0) ins[i] = &vals[n.inputs[i]];
        outs.assign(n.outputs.size(), nullptr);
        bool accumulate = false;
        for (size_t i = 0; i < n.outputs.size(); ++i) {
          int o = n.outputs[i];
          if (o < 0) continue;
          const Value& ov = g_.values[o];
          Tensor target;
          if (i == 0 && feeds_sink_[st.node] >= 0 && r.target_)
            target = r.target_(feeds_sink_[st.node]);
          if (target.defined() && target.dtype() == ov.dtype && target.numel() == numel(ov.shape)) {
            vals[o] = target.reshaped(ov.shape);  // the .grad itself: the kernel adds into it
            accumulate = true;
          } else if (d.alias)
            vals[o] = vals[n.inputs[0]].reshaped(ov.shape);
          else if (i == 0 && st.inplace_in >= 0)
            vals[o] = vals[st.inplace_in];
          else {
            try {
              vals[o] = Tensor::empty(ov.shape, ov.dtype, alloc_, ov.category, ov.name);
            } catch (const Error& e) {
              if (e.kind() != ErrorKind::OutOfMemory) throw;
              fail_at(ErrorKind::OutOfMemory, n.name, n.label() + ": " + e.message());
            }
          }
          outs[i] = &vals[o];
        }
        if (!d.alias) {
          KernelCtx ctx{n, ins, outs, alloc_, r.opt_.seed, accumulate, prepared_[st.node].get()};
          d.kernel(ctx);
        }
        if (r.opt_.check_finite)
          for (int o : n.outputs)
            if (o >= 0 && !all_finite(vals[o]))
              fail_at(ErrorKind::NonFinite, n.name,
                      n.label() + " produced a non-finite value (NaN or Inf) in '" +
                          g_.values[o].name + "'");
      }
      if (r.opt_.profile)
        r.times_.push_back({st.node, std::chrono::duration<double>(clock::now() - t0).count()});
      for (int v : st.frees) vals[v] = Tensor();
      if (r.opt_.progress) r.opt_.progress(r.next_ + 1, static_cast<int>(plan_.steps.size()));
    }
  } catch (...) {
    abort(r);
    throw;
  }
}

std::vector<Tensor> Executor::finish(Run& r) const {
  if (r.opt_.timeline) alloc_.set_step(-1);
  std::vector<Tensor> out;
  for (int v : plan_.keep) out.push_back(r.vals_[v]);
  r.vals_.assign(r.vals_.size(), Tensor());
  r.sink_ = nullptr;
  r.target_ = nullptr;
  r.active_ = false;
  return out;
}

}  // namespace graft

namespace graft {

std::vector<Tensor> run_inference(Graph& g, const std::map<std::string, Tensor>& inputs,
                                  Allocator& alloc, const RunOptions& opt,
                                  std::vector<OpTime>* times) {
  std::map<std::string, Shape> shapes;
  for (const auto& [name, t] : inputs) {
    int v = g.find(name);
    GRAFT_CHECK(v >= 0 && g.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "'" + name + "' is not an input of the model");
    shapes[name] = t.shape();
  }
  infer_shapes(g, shapes);
  PlanOptions po;
  po.keep = g.outputs;
  Executor ex(g, make_plan(g, po), alloc);
  for (const auto& [name, t] : inputs) ex.bind(name, t);
  auto out = ex.run(opt);
  if (times) *times = ex.op_times();
  return out;
}

}  // namespace graft
