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
  using clock = std::chrono::steady_clock;
  times_.clear();
  std::vector<Tensor> vals(g_.values.size());
  for (size_t v = 0; v < g_.values.size(); ++v) {
    const Value& val = g_.values[v];
    auto it = bound_.find(static_cast<int>(v));
    if (it != bound_.end()) vals[v] = it->second;
    else if (val.kind == ValueKind::Param || val.kind == ValueKind::Constant) vals[v] = val.data;
  }
  for (int v : g_.inputs)
    GRAFT_CHECK(vals[v].defined(), ErrorKind::InvalidArgument,
                "graph input '" + g_.values[v].name + "' was not given");

  std::vector<const Tensor*> ins;
  std::vector<Tensor*> outs;
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const PlanStep& st = plan_.steps[s];
    const Node& n = g_.nodes[st.node];
    if (opt.timeline) alloc_.set_step(static_cast<int64_t>(s));
    auto t0 = opt.profile ? clock::now() : clock::time_point{};
    if (n.op == "GradSink" && n.domain == "graft") {
      int v = n.inputs[0];
      Tensor grad = vals[v];
      bool releasing = false;
      for (int f : st.frees) releasing |= f == v;
      if (releasing) vals[v] = Tensor();
      bool exclusive = releasing && grad.storage().use_count() == 1;
      if (sink) sink(n, std::move(grad), exclusive);
    } else {
      const OpDef& d = op_for(n);
      ins.assign(n.inputs.size(), nullptr);
      for (size_t i = 0; i < n.inputs.size(); ++i)
        if (n.inputs[i] >= 0) ins[i] = &vals[n.inputs[i]];
      outs.assign(n.outputs.size(), nullptr);
      for (size_t i = 0; i < n.outputs.size(); ++i) {
        int o = n.outputs[i];
        if (o < 0) continue;
        const Value& ov = g_.values[o];
        if (d.alias) {
          vals[o] = vals[n.inputs[0]].reshaped(ov.shape);
        } else if (i == 0 && st.inplace_in >= 0) {
          vals[o] = vals[st.inplace_in];
        } else {
          vals[o] = Tensor::empty(ov.shape, ov.dtype, alloc_, ov.category, ov.name);
        }
        outs[i] = &vals[o];
      }
      if (!d.alias) {
        KernelCtx ctx{n, ins, outs, alloc_};
        d.kernel(ctx);
      }
      if (opt.check_finite)
        for (int o : n.outputs)
          if (o >= 0 && !all_finite(vals[o]))
            fail(ErrorKind::NonFinite, n.label() + " produced a non-finite value (NaN or Inf) in '" +
                                           g_.values[o].name + "'");
    }
    if (opt.profile)
      times_.push_back({st.node, std::chrono::duration<double>(clock::now() - t0).count()});
    for (int v : st.frees) vals[v] = Tensor();
  }
  if (opt.timeline) alloc_.set_step(-1);
  std::vector<Tensor> out;
  for (int v : plan_.keep) out.push_back(vals[v]);
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
