// Graphs from lists of named nodes: the one place a node list is checked and ordered, for both
// ways a graph comes in (an ONNX file, src/ir/onnx_import.cpp, and graft's PyTorch capture,
// python/graft/_aten.py through the Python bindings). Everything in the list is untrusted: a value
// written twice, a read of a value nothing defines, a cycle, an op domain graft does not run are
// errors naming the node; the nodes are re-sorted topologically (the list's order kept where it is
// valid).
#include <set>
#include <unordered_map>

#include "graft/ir.h"

namespace graft {

void check_opset(int64_t opset) {
  GRAFT_CHECK(
      opset >= 13 && opset <= 17, ErrorKind::Unsupported,
      "the model uses opset " + std::to_string(opset) +
          " of the default domain; graft supports opsets 13 to 17 (re-export with "
          "torch.onnx.export(..., opset_version=17) or convert with onnx.version_converter)");
}

bool collect_unsupported(std::vector<std::string>* unsupported, const std::function<void()>& f) {
  if (!unsupported) return f(), true;
  try {
    f();
    return true;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Unsupported) throw;
    unsupported->push_back(e.message());
    return false;
  }
}

namespace {

std::string spec_label(const NodeSpec& n, size_t i) {
  return "node '" + (n.name.empty() ? "#" + std::to_string(i) : n.name) + "' (" + n.op + ")";
}

// Turns a Constant node's attribute into a tensor.
Tensor constant_value(const Node& n, Allocator& alloc) {
  const auto& all = n.attrs.all();
  GRAFT_CHECK(all.size() == 1, ErrorKind::InvalidModel,
              n.label() + " must have exactly one value attribute");
  const auto& [k, a] = *all.begin();
  auto make = [&](DType dt, Shape s) {
    return Tensor::empty(s, dt, alloc, Category::Workspace, n.name);
  };
  if (k == "value" && a.kind == Attr::TensorV) return a.t;
  if (k == "value_float" && a.kind == Attr::Float) {
    Tensor t = make(DType::F32, {});
    t.data<float>()[0] = static_cast<float>(a.f);
    return t;
  }
  if (k == "value_floats" && a.kind == Attr::Floats) {
    Tensor t = make(DType::F32, {static_cast<int64_t>(a.floats.size())});
    for (size_t i = 0; i < a.floats.size(); ++i)
      t.data<float>()[i] = static_cast<float>(a.floats[i]);
    return t;
  }
  if (k == "value_int" && a.kind == Attr::Int) {
    Tensor t = make(DType::I64, {});
    t.data<int64_t>()[0] = a.i;
    return t;
  }
  if (k == "value_ints" && a.kind == Attr::Ints) {
    Tensor t = make(DType::I64, {static_cast<int64_t>(a.ints.size())});
    std::copy(a.ints.begin(), a.ints.end(), t.data<int64_t>());
    return t;
  }
  fail(ErrorKind::Unsupported, n.label() + ": Constant attribute '" + k + "' is not supported");
}

}  // namespace

void add_nodes(Graph& g, std::vector<NodeSpec> nodes, Allocator& alloc,
               std::vector<std::string>* unsupported) {
  const size_t nn = nodes.size();
  std::unordered_map<std::string, size_t> producer_of;
  for (size_t i = 0; i < nn; ++i) {
    const NodeSpec& n = nodes[i];
    const std::string label = spec_label(n, i);
    // graft's own domain: only the ops graft's PyTorch capture writes (python/graft/_aten.py, Note
    // [capture]): StopGradient (a constant for autodiff where eager's autograd stops a gradient),
    // the math ONNX lacks (src/ops/math.cpp, Atan2 in binary.cpp), RRelu (dropout.cpp), PythonOp (a
    // custom autograd.Function), CTCLoss and Attention (fused scaled-dot-product attention,
    // src/ops/attention.cpp).
    static const std::set<std::string> kGraftOpsInFiles = {"StopGradient", "Trunc",   "Expm1",
                                                           "Log1p",        "Atan2",   "RRelu",
                                                           "PythonOp",     "CTCLoss", "Attention"};
    GRAFT_CHECK(
        n.domain.empty() || n.domain == "ai.onnx" ||
            (n.domain == "graft" && kGraftOpsInFiles.count(n.op)),
        ErrorKind::Unsupported,
        label + " is in domain '" + n.domain + "'; graft supports the default ONNX domain only");
    for (const auto& o : n.outputs) {
      if (o.empty()) continue;
      GRAFT_CHECK(g.find(o) < 0 && !producer_of.count(o), ErrorKind::InvalidModel,
                  label + " writes value '" + o + "', which already has a definition");
      producer_of[o] = i;
    }
  }
  std::vector<std::vector<int>> succ(nn);
  for (size_t i = 0; i < nn; ++i) {
    for (const auto& in : nodes[i].inputs) {
      if (in.empty()) continue;
      auto it = producer_of.find(in);
      if (it != producer_of.end()) {
        succ[it->second].push_back(static_cast<int>(i));
      } else {
        GRAFT_CHECK(g.find(in) >= 0, ErrorKind::InvalidModel,
                    spec_label(nodes[i], i) + " reads value '" + in +
                        "', which is not a graph input, an initializer or any node's output");
      }
    }
  }
  const std::vector<int> order = topological_order(succ);  // list order where it is valid
  if (order.size() != nn) {
    std::vector<bool> placed(nn, false);
    for (int i : order) placed[i] = true;
    for (size_t i = 0; i < nn; ++i)
      if (!placed[i])
        fail(ErrorKind::InvalidModel,
             spec_label(nodes[i], i) + " is part of a cycle; ONNX graphs must be acyclic");
  }
  auto lenient = [&](const std::function<void()>& f) {
    return collect_unsupported(unsupported, f);
  };
  for (int i : order) {
    NodeSpec& s = nodes[i];
    Node n;
    n.op = s.op;
    if (s.domain == "graft") n.domain = "graft";
    n.name = s.name.empty() ? g.unique_name(n.op + "_" + std::to_string(i)) : s.name;
    n.attrs = std::move(s.attrs);
    for (const auto& in : s.inputs) n.inputs.push_back(in.empty() ? -1 : g.find(in));
    if (n.op == "Constant") {
      GRAFT_CHECK(s.outputs.size() == 1, ErrorKind::InvalidModel,
                  n.label() + " must have one output");
      if (!s.complete ||
          !lenient([&] { g.add_constant(s.outputs[0], constant_value(n, alloc), false); }))
        g.add_value(s.outputs[0], ValueKind::Constant, false);  // recorded: no data
      continue;
    }
    for (const auto& o : s.outputs)
      n.outputs.push_back(o.empty() ? -1 : g.add_value(o, ValueKind::Intermediate, false));
    g.add_node(std::move(n));
  }
}

void set_outputs(Graph& g, const std::vector<std::string>& names) {
  for (const auto& name : names) {
    int v = g.find(name);
    GRAFT_CHECK(v >= 0, ErrorKind::InvalidModel,
                "graph output '" + name + "' is not produced by any node");
    g.outputs.push_back(v);
  }
}

}  // namespace graft
