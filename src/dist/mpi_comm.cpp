// The MPI communicator: every MPI call is made by one thread of its own (MPI_THREAD_SERIALIZED is
// all it needs), which takes operations from a queue in order, so that an all-reduce started in the
// middle of backward proceeds while the caller's thread keeps computing.
//
// Note [Bounded waits]
// A blocking MPI call cannot be given a deadline, and a rank that died or hangs leaves the others
// blocked in it forever. So every operation is started non-blocking (MPI_Ibcast, MPI_Iallreduce,
// ...) and the thread polls it with MPI_Test (which also drives Open MPI's progress), yielding the
// CPU between polls; past the deadline the operation fails with a Communication error naming it,
// every later one fails at once, and the communicator ends the job with MPI_Abort instead of
// MPI_Finalize (which would wait for the lost rank).
#include <mpi.h>
#include <sched.h>

#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "graft/distributed.h"

namespace graft {

bool mpi_available() { return true; }

bool launched_by_mpirun() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

namespace {

std::string mpi_error(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int n = 0;
  MPI_Error_string(rc, buf, &n);
  return std::string(buf, n);
}

std::string mib(int64_t bytes) {
  char b[32];
  if (bytes < (1 << 20))
    std::snprintf(b, sizeof b, "%.1f KiB", bytes / 1024.0);
  else
    std::snprintf(b, sizeof b, "%.1f MiB", bytes / 1048576.0);
  return b;
}

// The collectives reduce float32 and float64 (gradients) only.
void require_float(DType dt, const char* what) {
  GRAFT_CHECK(dt == DType::F32 || dt == DType::F64, ErrorKind::Unsupported,
              std::string(what) + " of " + dtype_name(dt) +
                  " gradients (graft averages float32 and float64)");
}
MPI_Datatype mpi_type(DType dt) { return dt == DType::F32 ? MPI_FLOAT : MPI_DOUBLE; }

struct Job {
  enum Kind { Broadcast, Allgather, Barrier, Allreduce, ReduceScatter, Allgatherv } kind;
  std::vector<int> counts;  // ReduceScatter, Allgatherv: per rank
  void* data = nullptr;
  const void* in = nullptr;
  int64_t n = 0;  // bytes (Broadcast, Allgather) or elements (Allreduce)
  DType dt = DType::F32;
  double scale = 1;
  int root = 0;
  bool finished = false;
  std::string error;
  double t0 = 0, t1 = 0;
};

class MpiComm;

class MpiWork final : public Communicator::Work {
 public:
  MpiWork(MpiComm* c, std::shared_ptr<Job> j) : c_(c), j_(std::move(j)) {}
  bool done() override;
  void wait() override;
  double started() const override { return j_->t0; }
  double ended() const override { return j_->t1; }

 private:
  MpiComm* c_;
  std::shared_ptr<Job> j_;
};

class MpiComm final : public Communicator {
 public:
  MpiComm(int* argc, char*** argv, double timeout) : timeout_(timeout) {
    GRAFT_CHECK(timeout > 0, ErrorKind::InvalidArgument, "the communication timeout must be > 0");
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      int provided = 0;
      int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided);
      GRAFT_CHECK(rc == MPI_SUCCESS, ErrorKind::Communication,
                  "MPI_Init_thread failed: " + mpi_error(rc));
      GRAFT_CHECK(provided >= MPI_THREAD_SERIALIZED, ErrorKind::Communication,
                  "this MPI library does not allow calls from a second thread "
                  "(MPI_THREAD_SERIALIZED), which graft's overlapped all-reduce needs");
      owns_mpi_ = true;
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    t_origin_ = std::chrono::steady_clock::now();
    worker_ = std::thread([this] { loop(); });
  }

  ~MpiComm() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    if (failed_) {
      std::fflush(stdout);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);  // a clean MPI_Finalize would wait for the lost rank
    }
    MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  double now() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_origin_).count();
  }

  void broadcast(void* data, int64_t bytes, int root) override {
    auto j = std::make_shared<Job>();
    j->kind = Job::Broadcast;
    j->data = data;
    j->n = bytes;
    j->root = root;
    wait(submit(j));
  }
  void allgather(const void* data, int64_t bytes, void* out) override {
    auto j = std::make_shared<Job>();
    j->kind = Job::Allgather;
    j->in = data;
    j->data = out;
    j->n = bytes;
    wait(submit(j));
  }
  void barrier() override {
    auto j = std::make_shared<Job>();
    j->kind = Job::Barrier;
    wait(submit(j));
  }
  std::shared_ptr<Work> allreduce_async(void* data, int64_t count, DType dt,
                                        double scale) override {
    require_float(dt, "all-reduce");
    auto j = std::make_shared<Job>();
    j->kind = Job::Allreduce;
    j->data = data;
    j->n = count;
    j->dt = dt;
    j->scale = scale;
    return std::make_shared<MpiWork>(this, submit(j));
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv,
                                             const std::vector<int>& counts, DType dt,
                                             double scale) override {
    require_float(dt, "reduce-scatter");
    GRAFT_CHECK(static_cast<int>(counts.size()) == size_, ErrorKind::Internal,
                "reduce-scatter: one count per rank");
    auto j = std::make_shared<Job>();
    j->kind = Job::ReduceScatter;
    j->in = send;
    j->data = recv;
    j->counts = counts;
    j->n = counts[rank_];
    j->dt = dt;
    j->scale = scale;
    return std::make_shared<MpiWork>(this, submit(j));
  }
  void allgatherv(void* data, const std::vector<int>& counts, DType dt) override {
    GRAFT_CHECK(static_cast<int>(counts.size()) == size_, ErrorKind::Internal,
                "allgatherv: one count per rank");
    auto j = std::make_shared<Job>();
    j->kind = Job::Allgatherv;
    j->data = data;
    j->counts = counts;
    j->dt = dt;
    wait(submit(j));
  }
  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

  bool failed() const override {
    std::lock_guard<std::mutex> lk(mu_);
    return failed_flag_;
  }

  bool finished(const Job& j) {
    std::lock_guard<std::mutex> lk(mu_);
    return j.finished;
  }
  void wait(const std::shared_ptr<Job>& j) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return j->finished; });
    if (!j->error.empty()) throw Error(ErrorKind::Communication, j->error);
  }

 private:
  std::shared_ptr<Job> submit(std::shared_ptr<Job> j) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(j);
    }
    cv_.notify_all();
    return j;
  }

  void loop() {
    for (;;) {
      std::shared_ptr<Job> j;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        j = q_.front();
        q_.pop_front();
      }
      std::string err =
          failed_ ? "an earlier communication failed (" + first_error_ + ")" : run(*j);
      if (!err.empty() && !failed_) {
        failed_ = true;
        first_error_ = err;
        // Said at once, on this rank: the job may be ended by another rank's abort before this
        // rank's caller gets to report it.
        std::fprintf(stderr, "graft: rank %d of %d: %s\n", rank_, size_, err.c_str());
        std::fflush(stderr);
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        j->error = err;
        j->finished = true;
        failed_flag_ = failed_;
      }
      done_cv_.notify_all();
    }
  }

  // Waits for `req` until the deadline (Note [Bounded waits]); "" or what went wrong.
  std::string poll(MPI_Request& req, const std::string& what) {
    const double deadline = now() + timeout_;
    int flag = 0;
    for (long spins = 0;; ++spins) {
      int rc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) return what + " failed: " + mpi_error(rc);
      if (flag) return "";
      if (now() > deadline) {
        char b[64];
        std::snprintf(b, sizeof b, "%g", timeout_);
        return what + " did not complete within " + b +
               " s: another rank died, hangs, or runs a different number of steps or a different "
               "model (every rank must run the same steps); ending the job";
      }
      if (spins < 2000)
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // A plain loop: this thread must not use the kernels' thread pool, which the caller's backward
  // is using at the same moment.
  static void scale_in_place(void* data, int64_t n, DType dt, double scale) {
    if (dt == DType::F32) {
      float* x = static_cast<float*>(data);
      const float s = static_cast<float>(scale);
      for (int64_t i = 0; i < n; ++i) x[i] *= s;
    } else {
      double* x = static_cast<double*>(data);
      for (int64_t i = 0; i < n; ++i) x[i] *= scale;
    }
  }

  std::string run(Job& j) {
    j.t0 = now();
    std::string err;
    MPI_Request req;
    // MPI counts are ints: large buffers go in chunks.
    const int64_t kChunk = INT_MAX / 8;
    switch (j.kind) {
      case Job::Broadcast:
        for (int64_t off = 0; off < j.n && err.empty(); off += kChunk) {
          int c = static_cast<int>(std::min(kChunk, j.n - off));
          int rc = MPI_Ibcast(static_cast<char*>(j.data) + off, c, MPI_BYTE, j.root, comm_, &req);
          err = rc != MPI_SUCCESS ? "broadcast failed: " + mpi_error(rc)
                                  : poll(req, "the broadcast of " + mib(j.n) + " from rank 0");
        }
        break;
      case Job::Allgather: {
        GRAFT_CHECK(j.n < INT_MAX, ErrorKind::Internal, "allgather too large");
        int rc = MPI_Iallgather(j.in, static_cast<int>(j.n), MPI_BYTE, j.data,
                                static_cast<int>(j.n), MPI_BYTE, comm_, &req);
        err = rc != MPI_SUCCESS ? "allgather failed: " + mpi_error(rc)
                                : poll(req, "the model check (allgather)");
        break;
      }
      case Job::Barrier: {
        int rc = MPI_Ibarrier(comm_, &req);
        err = rc != MPI_SUCCESS ? "barrier failed: " + mpi_error(rc) : poll(req, "a barrier");
        break;
      }
      case Job::ReduceScatter: {
        int rc = MPI_Ireduce_scatter(j.in, j.data, j.counts.data(), mpi_type(j.dt), MPI_SUM, comm_,
                                     &req);
        int64_t total = 0;
        for (int c : j.counts) total += c;
        err = rc != MPI_SUCCESS ? "reduce-scatter failed: " + mpi_error(rc)
                                : poll(req, "the reduce-scatter of a " +
                                                mib(total * dtype_size(j.dt)) + " gradient bucket");
        if (err.empty() && j.scale != 1) scale_in_place(j.data, j.n, j.dt, j.scale);
        break;
      }
      case Job::Allgatherv: {
        std::vector<int> displs(j.counts.size(), 0);
        for (size_t r = 1; r < j.counts.size(); ++r) displs[r] = displs[r - 1] + j.counts[r - 1];
        int rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, j.data, j.counts.data(),
                                 displs.data(), mpi_type(j.dt), comm_, &req);
        err = rc != MPI_SUCCESS ? "parameter all-gather failed: " + mpi_error(rc)
                                : poll(req, "the all-gather of the updated parameters");
        break;
      }
      case Job::Allreduce: {
        const size_t es = dtype_size(j.dt);
        for (int64_t off = 0; off < j.n && err.empty(); off += kChunk) {
          int c = static_cast<int>(std::min(kChunk, j.n - off));
          void* p = static_cast<char*>(j.data) + off * es;
          int rc = MPI_Iallreduce(MPI_IN_PLACE, p, c, mpi_type(j.dt), MPI_SUM, comm_, &req);
          err = rc != MPI_SUCCESS
                    ? "all-reduce failed: " + mpi_error(rc)
                    : poll(req, "the all-reduce of a " + mib(j.n * es) + " gradient bucket");
        }
        if (err.empty() && j.scale != 1) scale_in_place(j.data, j.n, j.dt, j.scale);
        break;
      }
    }
    j.t1 = now();
    return err;
  }

  double timeout_;
  bool owns_mpi_ = false;
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::chrono::steady_clock::time_point t_origin_;
  std::thread worker_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::shared_ptr<Job>> q_;
  bool stop_ = false;
  bool failed_ = false;  // the worker's alone (read by the destructor after join)
  std::string first_error_;
  bool failed_flag_ = false;  // failed_, for other threads (under mu_)
};

bool MpiWork::done() { return c_->finished(*j_); }
void MpiWork::wait() { c_->wait(j_); }

}  // namespace

std::unique_ptr<Communicator> mpi_communicator(int* argc, char*** argv, double timeout_seconds) {
  return std::make_unique<MpiComm>(argc, argv, timeout_seconds);
}

}  // namespace graft
