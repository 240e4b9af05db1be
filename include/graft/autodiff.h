// graft autodiff: builds the backward graph, as ordinary nodes, into the same Graph.
//
// Walks back from a scalar loss (or from given output gradients), asks each op's gradient rule
// (ops.h) for its input gradients, sums several contributions to one value, reduces broadcast
// gradients to the input's shape, and skips whatever no trainable parameter or requested input
// needs. Every trainable parameter's summed gradient ends in a graft.GradSink node (accumulate /
// hook delivery) or is kept as a run output (hold delivery).
#pragma once

#include <string>
#include <vector>

#include "graft/ir.h"

namespace graft {

// Step: the optimizer's update is applied to each parameter the moment its gradient is complete,
// inside backward (TrainSession::set_step_optimizer), and the gradient is freed: no .grad set is
// ever held. The graph is the same as accumulate's (each gradient ends in a sink).
enum class GradMode { Hold, Accumulate, Hook, Step };
const char* grad_mode_name(GradMode m);
GradMode parse_grad_mode(const std::string& s);  // InvalidArgument on an unknown name

struct AutodiffOptions {
  std::string loss;  // scalar output to differentiate (if no output_grads)
  // The loss's gradient seed (d loss / d loss): 1, or 1/k when the gradients of k micro-batches
  // are summed into one step so that they average (graft train --micro-batches).
  double loss_scale = 1;
  // Differentiate these outputs instead, with their gradients bound as new graph inputs named
  // "<output>__grad" (the PyTorch front end feeds autograd's grad_outputs through them).
  std::vector<std::string> output_grads;
  std::vector<std::string> freeze;       // parameters not trained
  std::vector<std::string> input_grads;  // graph inputs whose gradients are wanted
  GradMode mode = GradMode::Accumulate;
  Allocator* alloc = nullptr;  // for constants it creates (nullptr: global)
};

struct BackwardGraph {
  int loss = -1;
  int n_forward_nodes = 0;       // nodes [0, n) are forward; the rest backward
  std::vector<int> params;       // trainable parameters (value ids), in graph order
  std::vector<int> param_grads;  // per trainable parameter: its summed gradient, -1 if unused
  std::vector<int> sinks;        // per trainable parameter: its GradSink node, -1 if none
  std::vector<int> input_grads;  // per requested input: its gradient value, -1 if none flows
  std::vector<int> output_grad_inputs;  // per output_grads entry: the graph input carrying it
  int loss_seed = -1;  // with a loss: the constant d loss / d loss the backward starts from
};

// The graph must have its shapes inferred (infer_shapes). Errors (typed, nothing modified on
// failure of validation): unknown / non-scalar loss, unknown freeze name, an op without a
// gradient rule on the path to a trainable parameter (names op, node and parameter).
BackwardGraph build_backward(Graph& g, const AutodiffOptions& opt);

// Attention written out as ops (MatMul, scale, masks, Softmax, Dropout, MatMul: torch 1.13's
// models, ONNX files) becomes graft.Attention where it is the same function (Note [attention
// written out], fuse_attention.cpp), so no T x T probabilities are kept. On an inferred graph,
// before rewrite_for_training. Returns the number of attentions fused.
int fuse_attention(Graph& g);
// graft.Attention reads its operands and writes its output in the layouts the projections around
// it use, so the reshapes, transposes and splits between them (and their gradients) never run
// (Note [attention reads its heads in place], fuse_attention.cpp). On an inferred graph, after
// rewrite_for_training. Returns the number of attentions rewritten.
int attention_views(Graph& g);
// Rewrites that make the backward keep what PyTorch's autograd keeps and no more (rewrite.cpp).
// Before build_backward, on an inferred graph: MatMul(A, Transpose(W)) with W 2-D becomes graft's
// FusedMatMul(A, W, transB = 1), so the backward keeps W instead of a transposed copy; a Dropout
// that drops nothing (ratio 0, or not training) becomes an Identity view. Returns nodes changed.
int rewrite_for_training(Graph& g);
// After build_backward: a backward node that reads a forward value made from parameters and
// constants alone by copy-like ops (Transpose, Concat, Slice, Unsqueeze, ...: the reordered
// weights of an exported LSTM) reads a recomputation emitted in the backward instead, so the
// forward's copy is freed at its last forward use. Returns the number of reads redirected.
int rematerialize_param_copies(Graph& g, const BackwardGraph& bg);
// Step mode: each parameter's sink (where its update is applied) gets, as extra ordering inputs,
// an output of every backward node that reads the parameter, so the update never runs before a
// backward read of the old value (the input-gradient GEMM dX = dY W of the same layer).
void order_updates_after_reads(Graph& g, const BackwardGraph& bg);
// Recompute in backward: every backward read of a forward value in `values` reads a recomputation
// instead, so the forward's copy is freed at its last forward use. `available[v]`: forward value v
// can be read by the backward as it is (the forward keeps it and it is not in `values`); any other
// forward value a recomputation needs is recomputed too, from what is available, parameters,
// inputs and constants (one clone per forward node, shared). Returns the clones' node indices (plan
// them late: PlanOptions::late_nodes). Every node cloned must be deterministic.
std::vector<int> recompute_in_backward(Graph& g, const BackwardGraph& bg,
                                       const std::vector<int>& values,
                                       const std::vector<bool>& available);

}  // namespace graft
