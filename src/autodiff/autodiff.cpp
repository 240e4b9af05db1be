// The autodiff driver (see include/graft/autodiff.h).
#include "graft/autodiff.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "graft/ops.h"

namespace graft {

const char* grad_mode_name(GradMode m) {
  switch (m) {
    case GradMode::Hold:
      return "hold";
    case GradMode::Accumulate:
      return "accumulate";
    case GradMode::Hook:
      return "hook";
    case GradMode::Step:
      return "step";
  }
  return "?";
}

GradMode parse_grad_mode(const std::string& s) {
  if (s == "hold") return GradMode::Hold;
  if (s == "accumulate") return GradMode::Accumulate;
  if (s == "hook") return GradMode::Hook;
  if (s == "step") return GradMode::Step;
  fail(ErrorKind::InvalidArgument,
       "unknown gradient mode '" + s + "' (use hold, accumulate, hook or step)");
}

namespace {

bool broadcastable_to(const Shape& from, const Shape& to) {
  // `to` right-aligned against `from`: each dim equal or 1.
  if (to.size() > from.size()) return false;
  size_t off = from.size() - to.size();
  for (size_t i = 0; i < to.size(); ++i)
    if (to[i] != 1 && to[i] != from[i + off]) return false;
  return true;
}

class Driver final : public GradBuilder {
 public:
  Driver(Graph& g, Allocator& alloc) : g_(g), alloc_(alloc) {}

  // --- GradBuilder ---
  const Node& node() const override { return g_.nodes[cur_]; }
  const Value& val(int v) const override { return g_.values[v]; }
  int y(int i) override {
    Node& n = g_.nodes[cur_];
    if (i < static_cast<int>(n.outputs.size()) && n.outputs[i] >= 0) return n.outputs[i];
    if (static_cast<int>(n.outputs.size()) <= i) n.outputs.resize(i + 1, -1);
    int v = g_.add_value(n.name + "__out" + std::to_string(i), ValueKind::Intermediate);
    g_.nodes[cur_].outputs[i] = v;
    g_.values[v].producer = cur_;
    infer_node(g_, cur_);
    return v;
  }
  int dy(int i) const override { return i < static_cast<int>(dys_.size()) ? dys_[i] : -1; }
  bool needs(int i) const override {
    const Node& n = node();
    if (i >= static_cast<int>(n.inputs.size()) || n.inputs[i] < 0) return false;
    if (nondiff(i)) return false;
    return needed_[n.inputs[i]];
  }
  void set_dx(int i, int v) override {
    if (!needs(i) || v < 0) return;
    const Node& n = node();
    int x = n.inputs[i];
    const Value xv = g_.values[x];
    const Value gv = g_.values[v];
    GRAFT_CHECK(gv.dtype == xv.dtype, ErrorKind::Internal,
                n.label() + ": gradient of '" + xv.name + "' has dtype " + dtype_name(gv.dtype));
    if (gv.shape != xv.shape && numel(gv.shape) != numel(xv.shape)) {
      // A broadcast gradient: sum it over the broadcast dims.
      GRAFT_CHECK(broadcastable_to(gv.shape, xv.shape), ErrorKind::Internal,
                  n.label() + ": gradient shape " + shape_str(gv.shape) + " does not reduce to " +
                      shape_str(xv.shape) + " of '" + xv.name + "'");
      Attrs a;
      a.set_ints("shape", xv.shape);
      v = emit1("SumToShape", {v}, a, "graft");
    }
    // Same size, other shape (Reshape, Squeeze, 1-D MatMul operands): a free alias.
    if (g_.values[v].shape != xv.shape) v = emit1("Reshape", {v, ints(xv.shape)});
    contrib_[x].push_back(v);
  }
  std::vector<int> emit(const std::string& op, const std::vector<int>& inputs, Attrs attrs,
                        int n_out, const std::string& domain) override {
    std::string name = (cur_ >= 0 ? g_.nodes[cur_].name : std::string("grad")) + "/" + op + "_grad";
    std::vector<int> outs = g_.add_op(op, inputs, std::move(attrs), n_out, domain, name);
    infer_node(g_, static_cast<int>(g_.nodes.size()) - 1);
    return outs;
  }
  void drop_output(int v) override {
    for (int& o : g_.nodes.back().outputs)
      if (o == v) o = -1;
  }
  int scalar(double v, DType dt) override {
    Tensor t = Tensor::empty({}, dt, alloc_, Category::Workspace, "grad_const");
    if (dt == DType::F32)
      t.data<float>()[0] = static_cast<float>(v);
    else if (dt == DType::F64)
      t.data<double>()[0] = v;
    else if (dt == DType::I64)
      t.data<int64_t>()[0] = static_cast<int64_t>(v);
    else
      fail(ErrorKind::Internal, "scalar of bool");
    return g_.add_constant("grad_const", t);
  }
  int ints(const std::vector<int64_t>& v) override {
    Tensor t = Tensor::empty({static_cast<int64_t>(v.size())}, DType::I64, alloc_,
                             Category::Workspace, "grad_shape");
    std::copy(v.begin(), v.end(), t.data<int64_t>());
    return g_.add_constant("grad_shape", t);
  }

  // --- driver ---
  BackwardGraph run(const AutodiffOptions& opt);

 private:
  bool nondiff(int i) const {
    const OpDef& d = op_for(node());
    return std::find(d.nondiff_inputs.begin(), d.nondiff_inputs.end(), i) != d.nondiff_inputs.end();
  }
  // Sums the contributions to v (in the order they were made) into one value.
  int summed(int v) {
    auto& c = contrib_[v];
    if (c.empty()) return -1;
    if (c.size() == 1) return c[0];
    int saved = cur_;
    cur_ = -1;
    int s = emit1("Sum", c);
    cur_ = saved;
    c.assign(1, s);
    return s;
  }

  Graph& g_;
  Allocator& alloc_;
  int cur_ = -1;
  std::vector<int> dys_;
  std::vector<bool> needed_;
  std::map<int, std::vector<int>> contrib_;
};

BackwardGraph Driver::run(const AutodiffOptions& opt) {
  BackwardGraph bg;
  // ---- validate everything before touching the graph ----
  std::set<int> frozen;
  for (const auto& f : opt.freeze) {
    int v = g_.find(f);
    GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Param, ErrorKind::InvalidArgument,
                "cannot freeze '" + f + "': the model has no parameter of that name");
    frozen.insert(v);
  }
  std::vector<int> seeds;  // values whose gradient is given
  if (opt.output_grads.empty()) {
    int loss = g_.find(opt.loss);
    if (loss < 0 || opt.loss.empty()) {
      std::string outs;
      for (int o : g_.outputs) outs += (outs.empty() ? "" : ", ") + g_.values[o].name;
      fail(ErrorKind::InvalidArgument,
           "the loss '" + opt.loss + "' is not a value of the model (its outputs are: " + outs +
               ")");
    }
    const Value& lv = g_.values[loss];
    GRAFT_CHECK(is_float(lv.dtype), ErrorKind::InvalidArgument,
                "the loss '" + opt.loss + "' is not a float value");
    GRAFT_CHECK(
        lv.shape_known && numel(lv.shape) == 1, ErrorKind::InvalidArgument,
        "the loss '" + opt.loss + "' has shape " + shape_str(lv.shape) +
            "; it must be a scalar (reduce it, e.g. with ReduceMean, or pass output gradients)");
    GRAFT_CHECK(std::isfinite(opt.loss_scale) && opt.loss_scale != 0, ErrorKind::InvalidArgument,
                "the loss scale must be finite and non-zero");
    bg.loss = loss;
    seeds.push_back(loss);
  } else {
    for (const auto& o : opt.output_grads) {
      int v = g_.find(o);
      GRAFT_CHECK(v >= 0, ErrorKind::InvalidArgument, "no output named '" + o + "'");
      GRAFT_CHECK(is_float(g_.values[v].dtype), ErrorKind::InvalidArgument,
                  "output '" + o + "' is not float");
      seeds.push_back(v);
    }
  }
  std::vector<int> req_inputs;
  for (const auto& n : opt.input_grads) {
    int v = g_.find(n);
    GRAFT_CHECK(v >= 0 && g_.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "cannot differentiate '" + n + "': it is not a graph input");
    req_inputs.push_back(v);
  }
  const int nv0 = static_cast<int>(g_.values.size());
  const int nn0 = static_cast<int>(g_.nodes.size());
  bg.n_forward_nodes = nn0;
  for (int p : g_.params())
    if (!frozen.count(p) && is_float(g_.values[p].dtype)) bg.params.push_back(p);

  // ---- requires-grad (forward) and needed (backward) ----
  std::vector<int> origin(nv0, -1);  // a parameter / input reaching the value (for messages)
  for (int p : bg.params) origin[p] = p;
  for (int v : req_inputs) origin[v] = v;
  for (int i = 0; i < nn0; ++i) {
    const Node& n = g_.nodes[i];
    const OpDef& d = op_for(n);
    int from = -1;
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      int v = n.inputs[k];
      if (v < 0 || origin[v] < 0) continue;
      if (std::find(d.nondiff_inputs.begin(), d.nondiff_inputs.end(), static_cast<int>(k)) !=
          d.nondiff_inputs.end())
        continue;
      from = origin[v];
      break;
    }
    if (from < 0) continue;
    for (int o : n.outputs)
      if (o >= 0 && is_float(g_.values[o].dtype)) origin[o] = from;
  }
  needed_.assign(nv0, false);
  for (int s : seeds) needed_[s] = origin[s] >= 0;
  std::vector<bool> node_needed(nn0, false);
  for (int i = nn0 - 1; i >= 0; --i) {
    const Node& n = g_.nodes[i];
    bool any = false;
    for (int o : n.outputs) any |= o >= 0 && needed_[o];
    if (!any) continue;
    node_needed[i] = true;
    const OpDef& d = op_for(n);
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      int v = n.inputs[k];
      if (v < 0 || origin[v] < 0) continue;
      if (std::find(d.nondiff_inputs.begin(), d.nondiff_inputs.end(), static_cast<int>(k)) !=
          d.nondiff_inputs.end())
        continue;
      needed_[v] = true;
    }
    if (!d.grad)
      fail(ErrorKind::Unsupported,
           n.label() + " has no gradient rule, but parameter '" +
               g_.values[origin[n.outputs[0] >= 0 ? n.outputs[0] : n.inputs[0]]].name +
               "' needs a gradient through it (freeze that parameter, or keep this "
               "part of the model outside graft)");
  }

  // ---- seeds ----
  if (bg.loss >= 0) {
    const Value lv = g_.values[bg.loss];  // a copy: adding values below may move the vector
    int one = scalar(opt.loss_scale, lv.dtype);
    bg.loss_seed = one;
    if (!lv.shape.empty()) one = emit1("Reshape", {one, ints(lv.shape)});
    contrib_[bg.loss].push_back(one);
  } else {
    for (size_t k = 0; k < seeds.size(); ++k) {
      const Value ov = g_.values[seeds[k]];  // a copy: add_value may move the vector
      int in = g_.add_input(g_.unique_name(ov.name + "__grad"), ov.dtype, ov.shape);
      bg.output_grad_inputs.push_back(in);
      if (needed_[seeds[k]]) contrib_[seeds[k]].push_back(in);
    }
  }

  // ---- reverse walk ----
  for (int i = nn0 - 1; i >= 0; --i) {
    if (!node_needed[i]) continue;
    cur_ = i;
    dys_.assign(g_.nodes[i].outputs.size(), -1);
    bool any = false;
    for (size_t k = 0; k < g_.nodes[i].outputs.size(); ++k) {
      int o = g_.nodes[i].outputs[k];
      if (o < 0) continue;
      dys_[k] = summed(o);
      any |= dys_[k] >= 0;
    }
    if (!any) continue;
    // Rules hold references to the node, values and shapes while they emit new nodes: the graph's
    // deques keep them valid.
    op_for(g_.nodes[i]).grad(*this);
  }
  cur_ = -1;

  // ---- parameter gradients: sinks or held outputs ----
  for (int p : bg.params) {
    int gsum = p < nv0 && needed_[p] ? summed(p) : -1;
    bg.param_grads.push_back(gsum);
    bg.sinks.push_back(-1);
    if (gsum < 0) continue;
    g_.values[gsum].category = Category::Gradient;
    if (opt.mode == GradMode::Hold) continue;
    Attrs a;
    a.set_string("param",
                 g_.values[p].name);  // for printing; BackwardGraph::sinks maps sink -> parameter
    g_.add_op("GradSink", {gsum}, std::move(a), 0, "graft", "GradSink/" + g_.values[p].name);
    bg.sinks.back() = static_cast<int>(g_.nodes.size()) - 1;
    infer_node(g_, bg.sinks.back());
  }
  for (int v : req_inputs) bg.input_grads.push_back(needed_[v] ? summed(v) : -1);
  return bg;
}

}  // namespace

BackwardGraph build_backward(Graph& g, const AutodiffOptions& opt) {
  Driver d(g, opt.alloc ? *opt.alloc : Allocator::global());
  return d.run(opt);
}

}  // namespace graft
