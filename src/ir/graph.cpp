// Graph bookkeeping and typed attribute access (see include/graft/ir.h).
#include <queue>

#include "graft/ir.h"

namespace graft {

namespace {
const char* kind_name(Attr::Kind k) {
  switch (k) {
    case Attr::Int:
      return "int";
    case Attr::Float:
      return "float";
    case Attr::String:
      return "string";
    case Attr::Ints:
      return "ints";
    case Attr::Floats:
      return "floats";
    case Attr::TensorV:
      return "tensor";
  }
  return "?";
}
const Attr* typed(const Attrs& a, const std::string& k, Attr::Kind want, const std::string& where) {
  const Attr* x = a.find(k);
  if (x && x->kind != want)
    fail(ErrorKind::InvalidModel, where + ": attribute '" + k + "' should be of type " +
                                      kind_name(want) + " but is " + kind_name(x->kind));
  return x;
}
}  // namespace

void Attrs::set_int(const std::string& k, int64_t v) {
  Attr a;
  a.kind = Attr::Int;
  a.i = v;
  m_[k] = a;
}
void Attrs::set_float(const std::string& k, double v) {
  Attr a;
  a.kind = Attr::Float;
  a.f = v;
  m_[k] = a;
}
void Attrs::set_ints(const std::string& k, std::vector<int64_t> v) {
  Attr a;
  a.kind = Attr::Ints;
  a.ints = std::move(v);
  m_[k] = a;
}
void Attrs::set_string(const std::string& k, std::string v) {
  Attr a;
  a.kind = Attr::String;
  a.s = std::move(v);
  m_[k] = a;
}
const Attr* Attrs::find(const std::string& k) const {
  auto it = m_.find(k);
  return it == m_.end() ? nullptr : &it->second;
}
int64_t Attrs::get_int(const std::string& k, int64_t d, const std::string& w) const {
  const Attr* a = typed(*this, k, Attr::Int, w);
  return a ? a->i : d;
}
double Attrs::get_float(const std::string& k, double d, const std::string& w) const {
  const Attr* a = typed(*this, k, Attr::Float, w);
  return a ? a->f : d;
}
std::string Attrs::get_string(const std::string& k, const std::string& d,
                              const std::string& w) const {
  const Attr* a = typed(*this, k, Attr::String, w);
  return a ? a->s : d;
}
std::vector<int64_t> Attrs::get_ints(const std::string& k, const std::vector<int64_t>& d,
                                     const std::string& w) const {
  const Attr* a = typed(*this, k, Attr::Ints, w);
  return a ? a->ints : d;
}

std::string Node::label() const { return "node '" + name + "' (" + op + ")"; }

int Graph::find(const std::string& n) const {
  auto it = by_name_.find(n);
  return it == by_name_.end() ? -1 : it->second;
}

int Graph::value(const std::string& n) const {
  int v = find(n);
  GRAFT_CHECK(v >= 0, ErrorKind::InvalidArgument, "the graph has no value named '" + n + "'");
  return v;
}

std::string Graph::unique_name(const std::string& base) {
  if (!by_name_.count(base)) return base;
  for (;;) {
    std::string n = base + "__" + std::to_string(++counter_);
    if (!by_name_.count(n)) return n;
  }
}

int Graph::add_value(const std::string& name, ValueKind kind, bool uniquify) {
  std::string n = uniquify ? unique_name(name) : name;
  GRAFT_CHECK(!by_name_.count(n), ErrorKind::InvalidModel,
              "value '" + n + "' is defined more than once");
  Value v;
  v.name = n;
  v.kind = kind;
  values.push_back(std::move(v));
  int id = static_cast<int>(values.size()) - 1;
  by_name_[n] = id;
  return id;
}

int Graph::add_node(Node n) {
  int id = static_cast<int>(nodes.size());
  if (n.name.empty()) n.name = n.op + "_" + std::to_string(id);
  node_names_.insert(n.name);
  for (int o : n.outputs) {
    if (o < 0) continue;
    GRAFT_CHECK(
        values[o].producer < 0 && values[o].kind == ValueKind::Intermediate,
        ErrorKind::InvalidModel,
        n.label() + " writes value '" + values[o].name + "', which already has a definition");
    values[o].producer = id;
  }
  nodes.push_back(std::move(n));
  return id;
}

int Graph::add_input(const std::string& name, DType dt, const Shape& shape) {
  int v = add_value(name, ValueKind::Input, false);
  values[v].dtype = dt;
  values[v].shape = shape;
  values[v].shape_known = true;
  inputs.push_back(v);
  return v;
}

int Graph::add_constant(const std::string& name, Tensor t, bool uniquify) {
  int v = add_value(name, ValueKind::Constant, uniquify);
  Value& val = values[v];
  val.dtype = t.dtype();
  val.shape = t.shape();
  val.shape_known = true;
  val.data = std::move(t);
  return v;
}

int Graph::add_param(const std::string& name, Tensor t) {
  int v = add_constant(name, std::move(t), false);
  values[v].kind = ValueKind::Param;
  values[v].category = Category::Parameter;
  return v;
}

std::vector<int> Graph::add_op(const std::string& op, const std::vector<int>& ins, Attrs attrs,
                               int n_outputs, const std::string& domain, const std::string& name) {
  Node n;
  n.op = op;
  n.domain = domain;
  n.name = unique_node_name(name.empty() ? op : name);
  n.inputs = ins;
  n.attrs = std::move(attrs);
  for (int k = 0; k < n_outputs; ++k)
    n.outputs.push_back(
        add_value(n.name + (n_outputs > 1 ? ":" + std::to_string(k) : std::string()),
                  ValueKind::Intermediate));
  std::vector<int> outs = n.outputs;
  add_node(std::move(n));
  return outs;
}

std::string Graph::unique_node_name(const std::string& base) {
  if (!node_names_.count(base)) {
    node_names_.insert(base);
    return base;
  }
  for (;;) {
    std::string n = base + "__" + std::to_string(++counter_);
    if (!node_names_.count(n) && !by_name_.count(n)) {
      node_names_.insert(n);
      return n;
    }
  }
}

void Graph::remove_dead_nodes() {
  std::deque<Node> kept;
  for (auto& n : nodes)
    if (!n.dead) kept.push_back(std::move(n));
  nodes = std::move(kept);
  for (auto& v : values)
    if (v.kind == ValueKind::Intermediate) v.producer = -1;
  for (size_t i = 0; i < nodes.size(); ++i)
    for (int o : nodes[i].outputs)
      if (o >= 0) values[o].producer = static_cast<int>(i);
}

int onnx_elem_type(DType t) {
  switch (t) {
    case DType::F32:
      return 1;
    case DType::I32:
      return 6;
    case DType::I64:
      return 7;
    case DType::Bool:
      return 9;
    case DType::F64:
      return 11;
    case DType::BF16:
      return 16;
  }
  return 0;
}

bool dtype_of_onnx_elem(int64_t code, DType& out) {
  for (DType t : {DType::F32, DType::F64, DType::I64, DType::I32, DType::Bool})
    if (onnx_elem_type(t) == code) {
      out = t;
      return true;
    }
  return false;
}

std::vector<std::vector<int>> Graph::consumers() const {
  std::vector<std::vector<int>> c(values.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (int v : nodes[i].inputs)
      if (v >= 0) c[v].push_back(static_cast<int>(i));
  }
  return c;
}

std::vector<int> Graph::params() const {
  std::vector<int> p;
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i].kind == ValueKind::Param) p.push_back(static_cast<int>(i));
  return p;
}

std::vector<int> topological_order(const std::vector<std::vector<int>>& succ,
                                   const std::function<bool(int, int)>& before) {
  const int n = static_cast<int>(succ.size());
  std::vector<int> indeg(n, 0);
  for (const auto& s : succ)
    for (int j : s) ++indeg[j];
  // A heap whose top is the first by `before` (std::priority_queue keeps the largest on top).
  auto later = [&](int a, int b) { return before ? before(b, a) : b < a; };
  std::priority_queue<int, std::vector<int>, decltype(later)> ready(later);
  for (int i = 0; i < n; ++i)
    if (indeg[i] == 0) ready.push(i);
  std::vector<int> order;
  order.reserve(n);
  while (!ready.empty()) {
    const int i = ready.top();
    ready.pop();
    order.push_back(i);
    for (int j : succ[i])
      if (--indeg[j] == 0) ready.push(j);
  }
  return order;
}

}  // namespace graft
