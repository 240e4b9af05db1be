// graft's compile step: a loaded graph -> a training step ready to run, done once.
//
//   shapes (infer + fold) -> training rewrites -> backward graph -> plan (under a budget: what to
//   recompute is chosen here) -> memory check
//
// Like llm.c's build-then-run split, nothing here runs a kernel on the model's data or touches a
// parameter's weights: the result is plain data (the backward graph and the plan) that a
// TrainSession runs step after step. The recompute policy (Note [Recompute under a budget],
// src/plan/recompute.cpp) and the memory reports of a plan live here too.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "graft/autodiff.h"
#include "graft/plan.h"

namespace graft {

struct CompileOptions {
  // Refuse a plan whose activation peak plus parameters plus one gradient set exceeds this
  // (bytes; 0 = no limit): OutOfMemory naming the biggest values alive at the peak.
  int64_t max_memory = 0;
  // Recompute under a budget: the plan's activation peak (Plan::planned_peak) must not exceed this
  // many bytes (0: no budget). Forward values are dropped from what backward keeps and recomputed
  // in backward, cheapest first; if even the most that can be dropped does not fit, an
  // InvalidArgument error states the smallest peak reachable.
  int64_t activation_budget = 0;
  // Recompute chains of pointwise ops in backward from the value they start at, instead of keeping
  // each intermediate, where that lowers the activation peak (Note [pointwise recompute],
  // src/plan/recompute.cpp).
  bool recompute_pointwise = true;
  // Keep float32 activations between convolutions in oneDNN's channel-blocked layout instead of
  // reordering them around every convolution (Note [channel-blocked values], src/plan/layout.cpp).
  bool blocked_layouts = true;
  // Store in bfloat16 the forward values the backward reads and only matrix products read (Note
  // [bf16 operands], src/plan/bf16_operands.cpp). Only in a bf16 session: TrainSession sets it
  // from RunOptions::bf16 (unless GRAFT_BF16_OPERANDS=0); its plans then run bf16 steps only.
  bool bf16_operands = false;
};

// One training step, compiled: the backward graph (its nodes appended to the graph) and the plan
// (which a TrainSession moves into its executor).
struct CompiledStep {
  BackwardGraph bg;
  Plan plan;
  // Per bg.params entry: in hold mode, the index in plan.keep of its held gradient; else -1.
  std::vector<int> grad_keep;
  // Per requested input gradient (AutodiffOptions::input_grads): its index in plan.keep, or -1.
  std::vector<int> input_grad_keep;
  int recomputed = 0;     // nodes the activation budget cloned into the backward
  int blocked = 0;        // values stored channel-blocked (Note [channel-blocked values])
  int bf16_operands = 0;  // values stored in bfloat16 (Note [bf16 operands])
};

// Compiles `g` in place (shapes bound from `input_shapes` for symbolic dims; constants folded into
// `ad.alloc`). Typed errors name the node, value or budget at fault.
CompiledStep compile_step(Graph& g, const AutodiffOptions& ad, const CompileOptions& co,
                          const std::map<std::string, Shape>& input_shapes = {});

// --- memory reports of a plan ----------------------------------------------------------------
// A buffer: its root value, the op and node that made it, its bytes.
struct SavedValue {
  std::string value, op, node;
  int64_t bytes = 0;
};
// What the forward leaves alive for the backward (the plan's first phase ends at barrier_step):
// every intermediate made by a forward node and read by a backward node, one entry per buffer
// (views and in-place results share their root's), biggest first.
std::vector<SavedValue> saved_for_backward(const Graph& g, const Plan& p);
// The buffers alive at plan step `step` (made at or before it, not yet freed), biggest first.
std::vector<SavedValue> live_at(const Graph& g, const Plan& p, int step);

// --- the recompute policy (src/plan/recompute.cpp) ---------------------------------------------
// Re-plans `plan` (made from `po`) so that its activation peak fits `budget`, recomputing in
// backward the cheapest kept forward buffers; rewrites g and (step mode) its update ordering.
// Sets *recomputed to the number of nodes cloned. InvalidArgument when no choice fits.
// Note [pointwise recompute]: every kept buffer recomputable through pointwise ops dropped at once,
// if that lowers the peak (else `plan` is returned as it was); *recomputed += the nodes cloned.
Plan plan_with_pointwise_recompute(Graph& g, const BackwardGraph& bg, Plan plan, PlanOptions& po,
                                   bool step_mode, int* recomputed);
Plan plan_under_budget(Graph& g, const BackwardGraph& bg, Plan plan, PlanOptions& po,
                       int64_t budget, bool step_mode, int* recomputed);

}  // namespace graft
