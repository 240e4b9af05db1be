// graft IR: values, nodes and the graph, plus ONNX import.
//
// A Graph is plain data. Values are referred to by index; a node lists the values it reads and
// writes. Forward, backward and optimizer nodes all live in one graph so the planner sees them
// together. The IR knows nothing of kernels (see ops.h).
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "graft/core.h"

namespace graft {

struct Attr {
  enum Kind { Int, Float, String, Ints, Floats, TensorV } kind = Int;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  Tensor t;
};

class Attrs {
 public:
  bool has(const std::string& k) const { return m_.count(k) != 0; }
  void set(const std::string& k, Attr a) { m_[k] = std::move(a); }
  void set_int(const std::string& k, int64_t v);
  void set_float(const std::string& k, double v);
  void set_ints(const std::string& k, std::vector<int64_t> v);
  void set_string(const std::string& k, std::string v);
  // Typed getters: a wrong attribute kind is an InvalidModel error naming `where`.
  int64_t get_int(const std::string& k, int64_t dflt, const std::string& where = "") const;
  double get_float(const std::string& k, double dflt, const std::string& where = "") const;
  std::string get_string(const std::string& k, const std::string& dflt,
                         const std::string& where = "") const;
  std::vector<int64_t> get_ints(const std::string& k, const std::vector<int64_t>& dflt,
                                const std::string& where = "") const;
  const Attr* find(const std::string& k) const;
  const std::map<std::string, Attr>& all() const { return m_; }

 private:
  std::map<std::string, Attr> m_;
};

enum class ValueKind : uint8_t {
  Intermediate,  // produced by a node
  Input,         // graph input, bound by the caller
  Param,         // float initializer: a parameter (trainable unless frozen)
  Constant,      // non-float initializer, Constant node output, or folded value
};

struct Value {
  std::string name;
  ValueKind kind = ValueKind::Intermediate;
  DType dtype = DType::F32;
  Shape shape;  // valid once `shape_known`
  bool shape_known = false;
  std::vector<std::string> dim_params;       // graph inputs: symbolic dim names ("" where fixed)
  Tensor data;                               // Param / Constant
  int producer = -1;                         // node index, -1 if none
  Category category = Category::Activation;  // what its buffer counts as when computed
  // Bytes of a tensor of this shape and dtype (the shape must be known).
  int64_t bytes() const { return numel(shape) * static_cast<int64_t>(dtype_size(dtype)); }
};

struct OpDef;  // ops.h: the op table

struct Node {
  std::string op;            // ONNX op type, or graft's own (e.g. "ReluGrad", "GradSink")
  std::string domain;        // "" for ONNX's default domain, "graft" for graft's own ops
  std::string name;          // unique within the graph (made up on import when missing)
  std::vector<int> inputs;   // -1 = optional input absent
  std::vector<int> outputs;  // -1 = optional output absent
  Attrs attrs;
  const OpDef* def = nullptr;  // the op, resolved once (ops: infer_node / infer_shapes)
  bool dead = false;           // folded away; infer_shapes removes such nodes (remove_dead_nodes)
  std::string label() const;   // "node 'name' (Op)" for messages
};

// Values and nodes live in deques: adding one never moves the others, so a reference taken before
// an add stays valid (gradient rules hold references while they emit nodes).
class Graph {
 public:
  std::deque<Value> values;
  std::deque<Node> nodes;
  std::vector<int> inputs;   // graph inputs (not initializers), in order
  std::vector<int> outputs;  // graph outputs, in order
  int64_t opset = 17;
  std::string name;

  int find(const std::string& value_name) const;   // -1 if absent
  int value(const std::string& value_name) const;  // throws InvalidArgument if absent
  // Adds a value; the name must be new (a suffix is added to make it unique if `uniquify`).
  int add_value(const std::string& name, ValueKind kind, bool uniquify = true);
  int add_node(Node n);  // sets producers of its outputs; returns node index
  // Consumers per value (node indices, in node order; a node appears once per input slot).
  std::vector<std::vector<int>> consumers() const;
  std::vector<int> params() const;  // values of kind Param, in order
  std::string unique_name(const std::string& base);

  // --- building graphs (import, autodiff, tests) ---
  // A graph input of a fixed shape.
  int add_input(const std::string& name, DType dt, const Shape& shape);
  // A constant (kind Constant) or a parameter (kind Param) holding `t`; dtype and shape are t's.
  int add_constant(const std::string& name, Tensor t, bool uniquify = true);
  int add_param(const std::string& name, Tensor t);
  // A node of `op` over `inputs` with `n_outputs` new intermediate values (named after the node);
  // returns their ids. Shapes are inferred by the ops layer (infer_node / infer_shapes).
  std::vector<int> add_op(const std::string& op, const std::vector<int>& inputs, Attrs attrs = {},
                          int n_outputs = 1, const std::string& domain = "",
                          const std::string& name = "");
  int add_op1(const std::string& op, const std::vector<int>& inputs, Attrs attrs = {},
              const std::string& domain = "", const std::string& name = "") {
    return add_op(op, inputs, std::move(attrs), 1, domain, name)[0];
  }
  // Drops nodes marked dead (folded) and renumbers producers.
  void remove_dead_nodes();

 private:
  std::string unique_node_name(const std::string& base);
  std::unordered_map<std::string, int> by_name_;
  std::unordered_set<std::string> node_names_;
  int counter_ = 0;
};

// ONNX TensorProto element types, the one mapping (import, Cast's `to`, graft's own ops):
// FLOAT 1, INT32 6, INT64 7, BOOL 9, DOUBLE 11.
int onnx_elem_type(DType t);
bool dtype_of_onnx_elem(int64_t code, DType& out);  // false: a type graft does not have

struct ImportOptions {
  // Maximum model file size accepted (guards against reading absurd files into memory).
  int64_t max_file_bytes = int64_t(8) << 30;
  Allocator* alloc = nullptr;  // where initializers live; nullptr = Allocator::global()
  // When set (graft inspect), an unsupported dtype of an initializer, graph input or Constant is
  // recorded here (one message each) and the value left without data, instead of stopping the
  // import at the first one, so a user sees the whole gap at once.
  std::vector<std::string>* unsupported = nullptr;
};

// Loads an ONNX model file. Errors: Io (unreadable), InvalidModel (corrupt or inconsistent),
// Unsupported (opset outside 13..17, unknown domain, unsupported dtype).
Graph load_onnx(const std::string& path, const ImportOptions& opt = {});
Graph load_onnx_bytes(const std::string& bytes, const std::string& model_dir = "",
                      const ImportOptions& opt = {});
// The parts of an ONNX file's graph that graft.GraftModule reads and edits before it builds a
// session from torch.onnx.export's file (python/graft/frontend.py): through graft's own protobuf
// classes, so the Python process never loads the onnx package.
struct OnnxValueInfo {
  std::string name;
  int elem_type = 0;          // TensorProto element type, 0 if not a tensor
  std::vector<int64_t> dims;  // 0 for a symbolic dimension
};
struct OnnxNodeInfo {
  std::string op_type, name;
  std::vector<std::string> inputs, outputs;
  std::vector<std::pair<std::string, int64_t>> ints;  // the node's integer attributes
};
struct OnnxGraphInfo {
  std::vector<OnnxValueInfo> inputs, outputs;
  std::vector<OnnxNodeInfo> nodes;
};
OnnxGraphInfo read_onnx_graph(const std::string& path);
// Adds integer attributes (node index, name, value) and graph outputs; rewrites the file.
void edit_onnx_graph(const std::string& path,
                     const std::vector<std::tuple<int64_t, std::string, int64_t>>& int_attrs,
                     const std::vector<OnnxValueInfo>& extra_outputs);

// A node by the names of the values it reads and writes: the ONNX importer's nodes and graft's
// PyTorch capture's (python/graft/_aten.py, built through the Python bindings, no file between).
// "" stands for an absent optional input or output; an empty name gets a made-up one.
struct NodeSpec {
  std::string op, domain, name;
  std::vector<std::string> inputs, outputs;
  Attrs attrs;
  bool complete = true;  // false: an attribute could not be read (ImportOptions::unsupported)
};
// Adds `nodes` to `g`, whose graph inputs, parameters and constants are already there, checked as
// an untrusted file is (src/ir/node_list.cpp): a value written twice, a read of a value nothing
// defines, a cycle or a domain other than ONNX's and graft's capture ops is an error naming the
// node. The nodes are re-sorted topologically, their order kept where it is valid; Constant nodes
// become constants. `unsupported`: as ImportOptions::unsupported.
void add_nodes(Graph& g, std::vector<NodeSpec> nodes, Allocator& alloc,
               std::vector<std::string>* unsupported = nullptr);
// Appends the named values to g.outputs (InvalidModel if one is not in the graph).
void set_outputs(Graph& g, const std::vector<std::string>& names);
// Unsupported unless opset (of ONNX's default domain) is one graft implements, 13 to 17.
void check_opset(int64_t opset);
// Runs f; with `unsupported` set, an Unsupported error it raises is recorded there and false
// returned instead of the error thrown (graft inspect lists every gap at once).
bool collect_unsupported(std::vector<std::string>* unsupported, const std::function<void()>& f);

// Parses a serialized onnx TensorProto (the backend tests' input_N.pb / output_N.pb).
Tensor load_tensor_pb(const std::string& path, std::string* name = nullptr);
void save_tensor_pb(const std::string& path, const Tensor& t, const std::string& name);

// graft's one topological sort (Kahn's algorithm): nodes 0..n-1 of a graph with edges i -> succ[i]
// (the nodes that read what i writes), each after every node with an edge to it; among the nodes
// ready at a time, the first by `before` goes next (default: the smallest index, so an order that
// is already topological is kept as it is). Nodes on a cycle are left out: the result is then
// shorter than n.
std::vector<int> topological_order(const std::vector<std::vector<int>>& succ,
                                   const std::function<bool(int, int)>& before = nullptr);

}  // namespace graft
