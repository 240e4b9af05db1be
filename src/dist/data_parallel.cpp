// graft::DataParallel: gradients averaged across ranks in buckets, each all-reduce started the
// moment backward delivers the bucket's last gradient.
//
// Note [Buckets and gradient delivery]
// Buckets hold gradients in the order backward delivers them (TrainSession::delivery_order, the
// plan's order of gradient sinks), at most bucket_bytes each, one dtype each, so they fill in
// order and every rank starts the same all-reduces in the same order.
// - accumulate / hold: .grad is a view into its bucket (PyTorch DDP's gradient_as_bucket_view), so
//   the weight-gradient GEMM writes (beta = 1) straight into the buffer that is all-reduced: no
//   copy and no second gradient set. The session's gradient-ready callback counts the bucket down.
// - hook: the same buffers; graft's hook adds the delivered gradient into the view (what
//   AccumulateGrad does), then counts down.
// - step: no gradient set is kept. The hook copies each gradient into its bucket, allocated when
//   the bucket's first gradient arrives; when the bucket is averaged the optimizer updates its
//   parameters (on the caller's thread, the next time a gradient arrives or at the end of
//   backward) and the bucket is freed. A parameter is only delivered after every backward read of
//   it (the session orders sinks so), so updating it while backward continues is safe.
// Micro-batches (set_sync(false)): backward accumulates into .grad as usual and nothing is sent;
// the next synchronized step averages the sums.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "graft/distributed.h"

namespace graft {

namespace {
uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
uint64_t fnv(uint64_t h, const std::string& s) { return fnv(h, s.data(), s.size() + 1); }
uint64_t fnv(uint64_t h, int64_t v) { return fnv(h, &v, sizeof v); }

std::string describe(const Parameter& p) {
  return "'" + p.name + "' (" + dtype_name(p.data.dtype()) + " " + shape_str(p.data.shape()) +
         (p.trainable ? "" : ", frozen") + ")";
}

// GRAFT_CHECK for a condition every rank evaluates alike (on gathered data): an AgreedError.
#define AGREED_CHECK(cond, kind, msg)                         \
  do {                                                        \
    if (!(cond)) throw AgreedError((kind), std::string(msg)); \
  } while (0)

}  // namespace

void abort_job(Communicator& comm, const std::exception& e) {
  if (!comm.failed()) {
    std::fprintf(stderr, "graft: rank %d of %d: %s\n", comm.rank(), comm.size(), e.what());
    std::fflush(stderr);
    if (dynamic_cast<const AgreedError*>(&e) != nullptr) {
      try {
        comm.barrier();  // every rank has said it (the communicator's timeout bounds the wait)
      } catch (const std::exception&) {
      }
    }
  }
  comm.abort(1);
  std::_Exit(1);  // not reached (abort ends the process); for the compiler
}

DataParallel::DataParallel(TrainSession& s, Communicator& comm, DataParallelOptions o)
    : s_(s), comm_(comm), o_(o) {
  GRAFT_CHECK(o.bucket_bytes > 0, ErrorKind::InvalidArgument, "the bucket size must be > 0");
  GRAFT_CHECK(s.clip_norm() == 0, ErrorKind::InvalidArgument,
              "data parallelism with the step mode's gradient clipping is not supported (the "
              "norm would be of this rank's gradients, not of the averaged ones); clip in "
              "accumulate or hook mode instead");
  auto& ps = s.parameters();
  bucket_of_.assign(ps.size(), -1);
  slot_of_.assign(ps.size(), -1);
  const std::vector<int> order = s.delivery_order();
  for (int i : order) {
    const Parameter& p = ps[i];
    const DType dt = p.data.dtype();
    GRAFT_CHECK(dt == DType::F32 || dt == DType::F64, ErrorKind::Unsupported,
                "data parallelism averages float32 and float64 gradients; parameter " +
                    describe(p) + " is neither");
    const int64_t bytes = p.data.numel() * static_cast<int64_t>(dtype_size(dt));
    if (buckets_.empty() || buckets_.back().dtype != dt ||
        (buckets_.back().count > 0 &&
         (buckets_.back().count * static_cast<int64_t>(dtype_size(dt)) + bytes > o.bucket_bytes)))
      buckets_.push_back(Bucket{{}, {}, 0, dt});
    Bucket& b = buckets_.back();
    bucket_of_[i] = static_cast<int>(buckets_.size()) - 1;
    slot_of_[i] = static_cast<int>(b.params.size());
    b.params.push_back(i);
    b.offset.push_back(b.count);
    b.count += p.data.numel();
  }
  check_same_model(order);
  broadcast_parameters();

  const size_t nb = buckets_.size();
  storage_.resize(nb);
  views_.resize(ps.size());
  pending_.assign(nb, 0);
  work_.resize(nb);
  applied_.assign(nb, true);
  ready_.assign(ps.size(), false);
  if (s.mode() != GradMode::Step) {
    // The gradient set lives in the buckets from now on (Note [Buckets and gradient delivery]).
    for (size_t b = 0; b < nb; ++b) {
      const Bucket& bk = buckets_[b];
      storage_[b] = Tensor::zeros({bk.count}, bk.dtype, s.allocator(), Category::Gradient);
      for (size_t k = 0; k < bk.params.size(); ++k)
        views_[bk.params[k]] =
            Tensor::external(slot(static_cast<int>(b), k), ps[bk.params[k]].data.shape(), bk.dtype,
                             storage_[b].storage());
    }
  }
  s.set_grad_ready([this](Parameter& p) { on_ready(p); });
  if (s.mode() == GradMode::Hook || s.mode() == GradMode::Step)
    s.set_hook([this](Parameter& p, const Tensor& g) { on_step_grad(p, g); });
}

DataParallel::~DataParallel() {
  s_.set_grad_ready(nullptr);
  if (s_.mode() == GradMode::Hook || s_.mode() == GradMode::Step) s_.set_hook(nullptr);
  // .grad views keep their bucket alive (their storage holds it), so nothing dangles.
}

void DataParallel::check_same_model(const std::vector<int>& order) {
  // Per parameter a fingerprint; then everything else that must agree. Gathered from every rank
  // and compared with rank 0's, so every rank names the same first difference (an AgreedError).
  const auto& ps = s_.parameters();
  const int n = comm_.size();
  int64_t count = static_cast<int64_t>(ps.size());
  std::vector<int64_t> counts(n);
  comm_.allgather(&count, sizeof count, counts.data());
  for (int r = 1; r < n; ++r)
    AGREED_CHECK(counts[r] == counts[0], ErrorKind::Communication,
                 "rank " + std::to_string(r) + " has a model with " + std::to_string(counts[r]) +
                     " parameters and rank 0 one with " + std::to_string(counts[0]) +
                     ": every rank must train the same model");
  std::vector<uint64_t> mine;
  for (const Parameter& p : ps) {
    uint64_t h = fnv(1469598103934665603ull, p.name);
    h = fnv(h, static_cast<int64_t>(p.data.dtype()));
    for (int64_t d : p.data.shape()) h = fnv(h, d);
    mine.push_back(fnv(h, static_cast<int64_t>(p.trainable)));
  }
  uint64_t setup = fnv(1469598103934665603ull, static_cast<int64_t>(s_.mode()));
  setup = fnv(setup, o_.bucket_bytes);
  for (int i : order) setup = fnv(setup, static_cast<int64_t>(i));
  mine.push_back(setup);
  std::vector<uint64_t> all(mine.size() * n);
  comm_.allgather(mine.data(), static_cast<int64_t>(mine.size() * sizeof(uint64_t)), all.data());
  for (int r = 1; r < n; ++r) {
    const uint64_t* theirs = all.data() + r * mine.size();
    for (size_t i = 0; i < ps.size(); ++i)
      AGREED_CHECK(theirs[i] == all[i], ErrorKind::Communication,
                   "rank " + std::to_string(r) + "'s model differs from rank 0's at parameter " +
                       std::to_string(i) + " (" + describe(ps[i]) + " on rank " +
                       std::to_string(comm_.rank()) +
                       "): every rank must train the same model, with the same --freeze");
    AGREED_CHECK(theirs[ps.size()] == all[ps.size()], ErrorKind::Communication,
                 "rank " + std::to_string(r) +
                     " differs from rank 0 in the gradient mode, the bucket size or the order of "
                     "gradient delivery (this rank: mode " +
                     grad_mode_name(s_.mode()) + ", buckets of " + std::to_string(o_.bucket_bytes) +
                     " bytes); every rank must use the same settings");
  }
}

void DataParallel::broadcast_parameters() {
  for (Parameter& p : s_.parameters())
    if (p.data.defined()) comm_.broadcast(p.data.raw(), static_cast<int64_t>(p.data.nbytes()), 0);
}

void DataParallel::set_step_optimizer(Optimizer* opt) {
  GRAFT_CHECK(s_.mode() == GradMode::Step, ErrorKind::InvalidArgument,
              "set_step_optimizer is for the step mode; in other modes run the optimizer after "
              "step()");
  opt_ = opt;
}

void DataParallel::set_sync(bool sync) {
  GRAFT_CHECK(!in_step_, ErrorKind::InvalidArgument, "set_sync during a step");
  sync_ = sync;
}

char* DataParallel::slot(int b, size_t k) const {
  const Bucket& bk = buckets_[b];
  return static_cast<char*>(storage_[b].raw()) + bk.offset[k] * dtype_size(bk.dtype);
}

void DataParallel::ensure_bucket(int b) {
  // Step mode: a bucket exists from its first gradient until its update (Note [Buckets ...]).
  if (storage_[b].defined()) return;
  storage_[b] =
      Tensor::empty({buckets_[b].count}, buckets_[b].dtype, s_.allocator(), Category::Gradient);
  applied_[b] = false;
}

void DataParallel::bind_view(int i) {
  // .grad must be the bucket's view so backward writes where the all-reduce reads. One the user
  // replaced is copied in, None is zeroed, and .grad is rebound.
  Parameter& p = s_.parameters()[i];
  Tensor& v = views_[i];
  if (p.grad.defined() && p.grad.storage() == v.storage()) return;
  if (p.grad.defined()) {
    GRAFT_CHECK(p.grad.dtype() == v.dtype() && p.grad.numel() == v.numel(),
                ErrorKind::ShapeMismatch,
                "parameter " + describe(p) + ": its .grad is " + dtype_name(p.grad.dtype()) + " " +
                    shape_str(p.grad.shape()));
    std::memcpy(v.raw(), p.grad.raw(), v.nbytes());
  } else {
    std::memset(v.raw(), 0, v.nbytes());
  }
  p.grad = v;
}

void DataParallel::bind_grad_views() {
  for (size_t i = 0; i < bucket_of_.size(); ++i)
    if (bucket_of_[i] >= 0) bind_view(static_cast<int>(i));
}

void DataParallel::on_ready(Parameter& p) {
  if (!in_step_ || !sync_ || s_.mode() == GradMode::Step) return;  // step mode: on_step_grad
  const int i = static_cast<int>(&p - s_.parameters().data());
  const int b = bucket_of_[i];
  if (b < 0 || ready_[i]) return;
  bind_view(i);  // replaced during backward (a hook of the caller's): copied into the bucket
  ready_[i] = true;
  if (--pending_[b] == 0 && o_.overlap) launch(b);
}

void DataParallel::on_step_grad(Parameter& p, const Tensor& grad) {
  const int i = static_cast<int>(&p - s_.parameters().data());
  if (s_.mode() == GradMode::Hook) {
    // What AccumulateGrad does, into the bucket's view (bound before the step).
    bind_view(i);
    add_inplace(p.grad, grad);
    return;  // on_ready (called next by the session) counts it
  }
  // Step mode, synchronized step: keep the gradient in its bucket until the bucket is averaged.
  const int b = bucket_of_[i];
  if (b < 0 || !in_step_) return;
  ensure_bucket(b);
  std::memcpy(slot(b, slot_of_[i]), grad.raw(), grad.nbytes());
  ready_[i] = true;
  if (--pending_[b] == 0 && o_.overlap) launch(b);
  apply_finished_updates(false);
}

void DataParallel::launch(int b) {
  // In order: a bucket is started only after every bucket before it (Note [Buckets ...]).
  (void)b;
  while (next_launch_ < static_cast<int>(buckets_.size()) && pending_[next_launch_] == 0) {
    const int k = next_launch_++;
    const Bucket& bk = buckets_[k];
    if (shard_opt_)
      work_[k] = comm_.reduce_scatter_async(storage_[k].raw(), chunk_[k].raw(), counts_[k],
                                            bk.dtype, 1.0 / comm_.size());
    else
      work_[k] = comm_.allreduce_async(storage_[k].raw(), bk.count, bk.dtype, 1.0 / comm_.size());
  }
}

// Note [ZeRO-1]
// Rank r owns elements [count * r / N, count * (r + 1) / N) of every bucket. Its gradients are
// reduce-scattered into a buffer of that slice; its optimizer (of the caller's optimizer's kind and
// hyperparameters) holds one "parameter" per piece of a real parameter inside the slice (views of
// the weights and of the slice buffer), so it keeps 1/N of the state; after its update the
// parameters are all-gathered, bucket by bucket, through a flat copy. Elementwise optimizers (SGD,
// AdamW) give the same update on a slice as on the whole.
void DataParallel::shard_optimizer(const Optimizer& like) {
  GRAFT_CHECK(s_.mode() != GradMode::Step, ErrorKind::InvalidArgument,
              "the sharded optimizer (ZeRO-1) is for accumulate, hold and hook modes; step mode "
              "already keeps no gradient set");
  GRAFT_CHECK(!shard_opt_, ErrorKind::InvalidArgument, "shard_optimizer called twice");
  const int n = comm_.size(), r = comm_.rank();
  auto& ps = s_.parameters();
  size_t pieces = 0;
  for (const Bucket& bk : buckets_) pieces += bk.params.size();
  shard_params_.reserve(pieces);  // pointers into it stay valid
  std::vector<Parameter*> mine;
  chunk_.resize(buckets_.size());
  counts_.resize(buckets_.size());
  pieces_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bk = buckets_[b];
    GRAFT_CHECK(
        bk.count < INT32_MAX, ErrorKind::InvalidArgument,
        "a gradient bucket of 2^31 elements or more cannot be sharded; lower --bucket-size");
    for (int q = 0; q < n; ++q)
      counts_[b].push_back(static_cast<int>(bk.count * (q + 1) / n - bk.count * q / n));
    const int64_t lo = bk.count * r / n, hi = bk.count * (r + 1) / n;
    chunk_[b] = Tensor::zeros({std::max<int64_t>(hi - lo, 1)}, bk.dtype, s_.allocator(),
                              Category::Gradient);
    const size_t es = dtype_size(bk.dtype);
    for (size_t k = 0; k < bk.params.size(); ++k) {
      Parameter& p = ps[bk.params[k]];
      const int64_t a = std::max(lo, bk.offset[k]);
      const int64_t z = std::min(hi, bk.offset[k] + p.data.numel());
      if (a >= z) continue;
      pieces_[b].push_back({static_cast<int>(k), a, z});
      Parameter sp;
      sp.name = p.name + "[" + std::to_string(a - bk.offset[k]) + ":" +
                std::to_string(z - bk.offset[k]) + "]";
      sp.data = Tensor::external(static_cast<char*>(p.data.raw()) + (a - bk.offset[k]) * es,
                                 {z - a}, bk.dtype, p.data.storage());
      sp.grad = Tensor::external(static_cast<char*>(chunk_[b].raw()) + (a - lo) * es, {z - a},
                                 bk.dtype, chunk_[b].storage());
      shard_params_.push_back(std::move(sp));
      mine.push_back(&shard_params_.back());
    }
  }
  const OptimizerState st = like.state();
  const auto& h = st.hyper;
  if (std::string(like.kind()) == "sgd") {
    SGDOptions o;
    o.lr = h.at("lr");
    o.momentum = h.at("momentum");
    o.dampening = h.at("dampening");
    o.weight_decay = h.at("weight_decay");
    o.nesterov = h.at("nesterov") != 0;
    shard_opt_ = std::make_unique<SGD>(mine, o, &s_.allocator());
  } else if (std::string(like.kind()) == "adamw") {
    AdamWOptions o;
    o.lr = h.at("lr");
    o.beta1 = h.at("beta1");
    o.beta2 = h.at("beta2");
    o.eps = h.at("eps");
    o.weight_decay = h.at("weight_decay");
    shard_opt_ = std::make_unique<AdamW>(mine, o, &s_.allocator());
  } else {
    fail(ErrorKind::Unsupported,
         std::string("the sharded optimizer supports sgd and adamw, not ") + like.kind());
  }
  like_ = &like;
}

int64_t DataParallel::sharded_state_bytes() const {
  if (!shard_opt_) return 0;
  int64_t b = 0;
  for (const auto& per : shard_opt_->state().tensors)
    for (const auto& [name, t] : per)
      if (t.defined()) b += static_cast<int64_t>(t.nbytes());
  return b;
}

void DataParallel::sharded_update() {
  shard_opt_->set_lr(like_->lr());  // schedules set the caller's optimizer's rate
  shard_opt_->step();
  auto& ps = s_.parameters();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bk = buckets_[b];
    const size_t es = dtype_size(bk.dtype);
    Tensor flat = Tensor::empty({bk.count}, bk.dtype, s_.allocator(), Category::Workspace);
    char* f = static_cast<char*>(flat.raw());
    for (const Piece& pc : pieces_[b])  // this rank's updated slice into place
      std::memcpy(
          f + pc.a * es,
          static_cast<const char*>(ps[bk.params[pc.k]].data.raw()) + (pc.a - bk.offset[pc.k]) * es,
          (pc.z - pc.a) * es);
    comm_.allgatherv(f, counts_[b], bk.dtype);
    for (size_t k = 0; k < bk.params.size(); ++k) {
      Parameter& p = ps[bk.params[k]];
      std::memcpy(p.data.raw(), f + bk.offset[k] * es, p.data.nbytes());
    }
  }
}

void DataParallel::apply_finished_updates(bool wait_all) {
  // Step mode: the optimizer's update for every averaged bucket, in bucket order.
  auto& ps = s_.parameters();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (applied_[b]) continue;
    if (!work_[b]) {
      if (wait_all) continue;  // never started: the bucket received nothing
      return;
    }
    if (!wait_all && !work_[b]->done()) return;
    work_[b]->wait();
    const Bucket& bk = buckets_[b];
    for (size_t k = 0; k < bk.params.size(); ++k) {
      Parameter& p = ps[bk.params[k]];
      if (!opt_) continue;
      const int oi = opt_->index_of(p);
      if (oi < 0) continue;
      Tensor g = Tensor::external(slot(static_cast<int>(b), k), p.data.shape(), bk.dtype,
                                  storage_[b].storage());
      opt_->update(static_cast<size_t>(oi), g);
    }
    applied_[b] = true;
    storage_[b] = Tensor();  // freed: step mode keeps no gradient set
  }
}

double DataParallel::step() {
  const bool step_mode = s_.mode() == GradMode::Step;
  GRAFT_CHECK(!step_mode || opt_, ErrorKind::InvalidArgument,
              "data parallelism in step mode: call set_step_optimizer(&optimizer) first");
  if (!sync_) {
    // Micro-batch: local accumulation only (step mode defers its update).
    if (step_mode) s_.set_defer_step(true);
    if (!step_mode) bind_grad_views();
    double loss = s_.step();
    if (step_mode) s_.set_defer_step(false);
    return loss;
  }
  if (!step_mode) bind_grad_views();
  std::fill(ready_.begin(), ready_.end(), false);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<int>(buckets_[b].params.size());
    work_[b].reset();
  }
  next_launch_ = 0;
  if (step_mode) opt_->begin_step();
  in_step_ = true;
  const double t0 = comm_.now();
  double loss = 0;
  try {
    loss = s_.step();
  } catch (...) {
    in_step_ = false;
    throw;  // an error mid-backward leaves collectives unmatched: the caller aborts the job
  }
  const double t_bwd = comm_.now();
  in_step_ = false;
  // A parameter that received no gradient this step (a branch not taken) still takes part, with
  // zeros, so that every rank runs every bucket's all-reduce.
  for (size_t i = 0; i < ready_.size(); ++i) {
    const int b = bucket_of_[i];
    if (b < 0 || ready_[i]) continue;
    if (step_mode) {
      ensure_bucket(b);
      std::memset(slot(b, slot_of_[i]), 0, s_.parameters()[i].data.nbytes());
    } else {
      bind_view(static_cast<int>(i));
    }
    ready_[i] = true;
    --pending_[b];
  }
  launch(0);  // without overlap, everything starts now; with it, whatever was left
  if (step_mode)
    apply_finished_updates(true);
  else
    wait_all();
  const double t_end = comm_.now();
  if (shard_opt_) sharded_update();
  stats_ = DataParallelStats{};
  stats_.buckets = static_cast<int>(buckets_.size());
  stats_.backward_seconds = t_bwd - t0;
  stats_.exposed_seconds = t_end - t_bwd;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    stats_.bytes += buckets_[b].count * static_cast<int64_t>(dtype_size(buckets_[b].dtype));
    if (work_[b]) stats_.comm_seconds += work_[b]->ended() - work_[b]->started();
  }
  return loss;
}

void DataParallel::wait_all() {
  for (auto& w : work_)
    if (w) w->wait();
}

}  // namespace graft
