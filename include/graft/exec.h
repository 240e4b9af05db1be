// graft executor: runs a Plan over concrete tensors, releasing every intermediate at its last use
// through the tracking allocator, and hands parameter gradients to sinks as they complete.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graft/plan.h"

namespace graft {

struct OpDef;

struct RunOptions {
  bool profile = false;       // record per-op wall time
  bool check_finite = false;  // stop at the first op that writes NaN/Inf (names op and node)
  bool timeline = false;      // set the allocator's step per op (for memory timelines)
  uint64_t seed = 0;          // the run's random stream (Dropout masks): a run is replayable
  // Mixed precision: float32 matrix products in bfloat16 on AMX with float32 accumulation and
  // results; everything else stays float32 (Note [bf16 GEMMs], graft/ops.h Bf16MatmulScope).
  bool bf16 = false;
  // Called after each plan step with (steps done, steps in the plan): a progress line
  // (Note [step progress], src/train/progress.cpp).
  std::function<void(int done, int total)> progress;
};

struct OpTime {
  int node;
  double seconds;
};

// Called for each gradient-sink node (OpDef::sink) with the node's index, the gradient, and whether
// the executor holds the only reference to its storage (then the sink may adopt the buffer).
using SinkFn = std::function<void(int sink_node, Tensor grad, bool exclusive)>;
// Where a gradient sink's gradient may be accumulated directly: the tensor (a parameter's .grad)
// the node feeding the sink adds its result into, or an undefined tensor for a fresh buffer. The
// sink then receives that same tensor (its storage is the .grad's).
using SinkTargetFn = std::function<Tensor(int sink_node)>;

// The state of one execution of a plan: the values it has computed and not yet released, and how
// far it got. Several runs of one Executor may be in flight at once, on several threads (each
// PyTorch forward keeps its own saved activations); running one never modifies the Executor.
class Run {
 public:
  // A value of this run (an output computed so far); undefined if not computed yet or released.
  const Tensor& value(int v) const { return vals_[v]; }
  int next_step() const { return next_; }
  bool active() const { return active_; }
  const std::vector<OpTime>& op_times() const { return times_; }
  const RunOptions& options() const { return opt_; }

 private:
  friend class Executor;
  std::vector<Tensor> vals_;
  std::vector<OpTime> times_;
  RunOptions opt_;
  SinkFn sink_;
  SinkTargetFn target_;
  int next_ = 0;
  bool active_ = false;
};

class Executor {
 public:
  Executor(const Graph& g, Plan plan, Allocator& alloc);
  const Plan& plan() const { return plan_; }
  const Graph& graph() const { return g_; }

  // Starts a run over `bindings` (graph inputs and parameters, by value id; constants come from the
  // graph). Checks each binding's dtype and shape against the plan. Nothing is computed yet.
  std::unique_ptr<Run> start(const std::vector<std::pair<int, Tensor>>& bindings,
                             const RunOptions& opt = {}, SinkFn sink = nullptr,
                             SinkTargetFn target = nullptr) const;
  // Runs steps [r.next_step(), end_step). On an error the run is aborted (its values released).
  void run_to(Run& r, int end_step) const;
  // Sets a graph input during a run (e.g. output gradients that arrive after forward).
  void feed(Run& r, int value, Tensor t) const;
  // Ends the run: returns the kept values (plan.keep order) and releases everything else.
  std::vector<Tensor> finish(Run& r) const;
  void abort(Run& r) const;  // drops the run's values

  // One complete run over values bound with bind() (inference, tests).
  void bind(int value, Tensor t);
  void bind(const std::string& name, Tensor t) { bind(g_.value(name), std::move(t)); }
  std::vector<Tensor> run(const RunOptions& opt = {}, const SinkFn& sink = nullptr);
  const std::vector<OpTime>& op_times() const { return last_times_; }  // of the last run()

 private:
  void check_binding(int v, const Tensor& t) const;
  const Graph& g_;
  Plan plan_;
  Allocator& alloc_;
  std::vector<const OpDef*> defs_;  // per node, resolved once
  // Per node: its prepared attributes (OpDef::prepare), parsed once when the executor is built.
  std::vector<std::shared_ptr<const void>> prepared_;
  // Per node: the sink its output 0 feeds when it may accumulate straight into that sink's
  // target (an accumulate_out op whose output 0 is read by that sink alone), else -1.
  std::vector<int> feeds_sink_;
  std::map<int, Tensor> bound_;
  std::vector<OpTime> last_times_;
};

// Scans a float tensor for NaN / Inf.
bool all_finite(const Tensor& t);

}  // namespace graft

namespace graft {

// One-call inference: binds input shapes, infers and folds, plans (keeping the graph outputs),
// runs. The graph is modified (shapes bound, constants folded). Inputs are matched by name.
std::vector<Tensor> run_inference(Graph& g, const std::map<std::string, Tensor>& inputs,
                                  Allocator& alloc, const RunOptions& opt = {},
                                  std::vector<OpTime>* times = nullptr);

}  // namespace graft
