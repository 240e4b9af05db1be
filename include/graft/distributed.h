// Data-parallel training: several processes (ranks) each train the same model on their own shard
// of the batch, and average their gradients while backward runs (docs/data-parallel.md).
//
//   auto comm = graft::mpi_communicator(&argc, &argv);      // under mpirun -np N
//   graft::TrainSession s(...);                             // every rank: the same model
//   graft::SGD opt(s.trainable(), {.lr = 0.1});
//   graft::DataParallel dp(s, *comm);                       // parameters broadcast from rank 0
//   for (...) { s.set_input("x", my_shard); dp.step(); opt.step(); s.zero_grad(false); }
//
// Gradients are grouped into buckets in the order backward delivers them; the moment a bucket's
// last gradient is delivered its all-reduce starts on the communicator's own thread and overlaps
// the rest of backward (PyTorch DDP's design, driven by graft's gradient delivery instead of
// autograd hooks). dp.step() returns when every bucket is averaged.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "graft/train.h"

namespace graft {

// A group of ranks that reduce buffers together. Every call is collective: all ranks make the same
// calls in the same order. Every wait is bounded by the communicator's timeout: a rank that died,
// hangs, or calls something else gives an error on the waiting ranks (never a hang).
class Communicator {
 public:
  // An operation in flight (an all-reduce started by allreduce_async).
  class Work {
   public:
    virtual ~Work() = default;
    virtual bool done() = 0;  // finished (successfully or not); never blocks
    virtual void wait() = 0;  // blocks until finished; throws the error it ended with
    // steady_clock seconds (since the communicator was made) when the transfer started / ended.
    virtual double started() const = 0;
    virtual double ended() const = 0;
  };
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual double now() const = 0;  // the clock started() / ended() use
  // Blocking collectives.
  virtual void broadcast(void* data, int64_t bytes, int root) = 0;
  // Every rank's `bytes` bytes, concatenated in rank order into `out` (size() * bytes).
  virtual void allgather(const void* data, int64_t bytes, void* out) = 0;
  virtual void barrier() = 0;
  // Sums `count` elements of `dt` (float32 or float64) across ranks, in place, then multiplies the
  // sum by `scale` (1 / size() averages). Starts at once on the communicator's thread, after the
  // operations started before it; returns without waiting.
  virtual std::shared_ptr<Work> allreduce_async(void* data, int64_t count, DType dt,
                                                double scale) = 0;
  // ZeRO-1: sums `send` (sum of `counts` elements) across ranks and leaves rank r's part (the
  // counts[r] elements after the first r parts) in `recv`, multiplied by `scale`. Asynchronous, in
  // order with the others, like allreduce_async.
  virtual std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv,
                                                     const std::vector<int>& counts, DType dt,
                                                     double scale) = 0;
  // In place: rank r's part of `data` (counts[r] elements after the first r parts) is sent to
  // every rank; blocking.
  virtual void allgatherv(void* data, const std::vector<int>& counts, DType dt) = 0;
  // Ends the whole job at once (every rank), with `code`: after an error that leaves a collective
  // unfinished, where a clean shutdown would wait for ranks that will never answer.
  [[noreturn]] virtual void abort(int code) = 0;
  // Whether an operation failed (and said so on stderr, naming this rank); every later one fails.
  virtual bool failed() const = 0;
};

// An error every rank raises at the same point, because a collective check found it on all of them
// (DataParallel's check that every rank trains the same model): abort_job waits for the others at
// a barrier after saying it, so that no rank's abort cuts another's message short.
class AgreedError : public Error {
 public:
  using Error::Error;
};

// After an error on this rank, in a job whose other ranks would wait in a collective this rank
// never joins: prints the error naming the rank (unless the communicator already reported its own
// failure), then ends the whole job (Communicator::abort) instead of letting them time out.
[[noreturn]] void abort_job(Communicator& comm, const std::exception& e);

// Whether this build has MPI (the distributed layer is optional: CMake finds Open MPI).
bool mpi_available();
// The MPI world (MPI_Init_thread on first use; MPI_Finalize when the last communicator goes,
// or MPI_Abort if an operation failed). `timeout_seconds` bounds every wait.
std::unique_ptr<Communicator> mpi_communicator(int* argc, char*** argv,
                                               double timeout_seconds = 300);
// Whether this process was started by mpirun (Open MPI's or any PMI launcher's variables).
bool launched_by_mpirun();

struct DataParallelOptions {
  // Gradients per bucket, at most (PyTorch DDP's bucket_cap_mb = 25); one gradient larger than
  // this is a bucket of its own.
  int64_t bucket_bytes = 25ll << 20;
  // false: every bucket's all-reduce starts only after backward ends (the no-overlap baseline the
  // benchmark compares with).
  bool overlap = true;
};

// What the last synchronized step's communication did.
struct DataParallelStats {
  int buckets = 0;
  int64_t bytes = 0;                // gradient bytes all-reduced
  double backward_seconds = 0;      // forward + backward on this rank (session.step())
  double comm_seconds = 0;          // sum over buckets of all-reduce time
  double exposed_seconds = 0;       // waited for after backward ended (not hidden)
  double hidden_fraction() const {  // of the all-reduce time, the share that overlapped backward
    if (comm_seconds <= 0) return 0;
    double h = 1 - exposed_seconds / comm_seconds;
    return h < 0 ? 0 : h > 1 ? 1 : h;
  }
};

class DataParallel {
 public:
  // Checks that every rank has the same model (parameter names, shapes, dtypes, delivery order,
  // mode, bucket size), else throws on every rank naming the first difference; then broadcasts
  // every parameter from rank 0. From here on the session's gradients are averaged over the ranks
  // during each synchronized backward. Takes over the session's hook (hook and step modes) and
  // its gradient-ready callback; the destructor gives them back.
  DataParallel(TrainSession& s, Communicator& comm, DataParallelOptions o = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Step mode: the optimizer applied to each parameter once its bucket is averaged (in place of
  // TrainSession::set_step_optimizer).
  void set_step_optimizer(Optimizer* opt);
  // ZeRO-1 (accumulate, hold and hook modes): each bucket is reduce-scattered instead of
  // all-reduced, and step() ends by updating only this rank's 1/N of every bucket with an
  // optimizer of `like`'s kind and hyperparameters (its learning rate read at every step, so
  // schedules apply), which holds 1/N of the optimizer state; then the parameters are all-gathered.
  // `like` itself is never stepped. .grad keeps the local (not averaged) sums.
  void shard_optimizer(const Optimizer& like);
  // Bytes of optimizer state this rank holds (ZeRO-1), 0 before the first step or without it.
  int64_t sharded_state_bytes() const;
  // Micro-batches (PyTorch DDP's no_sync): while false, backward accumulates into .grad locally
  // and nothing is communicated; the next synchronized step averages the accumulated sums.
  void set_sync(bool sync);
  // session.step() with the gradients averaged across ranks; returns this rank's loss. In
  // accumulate and hook mode the caller then runs its optimizer; in step mode it has run.
  double step();

  struct Bucket {
    std::vector<int> params;      // indices into session.parameters(), in delivery order
    std::vector<int64_t> offset;  // per param: element offset in the bucket
    int64_t count = 0;            // elements
    DType dtype = DType::F32;
  };
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const DataParallelStats& last_stats() const { return stats_; }

 private:
  void check_same_model(const std::vector<int>& order);
  void broadcast_parameters();
  void bind_grad_views();
  void bind_view(int i);
  char* slot(int b, size_t k) const;
  void ensure_bucket(int b);
  void on_ready(Parameter& p);
  void on_step_grad(Parameter& p, const Tensor& grad);
  void launch(int b);
  void apply_finished_updates(bool wait_all);
  void wait_all();
  void sharded_update();

  TrainSession& s_;
  Communicator& comm_;
  DataParallelOptions o_;
  Optimizer* opt_ = nullptr;
  bool sync_ = true, in_step_ = false;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_, slot_of_;  // per parameter: its bucket and index in it (-1: none)
  std::vector<Tensor> storage_;  // per bucket: the flat buffer (step mode: only while in flight)
  std::vector<Tensor> views_;    // per parameter: .grad as a view into its bucket (not step mode)
  std::vector<int> pending_;     // per bucket: gradients still to come this step
  std::vector<std::shared_ptr<Communicator::Work>> work_;
  std::vector<bool> applied_;  // step mode: per bucket, updates applied
  int next_launch_ = 0;        // buckets launch in order: every rank starts them in the same order
  std::vector<bool> ready_;
  DataParallelStats stats_;
  // ZeRO-1
  const Optimizer* like_ = nullptr;
  std::unique_ptr<Optimizer> shard_opt_;
  std::vector<Parameter> shard_params_;   // this rank's slices of parameters (views)
  std::vector<Tensor> chunk_;             // per bucket: this rank's averaged slice of the gradients
  std::vector<std::vector<int>> counts_;  // per bucket: every rank's slice length
  struct Piece {
    int k;         // the parameter's index in its bucket
    int64_t a, z;  // bucket elements [a, z) of it in this rank's slice
  };
  std::vector<std::vector<Piece>> pieces_;  // per bucket
};

}  // namespace graft
