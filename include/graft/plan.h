// graft planner: a pure function from a graph to an execution plan.
//
// The plan fixes the order of nodes, when each value is released (right after its last use), and
// which outputs reuse an input's buffer in place. It is plain data, printable, and checked by
// invariants (nothing freed twice, kept values never freed or overwritten, live buffers never
// overlap). See Note [Sink-first order] in plan.cpp.
#pragma once

#include <string>
#include <vector>

#include "graft/ir.h"

namespace graft {

struct BackwardGraph;  // graft/autodiff.h

struct PlanOptions {
  std::vector<int> keep;   // values that must survive the run (graph outputs, held gradients)
  bool inplace = true;     // allow in-place reuse where safe
  bool sink_first = true;  // run grad sinks (and what feeds only them) as early as possible
  // Nodes with index >= this run after every node below it (forward before backward, so a
  // run can stop between them). -1: no barrier.
  int phase_barrier = -1;
  // Values the caller reads when the first phase (forward) ends, e.g. graph outputs: they live
  // at least until then, and no longer than their last read (the caller keeps its own reference).
  std::vector<int> forward_outputs;
  // Nodes that run only when nothing else can (recomputations emitted into the backward: run
  // just before their first reader, not as early as their inputs allow).
  std::vector<int> late_nodes;
  // Also run late the backward nodes that read no gradient (only forward values and constants),
  // which are otherwise ready at the barrier and would hold their results from then on. Used with
  // recomputation, whose clones they often read; the default plans keep the emission order.
  bool late_gradient_free = false;
  // Values that are gradients though no backward node makes them: the loss's seed (a constant),
  // as the output gradients fed as graph inputs are. A node reading one reads a gradient.
  std::vector<int> gradient_seeds;
  // Graph inputs fed anew for every run whose handle the run drops after its last read (the
  // output gradients GraftModule hands over: the caller keeps no reference, so their memory goes
  // then, as in eager, not when the run ends). Never written in place (not graft's memory).
  std::vector<int> release_inputs;
};

struct PlanStep {
  int node = -1;
  std::vector<int> frees;  // values released after this step
  std::vector<int>
      buffer_frees;     // buffers (by root value) whose memory is returned after this step
  int inplace_in = -1;  // value whose buffer output 0 reuses (-1: none)
};

struct Plan {
  std::vector<PlanStep> steps;
  std::vector<int> keep;
  std::vector<int> use_count;  // per value: number of node input slots reading it
  std::vector<int> last_use;   // per value: step of last read (-1: never read)
  std::vector<int> buffer;     // per value: root value whose buffer it lives in (aliases, in place)
  int64_t planned_peak = 0;    // peak bytes of intermediates (excludes params, inputs, constants)
  int peak_step = -1;
  std::vector<int64_t> live_after;  // bytes of intermediates alive after each step
  int barrier_step = -1;            // first step of the second phase (steps.size() if none)

  std::string to_string(const Graph& g) const;
  int step_of(int node) const;  // -1 if the node is not in the plan
};

Plan make_plan(const Graph& g, const PlanOptions& opt);
// Note [channel-blocked values] (src/plan/layout.cpp): on a graph whose shapes are inferred,
// chooses the float32 activations stored channel-blocked ([N, C/16, spatial..., 16]) and marks
// the nodes that read the layout themselves (kBlockedAttr, ops.h). `external`: values the caller
// reads or binds (kept gradients, the loss), never blocked; graph inputs, outputs, parameters and
// constants never are either. enabled = false: every value plain (clears masks a previous run of
// the pass left). Returns the number of values blocked.
int choose_blocked_layouts(Graph& g, const std::vector<int>& external, bool enabled = true);
// Note [bf16 operands] (src/plan/bf16_operands.cpp): in a bf16 session, on an inferred training
// graph, stores in bfloat16 the forward values the backward reads and only matrix products read
// (RoundToBf16 nodes after their writers; their views become DType::BF16); renumbers nodes and
// bg's node indices. `external` as for choose_blocked_layouts. Returns the number of values.
int choose_bf16_operands(Graph& g, BackwardGraph& bg, const std::vector<int>& external,
                         bool enabled = true);
// Note [bf16 gradient operands] (same file): then rounds once each backward value that two or
// more matrix products read (RoundToBf16 after its writer; those products read the copy), where
// the copy fits under the peak of `before`, the plan of the graph as it is. Returns the number.
int choose_bf16_gradient_operands(Graph& g, BackwardGraph& bg, const std::vector<int>& external,
                                  const Plan& before);
// Checks the plan's invariants; throws Internal with the violation.
void check_plan(const Graph& g, const Plan& p);

}  // namespace graft
