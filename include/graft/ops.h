// graft op table: one OpDef per op holds its schema, shape function, CPU kernel and gradient rule.
//
// Ops are grouped by family in src/ops/*.cpp (listed with the register_* functions at the end);
// each family file lists its OpDefs in one table, so an op's schema, kernel and gradient rule sit
// side by side. Gradient rules emit ordinary graph nodes through GradBuilder (implemented by the
// autodiff driver), so the planner sees every saved tensor. Shared gradient work (summing
// contributions, un-broadcasting, skipping unneeded gradients) lives once, in the driver.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graft/core.h"
#include "graft/ir.h"
#include "graft/parallel.h"  // the thread pool: parallel_ranges, set_num_threads, ...

namespace graft {

// --- axes ---------------------------------------------------------------------------------------
// ONNX counts a negative axis from the end: axis a of a rank-r tensor, -r <= a < r, is dim
// a < 0 ? a + r : a. The one place that normalizes an axis (shape functions, kernels, gradient
// rules): an axis outside [-r, r) is an InvalidModel error naming node `n`, "<label>: <what> <a> is
// out of range for rank <r>".
int normalize_axis(int64_t axis, int rank, const Node& n, const char* what = "axis");

// --- shape inference ----------------------------------------------------------------------------
class InferCtx {
 public:
  InferCtx(Graph& g, int node) : g_(g), node_(node) {}
  const Node& node() const { return g_.nodes[node_]; }
  int n_in() const { return static_cast<int>(node().inputs.size()); }
  int n_out() const { return static_cast<int>(node().outputs.size()); }
  bool has_in(int i) const { return i < n_in() && node().inputs[i] >= 0; }
  bool has_out(int i) const { return i < n_out() && node().outputs[i] >= 0; }
  const Value& in(int i) const;
  const Shape& shape(int i) const { return in(i).shape; }
  DType dtype(int i) const { return in(i).dtype; }
  // The input's data if it is a constant (initializer, Constant, folded), else nullptr.
  const Tensor* const_in(int i) const;
  // Reads a constant int64 input (e.g. Reshape's shape); Unsupported if it is not constant.
  std::vector<int64_t> ints_in(int i) const;
  void set_out(int i, DType dt, const Shape& s);
  [[noreturn]] void error(ErrorKind k, const std::string& msg) const;
  void check(bool cond, const std::string& msg) const {
    if (!cond) error(ErrorKind::ShapeMismatch, msg);
  }
  const Attrs& attrs() const { return node().attrs; }
  int64_t attr_int(const std::string& k, int64_t d) const {
    return attrs().get_int(k, d, node().label());
  }

 private:
  Graph& g_;
  int node_;
};
using InferFn = void (*)(InferCtx&);

// --- prepared attributes ------------------------------------------------------------------------
// Note [prepared attributes]
// A node's attributes are a string-keyed map. An op whose kernel reads attributes has a prepare
// function (OpDef::prepare) that parses them once per node into a plain struct of its own (e.g.
// ConvAttrs: group, strides, pads, auto_pad as an enum); the kernel reads that struct with
// KernelCtx::attrs<ConvAttrs>() instead of looking keys up on every call. The executor prepares
// every node of its plan when it is built (before any kernel runs), run_node just before the
// kernel. A bad attribute is the same typed error, naming the node, as when kernels parsed it.
using PrepareFn = std::shared_ptr<const void> (*)(const Node&);
// A prepare function's result: the parsed struct, shared by every run of the node.
template <class A>
std::shared_ptr<const void> prepared(A attrs) {
  return std::make_shared<const A>(std::move(attrs));
}

// --- kernels ------------------------------------------------------------------------------------
// Outputs are allocated by the executor from the statically inferred shapes before the kernel
// runs (or alias an input when the planner chose in-place), so kernels only compute.
struct KernelCtx {
  const Node& node;
  std::vector<const Tensor*> ins;  // nullptr = absent optional input
  std::vector<Tensor*> outs;       // nullptr = absent optional output
  Allocator& alloc;                // for workspace only
  uint64_t seed = 0;               // the run's random stream (RunOptions::seed)
  // Output 0 already holds values to add to (a parameter's .grad): the kernel adds its result
  // into it instead of overwriting (only for ops with OpDef::accumulate_out).
  bool accumulate = false;
  const void* prepared = nullptr;  // what OpDef::prepare made of the node (nullptr: no prepare)
  const Tensor& in(int i) const { return *ins[i]; }
  bool has_in(int i) const { return i < static_cast<int>(ins.size()) && ins[i]; }
  Tensor& out(int i) const { return *outs[i]; }
  bool has_out(int i) const { return i < static_cast<int>(outs.size()) && outs[i]; }
  // The node's attributes as its OpDef::prepare parsed them: c.attrs<ConvAttrs>().
  template <class A>
  const A& attrs() const {
    if (!prepared) not_prepared();
    return *static_cast<const A*>(prepared);
  }
  // The raw attribute map (kernels read attrs<T>(); this is for ops folded at plan time).
  const Attrs& attrs() const { return node.attrs; }
  [[noreturn]] void error(ErrorKind k, const std::string& msg) const;
  [[noreturn]] void not_prepared() const;  // an Internal error: attrs<T>() without a prepare
};
using KernelFn = void (*)(KernelCtx&);

// --- gradient rules -----------------------------------------------------------------------------
class GradBuilder {
 public:
  virtual ~GradBuilder() = default;
  virtual const Node& node() const = 0;
  virtual const Value& val(int v) const = 0;
  int x(int i) const { return node().inputs[i]; }
  const Shape& shape(int v) const { return val(v).shape; }
  // Forward output i; an optional output the node did not produce (e.g. LayerNormalization's
  // Mean) is added to the forward node so the backward can read it.
  virtual int y(int i) = 0;
  virtual int dy(int i) const = 0;      // gradient of output i, -1 if none flows
  virtual bool needs(int i) const = 0;  // does input i need a gradient?
  // Gives input i's gradient; it may have a broadcast shape, which the driver reduces.
  virtual void set_dx(int i, int v) = 0;
  virtual std::vector<int> emit(const std::string& op, const std::vector<int>& inputs, Attrs attrs,
                                int n_out, const std::string& domain = "") = 0;
  // Output `v` of the node emitted last will not be read: the node does not produce it (its
  // kernel sees has_out() false and skips that work, e.g. ConvGrad's dX of an image).
  virtual void drop_output(int v) = 0;
  int emit1(const std::string& op, const std::vector<int>& inputs, Attrs attrs = {},
            const std::string& domain = "") {
    return emit(op, inputs, std::move(attrs), 1, domain)[0];
  }
  virtual int scalar(double v, DType dt) = 0;           // a constant scalar
  virtual int ints(const std::vector<int64_t>& v) = 0;  // a constant int64 vector
};
using GradFn = void (*)(GradBuilder&);

// --- cost ---------------------------------------------------------------------------------------
// The arithmetic FLOPs of one node, from its inputs' and outputs' (inferred) shapes: 2*M*N*K for a
// matrix product, 2*out*kernel for a convolution. Ops without one are elementwise: what they cost
// is the bytes they move, which the caller counts (node_flops is 0 for them).
using FlopsFn = double (*)(const Graph&, const Node&);

// --- layouts ------------------------------------------------------------------------------------
// Note [channel-blocked values] (src/plan/layout.cpp): a float32 activation [N, C, spatial...]
// with C % 16 == 0 may be stored channel-blocked, as [N, C/16, spatial..., 16] (oneDNN's
// nChw16c), so that consecutive convolutions never reorder it. What a node can take so:
struct BlockedUse {
  uint32_t in = 0, out = 0;  // bit i: input / output i may be channel-blocked
  // true: an elementwise node whose masked operands all have one shape; they must share one layout
  // and the kernel never learns which. false: the kernel reads each operand's layout from the
  // node's int attribute kBlockedAttr (bit i: input i, bit 16 + j: output j).
  bool tied = false;
};
using BlockedFn = BlockedUse (*)(const Graph&, const Node&);
inline constexpr const char* kBlockedAttr = "graft_blocked";
// Note [bf16 writers]: set (1) on a node whose op has OpDef::bf16_out, its output 0 is bfloat16.
inline constexpr const char* kBf16OutAttr = "graft_bf16_out";
// The elementwise rule: every input and output when they all have one shape, else none.
BlockedUse blocked_elementwise(const Graph& g, const Node& n);
// Whether this machine's convolutions take channel-blocked operands at all (oneDNN with 16-channel
// blocks: AVX-512 and up, and not GRAFT_CONV=im2col).
bool convolutions_take_blocked_layouts();

// --- the table ----------------------------------------------------------------------------------
// Rows are written with designated initializers; only what differs from these defaults is named:
//   {.name = "Relu", .min_in = 1, .max_in = 1, .infer = infer_unary_float, .kernel = relu_kernel,
//    .grad = grad_relu, .inplace_input = 0},
struct OpDef {
  const char* name;
  const char* domain = "";  // "" ONNX default, "graft" for graft's own
  int min_in = 1, max_in = 1;
  int min_out = 1, max_out = 1;
  InferFn infer = nullptr;
  PrepareFn prepare = nullptr;  // parses the attributes its kernel reads (Note [prepared ...])
  KernelFn kernel = nullptr;    // nullptr for alias ops and sinks
  GradFn grad = nullptr;        // nullptr: not differentiable (an error if a gradient must pass)
  int inplace_input = -1;       // output 0 may overwrite this input's buffer (-1: never)
  bool alias = false;           // output 0 is input 0's storage reshaped; no kernel runs
  bool foldable = true;         // may be evaluated at plan time when all inputs are constant
  std::vector<int> nondiff_inputs = {};  // inputs that never get a gradient (indices, shapes)
  bool sink = false;  // a gradient sink: no kernel; the executor hands input 0 to the run's SinkFn
  bool shape_only = false;  // reads only its input's shape (Shape): folded once shapes are known
  // The kernel can add into output 0 (KernelCtx::accumulate): a weight-gradient GEMM then writes
  // straight into an existing .grad (beta = 1) instead of into a temporary that is added after.
  bool accumulate_out = false;
  // Properties the graph passes read (autodiff's rewrites, recomputation under a memory budget),
  // so that no pass keeps a list of op names:
  // Draws random numbers: running the node again would not give the same result (Dropout's mask).
  // PythonOp and PythonOpGrad count as random: a custom autograd.Function may draw random numbers
  // or keep state between calls, which graft cannot see.
  bool random = false;
  // Only moves or copies data (Transpose, Reshape, Concat, Slice, Cast, Expand, ...): running it
  // again costs a copy, never arithmetic (rewrite.cpp recomputes such copies of parameters in
  // backward instead of keeping them).
  bool copy_like = false;
  // May be run again in backward to recompute a value dropped under an activation budget. False
  // for random ops (the replay would draw anew), PythonOp (state) and LSTM / GRU (deterministic,
  // but a whole recurrence is not worth re-running).
  bool recompute = true;
  // Arithmetic FLOPs of a node (see FlopsFn); nullptr: elementwise (node_flops gives 0).
  FlopsFn flops = nullptr;
  // Each output element depends on the inputs' elements at the same place only (after
  // broadcasting), at a few operations per element: Add, Mul, Tanh, Gelu, Cast, ... The planner
  // recomputes chains of such ops in backward instead of keeping their results (Note [pointwise
  // recompute], src/plan/recompute.cpp).
  bool pointwise = false;
  // Which operands may be channel-blocked (Note [channel-blocked values]); nullptr: none.
  BlockedFn blocked = nullptr;
  // Output 0 may be written in bfloat16, rounded as RoundToBf16 rounds, when the node's int
  // attribute kBf16OutAttr is set (Note [bf16 writers], src/plan/bf16_operands.cpp).
  bool bf16_out = false;
};

const OpDef* find_op(const std::string& name, const std::string& domain = "");
const std::vector<const OpDef*>& all_ops();
// Looks up the node's op and checks its arity; Unsupported / InvalidModel naming the node.
const OpDef& op_for(const Node& n);
// The node's op (Node::def once resolved), or nullptr when graft has no such op; no arity check.
const OpDef* op_def(const Node& n);
// The node's arithmetic FLOPs (OpDef::flops; 0 for elementwise and unknown ops). A cost model adds
// the bytes the node reads and writes.
double node_flops(const Graph& g, const Node& n);

// Binds graph-input shapes, runs static shape inference over every node, and folds constant
// subgraphs (Shape -> Gather -> Concat -> Reshape ...). `shapes` gives concrete shapes for inputs
// with symbolic dims; missing ones are an InvalidArgument error naming the input and its dims.
// Folded constants are allocated from `alloc` (nullptr: Allocator::global()).
void infer_shapes(Graph& g, const std::map<std::string, Shape>& shapes = {},
                  Allocator* alloc = nullptr);
// Infers one node (used by the autodiff driver for nodes it emits).
void infer_node(Graph& g, int node);
// The node's prepared attributes (OpDef::prepare; nullptr for an op without one). Errors name
// the node.
std::shared_ptr<const void> prepare_node(const Node& n);
// Runs one node's kernel on concrete tensors (tests, folding); prepares the node first.
void run_node(const Node& n, const std::vector<const Tensor*>& ins, std::vector<Tensor*>& outs,
              Allocator& alloc);

// dst[i] += src[i] over two float32 or float64 tensors of one dtype and element count (the
// accumulation into .grad), on the op families' threads.
void add_elements(Tensor& dst, const Tensor& src);

// Mixed precision for matrix products (Note [bf16 GEMMs], src/ops/linalg.cpp): while a scope with
// bf16 = true is alive on a thread, the float32 GEMMs that thread runs (MatMul, Gemm, FusedMatMul,
// Einsum, the convolutions' im2col products, and all their gradients) round both operands to
// bfloat16 and run on the CPU's AMX / AVX512-BF16 units through oneDNN, accumulating and writing
// in float32. Values, weights, gradients and everything else stay float32.
class Bf16MatmulScope {
 public:
  explicit Bf16MatmulScope(bool bf16);
  ~Bf16MatmulScope();
  Bf16MatmulScope(const Bf16MatmulScope&) = delete;
  Bf16MatmulScope& operator=(const Bf16MatmulScope&) = delete;

 private:
  bool prev_;
};
// Whether this machine runs bf16 GEMMs natively (AMX or AVX512-BF16, as oneDNN reports).
bool bf16_matmul_native();

// Dropout's random stream: each run gets a seed (RunOptions::seed) and every active Dropout kernel
// draws its mask from a counter-based stream keyed by it, the node's seed attribute and the
// node's name (element i a function of i alone: drawn in parallel), so a run replays exactly. A
// TrainSession takes each step's seed from its own counter (TrainSession::rng_state, checkpointed),
// so a resumed run draws the same masks as an uninterrupted one.

// graft.PythonOp (src/ops/python_op.cpp): what runs a PythonOp node (backward = false: c.ins are
// its inputs, c.outs its outputs) or its PythonOpGrad (true: c.ins the output gradients, absent
// where none flows; c.outs the input gradients, absent where none is needed) outside graft. The
// PyTorch front end installs one that runs a custom torch.autograd.Function; without one, such a
// node is an Unsupported error.
using PythonOpRunner = std::function<void(KernelCtx& c, int64_t fn, bool backward)>;
void set_python_op_runner(PythonOpRunner r);

// Family registration: each op file src/ops/<family>.cpp adds its table's rows.
void register_unary_ops(std::vector<const OpDef*>& t);           // unary.cpp
void register_binary_ops(std::vector<const OpDef*>& t);          // binary.cpp
void register_math_ops(std::vector<const OpDef*>& t);            // math.cpp
void register_linalg_ops(std::vector<const OpDef*>& t);          // linalg.cpp
void register_einsum_ops(std::vector<const OpDef*>& t);          // einsum.cpp
void register_reduce_ops(std::vector<const OpDef*>& t);          // reduce.cpp
void register_shape_ops(std::vector<const OpDef*>& t);           // shape_ops.cpp
void register_index_ops(std::vector<const OpDef*>& t);           // index_ops.cpp
void register_softmax_ops(std::vector<const OpDef*>& t);         // softmax.cpp
void register_norm_ops(std::vector<const OpDef*>& t);            // norm.cpp
void register_dropout_ops(std::vector<const OpDef*>& t);         // dropout.cpp
void register_conv_ops(std::vector<const OpDef*>& t);            // conv.cpp
void register_conv_transpose_ops(std::vector<const OpDef*>& t);  // conv_transpose.cpp
void register_pool_ops(std::vector<const OpDef*>& t);            // pool.cpp
void register_resize_ops(std::vector<const OpDef*>& t);          // resize.cpp
void register_grid_sample_ops(std::vector<const OpDef*>& t);     // grid_sample.cpp
void register_rnn_ops(std::vector<const OpDef*>& t);             // rnn.cpp
void register_ctc_ops(std::vector<const OpDef*>& t);             // ctc.cpp
void register_python_ops(std::vector<const OpDef*>& t);          // python_op.cpp
void register_attention_ops(std::vector<const OpDef*>& t);       // attention.cpp

}  // namespace graft
