// graft executor: runs a Plan over concrete tensors, releasing every intermediate at its last use
// through the tracking allocator, and hands parameter gradients to sinks as they complete.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "graft/plan.h"

namespace graft {

struct RunOptions {
  bool profile = false;       // record per-op wall time
  bool check_finite = false;  // stop at the first op that writes NaN/Inf (names op and node)
  bool timeline = false;      // set the allocator's step per op (for memory timelines)
};

struct OpTime {
  int node;
  double seconds;
};

// Called for each graft.GradSink node with the gradient and whether the executor holds the only
// reference to its storage (then the sink may adopt the buffer instead of copying it).
using SinkFn = std::function<void(const Node& sink, Tensor grad, bool exclusive)>;

class Executor {
 public:
  Executor(const Graph& g, Plan plan, Allocator& alloc);
  const Plan& plan() const { return plan_; }
  // Binds a graph input or parameter (overrides a parameter's initializer data; zero-copy).
  void bind(int value, Tensor t);
  void bind(const std::string& name, Tensor t) { bind(g_.value(name), std::move(t)); }
  // Runs the plan. Returns the kept values (plan.keep order). Throws on a missing input.
  std::vector<Tensor> run(const RunOptions& opt = {}, const SinkFn& sink = nullptr);
  // The same in pieces, so a run can pause between forward and backward (plan.barrier_step)
  // with the saved values kept: begin(), run_to(step) as often as needed, finish().
  void begin(const RunOptions& opt = {}, const SinkFn& sink = nullptr);
  void run_to(int end_step);
  std::vector<Tensor> finish();
  // A value of the current run (an output computed so far), undefined if not computed or freed.
  const Tensor& current(int value) const { return vals_[value]; }
  int next_step() const { return next_; }
  // Sets a graph input during a run (e.g. output gradients that arrive after forward).
  void feed(int value, Tensor t);
  void abort();  // drops the run's values (after an error)
  const std::vector<OpTime>& op_times() const { return times_; }

 private:
  const Graph& g_;
  Plan plan_;
  Allocator& alloc_;
  std::map<int, Tensor> bound_;
  std::vector<OpTime> times_;
  std::vector<Tensor> vals_;
  RunOptions opt_;
  SinkFn sink_;
  int next_ = 0;
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
