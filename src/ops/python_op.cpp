// graft.PythonOp and graft.PythonOpGrad: a node whose forward and whose backward run outside graft,
// through the runner the embedding process installs (set_python_op_runner). The PyTorch front end
// puts a custom torch.autograd.Function there (python/graft/_pyfunc.py): PyTorch runs the
// Function's own forward and backward, as ORTModule's PythonOp does, and graft plans everything
// around it. The graph knows only what planning needs: the outputs' dtypes and shapes.
//
// PythonOp(x...) -> y...        attributes: fn (the runner's key), name (for errors),
//                                out_dtypes (ONNX element types), out_ranks, out_dims (flattened)
// PythonOpGrad(dy...) -> dx...  one dy per PythonOp output (absent where no gradient flows), one
//                               dx per PythonOp input (absent where none is needed); in_dtypes,
//                               in_ranks, in_dims describe the dx.
// Neither is folded or recomputed (the Function may draw random numbers or keep state).
#include <mutex>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

std::mutex g_runner_mu;
PythonOpRunner g_runner;

PythonOpRunner runner() {
  std::lock_guard<std::mutex> lk(g_runner_mu);
  return g_runner;
}

// (dtype, shape) per tensor from the dtypes / ranks / flattened dims attributes with `prefix`.
std::vector<std::pair<DType, Shape>> described(const Node& n, const std::string& prefix) {
  auto bad = [&](const std::string& m) {
    fail_at(ErrorKind::InvalidModel, n.name, n.label() + ": " + m);
  };
  const auto types = n.attrs.get_ints(prefix + "_dtypes", {}, n.label());
  const auto ranks = n.attrs.get_ints(prefix + "_ranks", {}, n.label());
  const auto dims = n.attrs.get_ints(prefix + "_dims", {}, n.label());
  if (types.size() != ranks.size())
    bad(prefix + "_dtypes and " + prefix + "_ranks differ in length");
  std::vector<std::pair<DType, Shape>> r;
  size_t at = 0;
  for (size_t i = 0; i < types.size(); ++i) {
    DType dt;
    if (!dtype_of_onnx_elem(types[i], dt)) bad("element type " + std::to_string(types[i]));
    if (ranks[i] < 0 || at + static_cast<size_t>(ranks[i]) > dims.size())
      bad(prefix + "_dims is too short for " + prefix + "_ranks");
    Shape s(dims.begin() + static_cast<int64_t>(at),
            dims.begin() + static_cast<int64_t>(at) + ranks[i]);
    for (int64_t d : s)
      if (d < 0) bad("a negative dimension");
    at += static_cast<size_t>(ranks[i]);
    r.emplace_back(dt, s);
  }
  if (at != dims.size()) bad(prefix + "_dims is longer than " + prefix + "_ranks says");
  return r;
}

void infer_described(InferCtx& c, const std::string& prefix) {
  const auto outs = described(c.node(), prefix);
  if (static_cast<int>(outs.size()) != c.n_out())
    c.error(ErrorKind::InvalidModel, "the node has " + std::to_string(c.n_out()) +
                                         " outputs but its attributes describe " +
                                         std::to_string(outs.size()));
  for (int i = 0; i < c.n_out(); ++i)
    if (c.has_out(i)) c.set_out(i, outs[i].first, outs[i].second);
}
void infer_python_op(InferCtx& c) { infer_described(c, "out"); }
void infer_python_op_grad(InferCtx& c) { infer_described(c, "in"); }

struct PythonOpAttrs {
  int64_t fn = -1;         // the Function's key in the runner's table
  std::string name = "?";  // the Function's name, for messages
};
PythonOpAttrs python_op_attrs(const Node& n) {
  return {n.attrs.get_int("fn", -1, n.label()), n.attrs.get_string("name", "?", n.label())};
}
std::shared_ptr<const void> prepare_python_op(const Node& n) {
  return prepared(python_op_attrs(n));
}

void run(KernelCtx& c, bool backward) {
  const PythonOpAttrs& a = c.attrs<PythonOpAttrs>();
  PythonOpRunner r = runner();
  if (!r)
    c.error(ErrorKind::Unsupported,
            "the autograd.Function '" + a.name +
                "' runs in Python: this graph needs the PyTorch front end (graft.GraftModule)");
  r(c, a.fn, backward);
}
void python_op_kernel(KernelCtx& c) { run(c, false); }
void python_op_grad_kernel(KernelCtx& c) { run(c, true); }

// dx... = PythonOpGrad(dy...): the Function's own backward, for the inputs that need a gradient.
void grad_python_op(GradBuilder& g) {
  const Node& n = g.node();
  std::vector<int> dys;
  bool any = false;
  for (size_t i = 0; i < n.outputs.size(); ++i) {
    dys.push_back(g.dy(static_cast<int>(i)));
    any = any || dys.back() >= 0;
  }
  if (!any) return;
  Attrs a;
  const PythonOpAttrs pa = python_op_attrs(n);
  a.set_int("fn", pa.fn);
  a.set_string("name", pa.name);
  std::vector<int64_t> types, ranks, dims;
  for (int x : n.inputs) {
    const Value& v = g.val(x);
    types.push_back(onnx_elem_type(v.dtype));
    ranks.push_back(static_cast<int64_t>(v.shape.size()));
    dims.insert(dims.end(), v.shape.begin(), v.shape.end());
  }
  a.set_ints("in_dtypes", types);
  a.set_ints("in_ranks", ranks);
  a.set_ints("in_dims", dims);
  auto dxs = g.emit("PythonOpGrad", dys, a, static_cast<int>(n.inputs.size()), "graft");
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    const bool floating = is_float(g.val(n.inputs[i]).dtype);
    if (floating && g.needs(static_cast<int>(i)))
      g.set_dx(static_cast<int>(i), dxs[i]);
    else
      g.drop_output(dxs[i]);
  }
}

const OpDef kOps[] = {
    {.name = "PythonOp",
     .domain = "graft",
     .min_in = 0,
     .max_in = 1 << 16,
     .min_out = 1,
     .max_out = 1 << 16,
     .infer = infer_python_op,
     .prepare = prepare_python_op,
     .kernel = python_op_kernel,
     .grad = grad_python_op,
     .foldable = false,
     .random = true,
     .recompute = false},
    {.name = "PythonOpGrad",
     .domain = "graft",
     .min_in = 0,
     .max_in = 1 << 16,
     .min_out = 1,
     .max_out = 1 << 16,
     .infer = infer_python_op_grad,
     .prepare = prepare_python_op,
     .kernel = python_op_grad_kernel,
     .foldable = false,
     .random = true,
     .recompute = false},
};

}  // namespace

void set_python_op_runner(PythonOpRunner r) {
  std::lock_guard<std::mutex> lk(g_runner_mu);
  g_runner = std::move(r);
}

void register_python_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
