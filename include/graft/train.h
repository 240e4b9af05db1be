// graft training: a session (model + backward graph + plan + gradient delivery), parameters with
// persistent .grad buffers, and optimizers.
//
//   graft::SessionOptions o;  o.loss = "loss";  o.mode = graft::GradMode::Accumulate;
//   auto s = graft::TrainSession::open("model.onnx", o, {{"x", {32, 784}}});
//   graft::AdamW opt(s->trainable(), {.lr = 1e-3});
//   for (...) { s->set_input("x", x); s->set_input("y", y); double loss = s->step(); opt.step();
//   s->zero_grad(); }
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "graft/autodiff.h"
#include "graft/compile.h"
#include "graft/exec.h"

namespace graft {

struct Parameter {
  std::string name;
  int value = -1;  // graph value id
  Tensor data;     // the weights (read in place by every run)
  Tensor grad;     // persistent gradient buffer; undefined = None (PyTorch's set_to_none)
  bool trainable = true;
};

// Receives a parameter's complete gradient during backward (hook mode). To keep it, keep the
// Tensor handle (it shares the block: no bytes are copied); graft drops its own reference when
// the callback returns, so a kept gradient is then the callee's alone, like PyTorch's
// AccumulateGrad stealing a fresh gradient for an empty .grad.
using GradHook = std::function<void(Parameter& p, const Tensor& grad)>;

// What PyTorch's AccumulateGrad does: an empty .grad adopts `grad` (no copy: it shares the
// block), an existing one gets it added in place. A ready hook: s.set_hook(accumulate_grad).
void accumulate_grad(Parameter& p, const Tensor& grad);

// What to differentiate and how gradients leave (AutodiffOptions: loss, output_grads, freeze,
// input_grads, mode, alloc) and how steps run (RunOptions: check_finite, profile, timeline), plus:
struct SessionOptions : AutodiffOptions, RunOptions, CompileOptions {
  // Graph inputs that are really parameters (a model exported without its weights, e.g.
  // torch.onnx.export(export_params=False)): they become parameters with no data until
  // bind_parameter() shares memory for them. Trainable unless also listed in `freeze`.
  std::vector<std::string> param_inputs;
  // and CompileOptions: max_memory (refuse a plan that does not fit), activation_budget
  // (recompute under a budget, Note [Recompute under a budget] in src/plan/recompute.cpp).
};

// One training step in flight: a forward, and then its backward. Several may be in flight at once
// (each keeps what its own backward needs, like PyTorch's autograd graphs); destroying one releases
// what it holds. Create with TrainSession::begin().
class Optimizer;
class Delivery;
class StepDelivery;
class StepProgress;

struct StepState {
  std::unique_ptr<Run> run;
  std::vector<Tensor> inputs;   // bound for this step only (kept alive until it ends)
  std::vector<Tensor> outputs;  // graph outputs of the forward (owned by the caller too)
  Tensor loss;
  std::vector<Tensor> input_grads;  // after backward: per requested input (SessionOptions order)
  uint64_t seed = 0;                // the random stream it used (replayable)
  bool forward_done = false, backward_done = false;
  bool defer_step = false;  // step mode: this step's backward accumulates (set_defer_step)
};

// What a training step needs, by kind, in bytes (TrainSession::planned_memory).
struct PlannedMemory {
  int64_t parameters = 0, gradients = 0, optimizer_state = 0, inputs = 0, constants = 0,
          activations = 0;
  int64_t total() const {
    return parameters + gradients + optimizer_state + inputs + constants + activations;
  }
  std::string describe() const;  // "parameters 1.2 MiB, gradients ..., biggest first"
};

class TrainSession {
 public:
  // Takes a loaded graph (parameters live in opt.alloc) and input shapes for symbolic dims.
  // Compiles it (graft/compile.h: shapes, autodiff, plan), then takes the parameters out of the
  // graph and builds the executor.
  TrainSession(Graph g, const SessionOptions& opt,
               const std::map<std::string, Shape>& input_shapes = {});
  // Not movable: the executor refers to the graph. Hold sessions by unique_ptr.
  TrainSession(TrainSession&&) = delete;
  ~TrainSession();
  static std::unique_ptr<TrainSession> open(const std::string& path, const SessionOptions& opt,
                                            const std::map<std::string, Shape>& input_shapes = {});

  // --- steps with explicit state (several may be in flight; forward may run on any thread) ---
  // Runs the forward of a new step over `inputs` (by name; every graph input not given falls back
  // to set_input's). `seed`: the random stream (Dropout); default: the session's counter.
  // `bf16`: this step's matrix products in bfloat16 (RunOptions::bf16; default: the session's).
  std::shared_ptr<StepState> forward(const std::map<std::string, Tensor>& inputs,
                                     std::optional<uint64_t> seed = std::nullopt,
                                     bool keep_for_backward = true,
                                     std::optional<bool> bf16 = std::nullopt);
  // Runs that step's backward: gradients are delivered per mode; requested input gradients land in
  // step.input_grads. A step runs backward once. The output gradients are taken by value: passed
  // with std::move, the run holds their only handles and drops each after its last read.
  void backward(StepState& step, std::map<std::string, Tensor> output_grads = {});

  // --- the simple loop (one step at a time) ---
  void set_input(const std::string& name, Tensor t);
  // Forward + backward; gradients are delivered per mode. Returns the loss (NaN without a loss).
  double step();
  // The same in two halves: forward keeps what backward needs.
  void forward();
  void backward(std::map<std::string, Tensor> output_grads = {});
  // Drops an in-flight step (forward without backward), releasing what it saved.
  void cancel();
  // Drops the session's references to the last forward's outputs and loss.
  void release_outputs();
  bool in_run() const { return cur_ && cur_->forward_done && !cur_->backward_done; }
  // Graph outputs of the last forward (tensors the caller owns: backward never writes into them).
  std::vector<Tensor> outputs() const;
  Tensor output(const std::string& name) const;
  // Gradients of requested inputs from the last backward.
  Tensor input_grad(const std::string& name) const;

  void zero_grad(bool set_to_none = true);
  void set_hook(GradHook h) { hook_ = std::move(h); }
  const GradHook& hook() const { return hook_; }
  // Called after each parameter's gradient is delivered (every mode; in accumulate mode .grad then
  // holds it), in delivery order: what graft::DataParallel starts its all-reduces from.
  void set_grad_ready(std::function<void(Parameter&)> f) { ready_ = std::move(f); }
  const std::function<void(Parameter&)>& grad_ready() const { return ready_; }
  // Indices into parameters() of the parameters that receive a gradient, in the order backward
  // delivers them (the plan's order of their gradient sinks; hold mode: parameter order).
  std::vector<int> delivery_order() const;
  // Step mode (SessionOptions::mode = Step): the optimizer whose update is applied to each
  // parameter inside backward, the moment its gradient is complete; the gradient is then freed.
  // Each backward counts one optimizer step. Required before the first step in that mode (or a
  // hook, set_hook, which then receives each complete gradient to apply its own update, as
  // GraftModule does with a torch.optim optimizer); its parameters must be this session's.
  void set_step_optimizer(Optimizer* opt);
  // Step mode with micro-batches: while deferred, backward accumulates into .grad as accumulate
  // mode does; the first backward that is not deferred adds its gradient to the accumulated .grad,
  // applies the update and frees .grad (the unfused loop: k backward()s, one optimizer.step()).
  void set_defer_step(bool defer) { defer_step_ = defer; }
  // The session's random counter: each step that is not given a seed takes the next value as its
  // stream (Dropout's masks). Checkpoints save and restore it, so a resumed run draws the masks an
  // uninterrupted one would.
  uint64_t rng_state() const { return rng_; }
  void set_rng_state(uint64_t state) { rng_ = state; }
  // Step mode with global-norm gradient clipping (PyTorch's clip_grad_norm_: every gradient scaled
  // by min(1, max_norm / (norm + 1e-6)), the norm over all gradients before any update): step()
  // then runs two passes over the batch, the first computing only the norm (each gradient is
  // reduced to its sum of squares and freed), the second replaying the same forward (same random
  // stream) and updating with the scaled gradients. Memory stays step mode's; time is about twice.
  // 0: no clipping.
  void set_clip_norm(double max_norm);
  double last_grad_norm() const { return last_norm_; }  // the norm the last clipped step used
  double clip_norm() const { return clip_norm_; }
  Optimizer* step_optimizer() const;

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  std::vector<Parameter*> trainable();
  Parameter& parameter(const std::string& name);
  // Shares external memory as a parameter's weights (zero-copy); shape and dtype must match.
  void bind_parameter(const std::string& name, Tensor data);

  const Graph& graph() const { return g_; }
  const Plan& plan() const { return exec_->plan(); }
  const BackwardGraph& backward_graph() const { return bg_; }
  Allocator& allocator() { return *alloc_; }
  GradMode mode() const { return opt_.mode; }
  const SessionOptions& options() const { return opt_; }
  // Per-op times of the last step (SessionOptions::profile).
  const std::vector<OpTime>& op_times() const { return last_times_; }
  // Bytes of all trainable gradients (one full set), for memory reports.
  int64_t gradient_bytes() const;
  // The step's planned memory: parameters, one gradient set, the given optimizer state, the graph
  // inputs and the planned activation peak.
  PlannedMemory planned_memory(int64_t optimizer_state_bytes = 0) const;
  // What the forward leaves alive for the backward, one entry per buffer, biggest first
  // (graft::saved_for_backward). Parameters and graph inputs are not counted (the caller holds
  // those anyway).
  using SavedValue = graft::SavedValue;
  std::vector<SavedValue> saved_for_backward() const;
  // The buffers alive at the plan's activation peak (Plan::peak_step), biggest first: what a
  // budget has to remove (value, the op and node that made it, bytes).
  std::vector<SavedValue> live_at_peak() const;
  // Nodes the activation budget cloned into the backward (0 without a budget, or when it fit).
  int recomputed_nodes() const { return c_.recomputed; }
  // Values the plan stores in bfloat16 (Note [bf16 operands]; 0 outside bf16 sessions).
  int bf16_operands() const { return c_.bf16_operands; }

 private:
  std::unique_ptr<Graph> gp_;  // the graph lives at a fixed address (the executor refers to it)
  Graph& g_;
  SessionOptions opt_;
  Allocator* alloc_;
  CompiledStep c_;  // compiled once; its plan moved into exec_ (exec_->plan())
  const BackwardGraph& bg_ = c_.bg;
  std::unique_ptr<Executor> exec_;
  std::vector<Parameter> params_;  // the one home of parameter memory and .grad
  // Guards params_[i].data between bind_parameter and forward's reading of the bindings: the
  // front end rebinds before every call while other threads' forwards run (a Tensor is a
  // shared_ptr; copying one while it is reassigned can read a freed storage).
  mutable std::mutex bind_mu_;
  std::vector<int> param_of_value_;  // value id -> index in params_, -1
  std::vector<int> param_of_sink_;   // node id -> index in params_ (gradient sinks), -1
  std::map<std::string, Tensor> default_inputs_;  // set_input
  std::shared_ptr<StepState> cur_;                // the simple loop's step
  std::vector<OpTime> last_times_;
  GradHook hook_;
  std::function<void(Parameter&)> ready_;
  std::unique_ptr<Delivery> delivery_;      // one per mode (src/train/delivery.h)
  std::unique_ptr<StepProgress> progress_;  // a line on stderr (src/train/progress.h), or null
  StepDelivery* step_ = nullptr;            // delivery_ in step mode, else null
  std::atomic<uint64_t> rng_{0};            // rng_state()
  bool defer_step_ = false;
  double clip_norm_ = 0, last_norm_ = 0;
};

// Adds `src` into `dst` elementwise (same shape and dtype).
void add_inplace(Tensor& dst, const Tensor& src);
// Learning-rate schedules, as factors of the base rate by the number of optimizer steps already
// taken (`done`, 0 at the first step) out of `total`, with `warmup` linear warm-up steps first
// (0, 1/w, 2/w, ...): Hugging Face's get_linear_schedule_with_warmup /
// get_cosine_schedule_with_warmup (half a cosine to 0), and "constant" (1 after the warm-up).
// InvalidArgument on an unknown name.
double lr_schedule_factor(const std::string& schedule, int64_t done, int64_t total, int64_t warmup);

// PyTorch's clip_grad_norm_ over the parameters' .grad: scales every gradient by
// min(1, max_norm / (norm + 1e-6)) where norm is the 2-norm of all of them; returns the norm.
double clip_grad_norm(const std::vector<Parameter*>& params, double max_norm);

// --- optimizers ----------------------------------------------------------------------------------
// An optimizer's hyperparameters and state as plain data: what a checkpoint holds of it
// (graft/checkpoint.h), and what two optimizers' settings compare by.
struct OptimizerState {
  std::map<std::string, double>
      hyper;          // hyperparameters by name; a flag (SGD's nesterov) is 0 or 1
  int64_t steps = 0;  // Optimizer::steps()
  // Per parameter, in the optimizer's order: its state tensors by name (SGD: momentum_buffer;
  // AdamW: exp_avg, exp_avg_sq). A name that is absent or holds an undefined tensor: none yet.
  // The tensors share the optimizer's blocks (no bytes are copied either way).
  std::vector<std::map<std::string, Tensor>> tensors;
  std::vector<int64_t> counters;  // per parameter: AdamW's steps taken; 0 for SGD
  // With a state file (Optimizer::set_state_file): a parameter whose map is empty and whose
  // counter is > 0 has all of its kind's tensors in the file, not here (state_in_ram(); for
  // load_state, a checkpoint wrote them there with write_file_state).
  bool tensors_in_file = false;
};

// What one kind of optimizer saves, known without an instance of it, so that a checkpoint can be
// verified before any optimizer is at hand (verify_checkpoint).
struct OptimizerKind {
  std::string name;                                 // "sgd", "adamw"
  std::vector<std::pair<std::string, bool>> hyper;  // hyperparameters, in reading order; true: a
                                                    // flag (saved as a boolean)
  std::vector<std::string> tensors;                 // per-parameter state tensors, in file order
  // Whether the hyperparameters (all of `hyper` present) are in range and finite.
  bool (*hyper_valid)(const std::map<std::string, double>& hyper);
  // "" when one parameter's state tensors (their names, as stored, in order) fit its counter;
  // otherwise what is wrong.
  std::string (*check_tensors)(const std::vector<std::string>& names, int64_t counter);
};
// The built-in kind named `name` ("sgd", "adamw"), or null.
const OptimizerKind* find_optimizer_kind(const std::string& name);

// Where an optimizer keeps its per-parameter state when not in RAM (Optimizer::set_state_file;
// Note [optimizer state on disk] in src/train/state_file.cpp).
struct StateFileOptions {
  std::string path;          // the file: created, or truncated if it exists
  int64_t window_bytes = 0;  // RAM for states in flight (read ahead, being written); 0: one
                             // unit (kStateFileUnitBytes of each state tensor) plus 512 MiB, or
                             // plus the whole state when smaller. Never less than one unit.
  bool direct_io = true;     // O_DIRECT (no page cache); buffered + posix_fadvise where refused
};
// A state file moves a parameter's state in units of at most this many bytes of each state tensor
// (so the window need not hold a whole large parameter's state).
inline constexpr int64_t kStateFileUnitBytes = int64_t{32} << 20;
// What a state file has done so far (Optimizer::state_file_stats).
struct StateFileStats {
  std::string path;
  bool direct_io = false;
  int64_t file_bytes = 0, window_bytes = 0, bytes_read = 0, bytes_written = 0, prefetch_hits = 0;
};
class StateFile;

class Optimizer {
 public:
  virtual ~Optimizer();
  // One step over every parameter that has a .grad (PyTorch's optimizer.step()).
  void step();
  // The update of parameter i (params() order) with `grad`, alone: what step() does for each
  // parameter, and what the step-in-backward mode does the moment a gradient is complete.
  virtual void update(size_t i, const Tensor& grad) = 0;
  // Opens the next step: the updates that follow, until the next begin_step, belong to it. The
  // one place the step count advances; step() calls it, and so does whoever applies a step as
  // per-parameter updates (the session's step mode, data parallelism) before the first of them.
  void begin_step() {
    ++t_;
    began_step();
  }
  // Index of p in params(), or -1.
  int index_of(const Parameter& p) const;
  void zero_grad(bool set_to_none = true);
  int64_t steps() const { return t_; }
  // The parameters updated, in order (OptimizerState's per-parameter order).
  const std::vector<Parameter*>& params() const { return params_; }
  // Where state tensors are allocated.
  Allocator& allocator() const { return *alloc_; }
  // Keeps the per-parameter state in a file instead of RAM, streamed in the order updates come
  // (step mode: the plan's); RAM holds a window of it. Before the first step (while no state
  // exists); AdamW only (others throw Unsupported). Throws Io naming the path and the bytes
  // needed when its disk cannot hold the state. Updates are bit-identical to keeping it in RAM.
  virtual void set_state_file(const StateFileOptions& o);
  // The state file's counters, once the writes in flight are done; path empty when the state is
  // in RAM.
  StateFileStats state_file_stats() const;
  // Whether the per-parameter state lives in a state file.
  bool state_in_file() const { return file_ != nullptr; }
  // Parameter i's state tensors, back to back in the kind's order (bytes: the parameter's times
  // the kind's tensor count), read from the state file / written into it; a state never written
  // reads as zeros. What a checkpoint streams one parameter at a time (RAM: one parameter's).
  void read_file_state(size_t i, void* dst) const;
  void write_file_state(size_t i, const void* src);
  // Where parameter i's state lies in the state file: (offset, stride), its state tensor j at
  // offset + j * stride.
  std::pair<int64_t, int64_t> file_state_offset(size_t i) const;
  // The learning rate (what a schedule sets before each step).
  virtual double lr() const = 0;
  virtual void set_lr(double lr) = 0;

  // --- serialization (graft/checkpoint.h) ---
  // The kind's name ("sgd", "adamw"; find_optimizer_kind describes it).
  virtual const char* kind() const = 0;
  // Hyperparameters and state, sharing the state tensors' blocks (with a state file, its
  // tensors are read from it: that much RAM).
  virtual OptimizerState state() const = 0;
  // state() without reading the state file: tensors_in_file set, and an empty map for each
  // parameter whose state is in the file. The same as state() without one.
  virtual OptimizerState state_in_ram() const { return state(); }
  // Throws InvalidArgument, naming what is wrong, unless load_state(st) would succeed: every
  // hyperparameter of the kind present and valid, one entry per parameter, only the kind's tensor
  // names, each of its parameter's dtype and shape, consistent with its counter. Modifies nothing.
  virtual void check_state(const OptimizerState& st) const;
  // Replaces hyperparameters, step count and state with `st` (checked first: on error nothing
  // changes). The optimizer shares st's tensors from then on.
  virtual void load_state(const OptimizerState& st) = 0;

 protected:
  explicit Optimizer(std::vector<Parameter*> params, Allocator* alloc = nullptr);
  void load_steps(int64_t t) { t_ = t; }  // load_state only
  void began_step();                      // begin_step's hook (the state file reads ahead)
  std::vector<Parameter*> params_;
  Allocator* alloc_;
  std::unique_ptr<StateFile> file_;  // set_state_file: the state lives there, not in tensors

 private:
  int64_t t_ = 0;  // steps(): advanced by begin_step() alone
};

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
};
class SGD final : public Optimizer {
 public:
  SGD(std::vector<Parameter*> params, SGDOptions o, Allocator* alloc = nullptr);
  void update(size_t i, const Tensor& grad) override;
  const char* kind() const override { return "sgd"; }
  double lr() const override { return options.lr; }
  void set_lr(double lr) override { options.lr = lr; }
  OptimizerState state() const override;
  void load_state(const OptimizerState& st) override;
  SGDOptions options;
  // Momentum buffers, one per parameter (undefined until the parameter's first step).
  std::vector<Tensor>& momentum_buffer() { return buf_; }
  const std::vector<Tensor>& momentum_buffer() const { return buf_; }

 private:
  std::vector<Tensor> buf_;  // momentum buffers (OptimizerState)
};

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};
// AdamW's update of n elements in place (PyTorch 1.13's single-tensor formula; Note [AdamW's
// vector update], optim.cpp): weights w, gradient g, moments m and v, all of `dtype` (F32 or F64),
// for the update numbered `step` (1 for the first), on graft's threads. AdamW::update runs it on
// its own state; GraftModule's step mode on torch.optim.AdamW's (Note [graft's update in step
// mode], python/graft/_function.py).
void adamw_apply(DType dtype, void* w, const void* g, void* m, void* v, int64_t n, int64_t step,
                 const AdamWOptions& o);
class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<Parameter*> params, AdamWOptions o, Allocator* alloc = nullptr);
  void update(size_t i, const Tensor& grad) override;
  void set_state_file(const StateFileOptions& o) override;
  const char* kind() const override { return "adamw"; }
  double lr() const override { return options.lr; }
  void set_lr(double lr) override { options.lr = lr; }
  OptimizerState state() const override;
  OptimizerState state_in_ram() const override;
  void load_state(const OptimizerState& st) override;
  AdamWOptions options;
  std::vector<Tensor>& exp_avg() { return m_; }
  std::vector<Tensor>& exp_avg_sq() { return v_; }
  // (In RAM only: with a state file they stay undefined; state() reads them from the file.)
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  // Steps taken per parameter (PyTorch's state['step']); 0 = no state yet.
  std::vector<int64_t>& param_steps() { return steps_; }
  const std::vector<int64_t>& param_steps() const { return steps_; }

 private:
  std::vector<Tensor> m_, v_;   // OptimizerState
  std::vector<int64_t> steps_;  // per parameter, like PyTorch's state['step']
};

}  // namespace graft
