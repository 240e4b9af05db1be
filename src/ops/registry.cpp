// The op table lookup, static shape inference and constant folding.
#include <algorithm>

#include "graft/ops.h"

namespace graft {
namespace {
void require_float_sink(InferCtx& c) {
  if (!is_float(c.dtype(0))) c.error(ErrorKind::Internal, "gradient sink fed a non-float value");
}
}  // namespace

namespace {
// graft.GradSink(grad): where a parameter's summed gradient leaves the graph. It has no outputs
// and no kernel: the executor hands the gradient to the session's sink (accumulate or hook).
void infer_sink(InferCtx& c) { require_float_sink(c); }
}  // namespace

const std::vector<const OpDef*>& all_ops() {
  static const std::vector<const OpDef*> table = [] {
    std::vector<const OpDef*> t;
    register_unary_ops(t);
    register_binary_ops(t);
    register_linalg_ops(t);
    register_einsum_ops(t);
    register_reduce_ops(t);
    register_shape_ops(t);
    register_index_ops(t);
    register_softmax_ops(t);
    register_norm_ops(t);
    register_dropout_ops(t);
    register_conv_ops(t);
    register_conv_transpose_ops(t);
    register_pool_ops(t);
    register_resize_ops(t);
    register_grid_sample_ops(t);
    register_rnn_ops(t);
    register_math_ops(t);
    register_python_ops(t);
    register_ctc_ops(t);
    register_attention_ops(t);
    // Input 0 is the gradient; further inputs only order the sink after their producers (step
    // mode: a parameter is updated only after every backward node that reads it has run).
    static const OpDef sink{.name = "GradSink",
                            .domain = "graft",
                            .max_in = 1 << 20,
                            .min_out = 0,
                            .max_out = 0,
                            .infer = infer_sink,
                            .foldable = false,
                            .sink = true};
    t.push_back(&sink);
    return t;
  }();
  return table;
}

const OpDef* find_op(const std::string& name, const std::string& domain) {
  for (const OpDef* d : all_ops())
    if (name == d->name && domain == d->domain) return d;
  return nullptr;
}

const OpDef& op_for(const Node& n) {
  if (n.def) return *n.def;  // resolved once (infer_node)
  const OpDef* d = find_op(n.op, n.domain);
  if (!d)
    fail_at(
        ErrorKind::Unsupported, n.name,
        n.label() + ": graft has no kernel for op '" + n.op + "'" +
            (n.domain.empty() ? "" : " in domain '" + n.domain + "'") +
            " (run `graft inspect` to list unsupported ops; keep that part of the model outside "
            "graft or rewrite it with supported ops)");
  int ni = static_cast<int>(n.inputs.size()), no = static_cast<int>(n.outputs.size());
  // Trailing absent optional inputs/outputs do not count.
  while (ni > 0 && n.inputs[ni - 1] < 0) --ni;
  GRAFT_CHECK(ni >= d->min_in && ni <= d->max_in, ErrorKind::InvalidModel,
              n.label() + " has " + std::to_string(ni) + " inputs; " + n.op + " takes " +
                  std::to_string(d->min_in) + " to " + std::to_string(d->max_in));
  GRAFT_CHECK(no >= d->min_out && no <= d->max_out, ErrorKind::InvalidModel,
              n.label() + " has " + std::to_string(no) + " outputs; " + n.op + " makes " +
                  std::to_string(d->min_out) + " to " + std::to_string(d->max_out));
  for (int i = 0; i < d->min_in; ++i)
    GRAFT_CHECK(n.inputs[i] >= 0, ErrorKind::InvalidModel,
                n.label() + ": required input " + std::to_string(i) + " is missing");
  return *d;
}

const OpDef* op_def(const Node& n) { return n.def ? n.def : find_op(n.op, n.domain); }

double node_flops(const Graph& g, const Node& n) {
  const OpDef* d = op_def(n);
  return d && d->flops ? d->flops(g, n) : 0.0;
}

BlockedUse blocked_elementwise(const Graph& g, const Node& n) {
  const Shape* first = nullptr;
  for (const auto* list : {&n.inputs, &n.outputs})
    for (int v : *list) {
      if (v < 0) continue;
      const Shape& s = g.values[v].shape;
      if (first && s != *first) return {};
      first = &s;
    }
  BlockedUse u;
  u.in = n.inputs.size() >= 32 ? ~0u : (1u << n.inputs.size()) - 1;
  u.out = n.outputs.size() >= 32 ? ~0u : (1u << n.outputs.size()) - 1;
  u.tied = true;
  return u;
}

// --- InferCtx / KernelCtx ----------------------------------------------------------------------
const Value& InferCtx::in(int i) const {
  GRAFT_CHECK(has_in(i), ErrorKind::InvalidModel,
              node().label() + ": input " + std::to_string(i) + " is missing");
  return g_.values[node().inputs[i]];
}

const Tensor* InferCtx::const_in(int i) const {
  if (!has_in(i)) return nullptr;
  const Value& v = in(i);
  return v.kind == ValueKind::Constant && v.data.defined() ? &v.data : nullptr;
}

std::vector<int64_t> InferCtx::ints_in(int i) const {
  const Tensor* t = const_in(i);
  if (!t)
    error(ErrorKind::Unsupported,
          "input '" + in(i).name +
              "' must be a constant (graft plans static shapes; a data-dependent shape is not "
              "supported)");
  if (t->dtype() != DType::I64)
    error(ErrorKind::InvalidModel, "input '" + in(i).name + "' must be int64");
  return std::vector<int64_t>(t->data<int64_t>(), t->data<int64_t>() + t->numel());
}

void InferCtx::set_out(int i, DType dt, const Shape& s) {
  if (!has_out(i)) return;
  for (int64_t d : s)
    if (d < 0) error(ErrorKind::ShapeMismatch, "computed a negative dimension in " + shape_str(s));
  try {
    numel(s);  // overflow check
  } catch (const Error& e) {
    error(ErrorKind::InvalidModel, "output '" + g_.values[node().outputs[i]].name +
                                       "' would have shape " + shape_str(s) +
                                       ", more elements than int64 holds");
  }
  Value& v = g_.values[node().outputs[i]];
  v.dtype = dt;
  v.shape = s;
  v.shape_known = true;
}

void InferCtx::error(ErrorKind k, const std::string& msg) const {
  fail_at(k, node().name, node().label() + ": " + msg);
}

int normalize_axis(int64_t axis, int rank, const Node& n, const char* what) {
  if (axis < -rank || axis >= rank)
    fail_at(ErrorKind::InvalidModel, n.name,
            n.label() + ": " + what + " " + std::to_string(axis) + " is out of range for rank " +
                std::to_string(rank));
  return static_cast<int>(axis < 0 ? axis + rank : axis);
}

void KernelCtx::error(ErrorKind k, const std::string& msg) const {
  fail_at(k, node.name, node.label() + ": " + msg);
}

void KernelCtx::not_prepared() const {
  error(ErrorKind::Internal, "the kernel reads prepared attributes but the node was not prepared");
}

// --- inference and folding ---------------------------------------------------------------------
void infer_node(Graph& g, int ni) {
  Node& n = g.nodes[ni];
  const OpDef& d = op_for(n);
  n.def = &d;
  for (int v : n.inputs)
    if (v >= 0 && !g.values[v].shape_known)
      fail(ErrorKind::InvalidArgument,
           n.label() + " reads '" + g.values[v].name + "', whose shape is not known");
  InferCtx ctx(g, ni);
  d.infer(ctx);
  if (n.attrs.has(kBf16OutAttr) && n.attrs.get_int(kBf16OutAttr, 0, n.label())) {
    // Note [bf16 writers]: the kernel rounds output 0 to bfloat16 as it writes it
    const int o = n.outputs.empty() ? -1 : n.outputs[0];
    if (!d.bf16_out || o < 0 || g.values[o].dtype != DType::F32)
      fail_at(ErrorKind::Internal, n.name,
              n.label() + ": " + kBf16OutAttr + " on an op that cannot write a bfloat16 output");
    g.values[o].dtype = DType::BF16;
  }
  for (int o : n.outputs)
    if (o >= 0 && !g.values[o].shape_known)
      fail(ErrorKind::Internal,
           n.label() + ": shape function left '" + g.values[o].name + "' unset");
}

std::shared_ptr<const void> prepare_node(const Node& n) {
  const OpDef& d = op_for(n);
  return d.prepare ? d.prepare(n) : nullptr;
}

void run_node(const Node& n, const std::vector<const Tensor*>& ins, std::vector<Tensor*>& outs,
              Allocator& alloc) {
  const OpDef& d = op_for(n);
  if (d.alias) {
    *outs[0] = ins[0]->reshaped(outs[0]->shape());
    return;
  }
  const std::shared_ptr<const void> attrs = prepare_node(n);
  KernelCtx ctx{n, ins, outs, alloc};
  ctx.prepared = attrs.get();
  d.kernel(ctx);
}

constexpr int64_t kMaxFoldBytes = int64_t(16) << 20;

void infer_shapes(Graph& g, const std::map<std::string, Shape>& shapes, Allocator* fold_alloc) {
  for (const auto& [name, s] : shapes) {
    int v = g.find(name);
    GRAFT_CHECK(v >= 0 && g.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "'" + name + "' is not a graph input");
  }
  for (int v : g.inputs) {
    Value& val = g.values[v];
    auto it = shapes.find(val.name);
    if (it != shapes.end()) {
      const Shape& s = it->second;
      if (!val.dim_params.empty()) {
        GRAFT_CHECK(s.size() == val.dim_params.size(), ErrorKind::ShapeMismatch,
                    "input '" + val.name + "' has rank " + std::to_string(val.dim_params.size()) +
                        " but shape " + shape_str(s) + " was given");
        for (size_t i = 0; i < s.size(); ++i)
          GRAFT_CHECK(
              val.dim_params[i].empty() == false || val.shape[i] == s[i], ErrorKind::ShapeMismatch,
              "input '" + val.name + "' has fixed dimension " + std::to_string(i) + " = " +
                  std::to_string(val.shape[i]) + " but shape " + shape_str(s) + " was given");
      }
      for (int64_t d : s)
        GRAFT_CHECK(d >= 0, ErrorKind::InvalidArgument,
                    "input '" + val.name + "': negative dimension");
      numel(s, "input '" + val.name + "'");
      val.shape = s;
      val.shape_known = true;
    }
    if (!val.shape_known) {
      std::string dims;
      for (size_t i = 0; i < val.dim_params.size(); ++i)
        dims += (i ? "," : "") +
                (val.dim_params[i].empty() ? std::to_string(val.shape[i]) : val.dim_params[i]);
      fail(ErrorKind::InvalidArgument, "input '" + val.name + "' has symbolic shape [" + dims +
                                           "]; give its shape (e.g. --input " + val.name + "=2x3)");
    }
  }
  Allocator& alloc = fold_alloc ? *fold_alloc : Allocator::global();
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    infer_node(g, static_cast<int>(ni));
    Node& n = g.nodes[ni];
    const OpDef& d = op_for(n);
    // Shape's output depends only on its input's (now known) shape: it is always a constant.
    bool all_const = d.foldable;
    for (int v : n.inputs)
      if (v >= 0 && g.values[v].kind != ValueKind::Constant) all_const = false;
    bool is_shape = d.shape_only;
    if (!all_const && !is_shape) continue;
    // Folding allocates at plan time, from sizes the model declares: fold only small results
    // (shape arithmetic), and leave big ones to the executor, whose allocations are checked.
    int64_t out_bytes = 0;
    for (int o : n.outputs)
      if (o >= 0) out_bytes += g.values[o].bytes();
    if (out_bytes > kMaxFoldBytes) continue;
    std::vector<const Tensor*> ins;
    Tensor placeholder;
    for (int v : n.inputs) ins.push_back(v >= 0 ? &g.values[v].data : nullptr);
    if (is_shape && !all_const) {
      // The kernel reads only the shape: hand it a zero-size stand-in of the right shape.
      placeholder = Tensor::external(nullptr, g.values[n.inputs[0]].shape,
                                     g.values[n.inputs[0]].dtype, nullptr);
      ins[0] = &placeholder;
    }
    std::vector<Tensor> out_t(n.outputs.size());
    std::vector<Tensor*> outs(n.outputs.size(), nullptr);
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      if (n.outputs[i] < 0) continue;
      const Value& ov = g.values[n.outputs[i]];
      out_t[i] = Tensor::empty(ov.shape, ov.dtype, alloc, Category::Workspace, ov.name);
      outs[i] = &out_t[i];
    }
    run_node(n, ins, outs, alloc);
    for (size_t i = 0; i < n.outputs.size(); ++i) {
      if (n.outputs[i] < 0) continue;
      Value& ov = g.values[n.outputs[i]];
      ov.kind = ValueKind::Constant;
      ov.data = out_t[i];
      ov.producer = -1;
    }
    n.dead = true;
  }
  g.remove_dead_nodes();
}

}  // namespace graft
