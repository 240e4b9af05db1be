// The executor (see include/graft/exec.h).
#include "graft/exec.h"

#include <chrono>
#include <cmath>

#include "graft/ops.h"

namespace graft {

Executor::Executor(const Graph& g, Plan plan, Allocator& alloc) : g_(g), plan_(std::move(plan)), alloc_(alloc) {}

void Executor::bind(int v, Tensor t) {
  const Value& val = g_.values[v];
  GRAFT_CHECK(val.kind == ValueKind::Input || val.kind == ValueKind::Param, ErrorKind::InvalidArgument,
              "'" + val.name + "' is not a graph input or parameter");
  GRAFT_CHECK(t.dtype() == val.dtype, ErrorKind::InvalidArgument,
              "'" + val.name + "' expects dtype " + dtype_name(val.dtype) + " but got " + dtype_name(t.dtype()));
  GRAFT_CHECK(t.shape() == val.shape, ErrorKind::ShapeMismatch,
              "'" + val.name + "' was planned with shape " + shape_str(val.shape) + " but got " +
                  shape_str(t.shape()) + " (a new shape needs a new plan)");
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
  begin(opt, sink);
  try {
    run_to(static_cast<int>(plan_.steps.size()));
  } catch (...) {
    abort();
    throw;
  }
  return finish();
}

void Executor::begin(const RunOptions& opt, const SinkFn& sink) {
  opt_ = opt;
  sink_ = sink;
  next_ = 0;
  times_.clear();
  vals_.assign(g_.values.size(), Tensor());
  for (size_t v = 0; v < g_.values.size(); ++v) {
    const Value& val = g_.values[v];
    auto it = bound_.find(static_cast<int>(v));
    if (it != bound_.end()) vals_[v] = it->second;
    else if (val.kind == ValueKind::Param || val.kind == ValueKind::Constant) vals_[v] = val.data;
  }
}

void Executor::feed(int v, Tensor t) {
  const Value& val = g_.values[v];
  GRAFT_CHECK(t.dtype() == val.dtype && t.shape() == val.shape, ErrorKind::ShapeMismatch,
              "'" + val.name + "' expects " + dtype_name(val.dtype) + " " + shape_str(val.shape) + " but got " +
                  dtype_name(t.dtype()) + " " + shape_str(t.shape()));
  vals_[v] = std::move(t);
}

void Executor::abort() {
  vals_.assign(vals_.size(), Tensor());
  next_ = static_cast<int>(plan_.steps.size());
  if (opt_.timeline) alloc_.set_step(-1);
}

void Executor::run_to(int end_step) {
  using clock = std::chrono::steady_clock;
  std::vector<const Tensor*> ins;
  std::vector<Tensor*> outs;
  for (; next_ < end_step; ++next_) {
    const PlanStep& st = plan_.steps[next_];
    const Node& n = g_.nodes[st.node];
    if (opt_.timeline) alloc_.set_step(next_);
    auto t0 = opt_.profile ? clock::now() : clock::time_point{};
    for (int v : n.inputs)
      if (v >= 0 && !vals_[v].defined())
        fail(ErrorKind::InvalidArgument, n.label() + " reads '" + g_.values[v].name +
                                             "', which was not given (bind every graph input)");
    if (n.op == "GradSink" && n.domain == "graft") {
      int v = n.inputs[0];
      Tensor grad = vals_[v];
      bool releasing = false;
      for (int f : st.frees) releasing |= f == v;
      if (releasing) vals_[v] = Tensor();
      bool exclusive = releasing && grad.storage().use_count() == 1;
      if (sink_) sink_(n, std::move(grad), exclusive);
    } else {
      const OpDef& d = op_for(n);
      ins.assign(n.inputs.size(), nullptr);
      for (size_t i = 0; i < n.inputs.size(); ++i)
        if (n.inputs[i] >= 0) ins[i] = &vals_[n.inputs[i]];
      outs.assign(n.outputs.size(), nullptr);
      for (size_t i = 0; i < n.outputs.size(); ++i) {
        int o = n.outputs[i];
        if (o < 0) continue;
        const Value& ov = g_.values[o];
        if (d.alias) vals_[o] = vals_[n.inputs[0]].reshaped(ov.shape);
        else if (i == 0 && st.inplace_in >= 0) vals_[o] = vals_[st.inplace_in];
        else {
          try {
            vals_[o] = Tensor::empty(ov.shape, ov.dtype, alloc_, ov.category, ov.name);
          } catch (const Error& e) {
            if (e.kind() != ErrorKind::OutOfMemory) throw;
            fail(ErrorKind::OutOfMemory, n.label() + ": " + std::string(e.what()).substr(15));
          }
        }
        outs[i] = &vals_[o];
      }
      if (!d.alias) {
        KernelCtx ctx{n, ins, outs, alloc_};
        d.kernel(ctx);
      }
      if (opt_.check_finite)
        for (int o : n.outputs)
          if (o >= 0 && !all_finite(vals_[o]))
            fail(ErrorKind::NonFinite, n.label() + " produced a non-finite value (NaN or Inf) in '" +
                                           g_.values[o].name + "'");
    }
    if (opt_.profile) times_.push_back({st.node, std::chrono::duration<double>(clock::now() - t0).count()});
    for (int v : st.frees) vals_[v] = Tensor();
  }
}

std::vector<Tensor> Executor::finish() {
  if (opt_.timeline) alloc_.set_step(-1);
  std::vector<Tensor> out;
  for (int v : plan_.keep) out.push_back(vals_[v]);
  vals_.assign(vals_.size(), Tensor());
  sink_ = nullptr;
  return out;
}

}  // namespace graft

namespace graft {

std::vector<Tensor> run_inference(Graph& g, const std::map<std::string, Tensor>& inputs,
                                  Allocator& alloc, const RunOptions& opt, std::vector<OpTime>* times) {
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
