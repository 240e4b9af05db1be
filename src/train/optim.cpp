// Optimizers, updating parameters in place with PyTorch 1.13's formulas (torch.optim.SGD and
// torch.optim.AdamW, single-tensor path), so graft and eager PyTorch stay in step; and their
// state as plain data (OptimizerState), which checkpoints save and load.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "graft/ops.h"
#include "graft/train.h"
#include "state_file.h"

namespace graft {

namespace {
// f(begin, end) over [0, n) on the op families' threads: an update is a flat loop over
// independent elements, memory-bound, and one core leaves half the bandwidth unused.
template <class F>
void for_ranges(int64_t n, int64_t work_per_item, F&& f) {
  parallel_ranges(
      n, work_per_item, [](void* c, int64_t b, int64_t e) { (*static_cast<F*>(c))(b, e); }, &f);
}

// f.template operator()<T>() with T the C++ type of `dt` (float32 or float64).
template <class F>
void by_dtype(DType dt, F&& f) {
  if (dt == DType::F32)
    f.template operator()<float>();
  else if (dt == DType::F64)
    f.template operator()<double>();
  else
    fail(ErrorKind::InvalidArgument, "optimizers update float parameters only");
}

// AdamW's update of n elements (PyTorch 1.13's single-tensor formula, in T). Note [AdamW's
// vector update]: the loop has a square root and two divisions per element; built for baseline
// x86-64 without -fno-math-errno it ran scalar, at a third of the memory's speed (ViT-B/16's 86M
// parameters took ~0.1 s per step). The float32 copy is an ISA clone (Note [ISA clones],
// graft/parallel.h) and optim.cpp is built with -ffp-contract=off and -fno-math-errno: square
// roots and divisions are correctly rounded in every vector width and no multiply-add is fused,
// so each copy gives the scalar loop's bits.
template <class T>
struct AdamWTerms {
  T decay, b1, b2, c1, c2, step_size, sqrt_bc2, eps;
};
template <class T>
GRAFT_INLINE void adamw_loop(const AdamWTerms<T>& c, T* __restrict w, const T* __restrict g,
                             T* __restrict m, T* __restrict v, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const T wk = w[k] * c.decay;
    const T mk = m[k] * c.b1 + g[k] * c.c1;
    const T vk = v[k] * c.b2 + g[k] * g[k] * c.c2;
    const T denom = std::sqrt(vk) / c.sqrt_bc2 + c.eps;
    m[k] = mk;
    v[k] = vk;
    w[k] = wk - c.step_size * (mk / denom);
  }
}
GRAFT_ISA_CLONES void adamw_range_f32(const AdamWTerms<float>& c, float* w, const float* g,
                                      float* m, float* v, int64_t n) {
  adamw_loop(c, w, g, m, v, n);
}
template <class T>
void adamw_range(const AdamWTerms<T>& c, T* w, const T* g, T* m, T* v, int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    adamw_range_f32(c, w, g, m, v, n);
  else
    adamw_loop(c, w, g, m, v, n);
}

}  // namespace

void adamw_apply(DType dtype, void* w, const void* g, void* m, void* v, int64_t n, int64_t step,
                 const AdamWOptions& o) {
  by_dtype(dtype, [&]<class T>() {
    const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(step));
    AdamWTerms<T> c;
    c.decay = static_cast<T>(1 - o.lr * o.weight_decay);
    c.b1 = static_cast<T>(o.beta1), c.b2 = static_cast<T>(o.beta2);
    c.c1 = static_cast<T>(1 - o.beta1), c.c2 = static_cast<T>(1 - o.beta2);
    c.step_size = static_cast<T>(o.lr / bc1);
    c.sqrt_bc2 = static_cast<T>(std::sqrt(bc2));
    c.eps = static_cast<T>(o.eps);
    T* wt = static_cast<T*>(w);
    const T* gt = static_cast<const T*>(g);
    T *mt = static_cast<T*>(m), *vt = static_cast<T*>(v);
    for_ranges(n, 12, [&](int64_t k0, int64_t k1) {
      adamw_range(c, wt + k0, gt + k0, mt + k0, vt + k0, k1 - k0);
    });
  });
}

namespace {
// Each kind's hyperparameters are declared once, here: each_hyper names every field of the options
// (the table behind OptimizerKind::hyper, state() and load_state()), invalid() says what is out of
// range (the constructors and checkpoint verification).
template <class F>
void each_hyper(SGDOptions& o, F&& f) {
  f("lr", o.lr);
  f("momentum", o.momentum);
  f("dampening", o.dampening);
  f("weight_decay", o.weight_decay);
  f("nesterov", o.nesterov);
}
template <class F>
void each_hyper(AdamWOptions& o, F&& f) {
  f("lr", o.lr);
  f("beta1", o.beta1);
  f("beta2", o.beta2);
  f("eps", o.eps);
  f("weight_decay", o.weight_decay);
}
std::string invalid(const SGDOptions& o) {
  if (!std::isfinite(o.lr) || !std::isfinite(o.momentum) || !std::isfinite(o.dampening) ||
      !std::isfinite(o.weight_decay))
    return "hyperparameters must be finite";
  if (o.lr < 0 || o.momentum < 0 || o.weight_decay < 0)
    return "lr, momentum and weight_decay must be >= 0";
  if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
    return "nesterov needs momentum > 0 and dampening = 0";
  return "";
}
std::string invalid(const AdamWOptions& o) {
  if (!std::isfinite(o.lr) || !std::isfinite(o.eps) || !std::isfinite(o.weight_decay))
    return "lr, eps and weight_decay must be finite";
  if (!(o.lr >= 0 && o.eps >= 0 && o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1))
    return "need lr >= 0, eps >= 0, 0 <= betas < 1";
  return "";
}
}  // namespace

Optimizer::Optimizer(std::vector<Parameter*> params, Allocator* alloc)
    : params_(std::move(params)), alloc_(alloc ? alloc : &Allocator::global()) {}
Optimizer::~Optimizer() = default;

void Optimizer::set_state_file(const StateFileOptions&) {
  fail(ErrorKind::Unsupported, std::string("a state file is not supported for the ") + kind() +
                                   " optimizer (AdamW has one)");
}
void Optimizer::began_step() {
  if (file_) file_->begin_step();
}
StateFileStats Optimizer::state_file_stats() const {
  StateFileStats s;
  if (!file_) return s;
  file_->flush();  // the counts of a step include its writes behind
  s.path = file_->path();
  s.direct_io = file_->direct();
  s.file_bytes = file_->file_bytes();
  s.window_bytes = file_->window();
  s.bytes_read = file_->bytes_read();
  s.bytes_written = file_->bytes_written();
  s.prefetch_hits = file_->prefetch_hits();
  return s;
}

void Optimizer::read_file_state(size_t i, void* dst) const {
  GRAFT_CHECK(file_ && i < params_.size(), ErrorKind::InvalidArgument,
              "read_file_state: no state file, or no parameter " + std::to_string(i));
  file_->read(i, dst);
}
void Optimizer::write_file_state(size_t i, const void* src) {
  GRAFT_CHECK(file_ && i < params_.size(), ErrorKind::InvalidArgument,
              "write_file_state: no state file, or no parameter " + std::to_string(i));
  file_->write(i, src);
}

std::pair<int64_t, int64_t> Optimizer::file_state_offset(size_t i) const {
  GRAFT_CHECK(file_ && i < params_.size(), ErrorKind::InvalidArgument,
              "file_state_offset: no state file, or no parameter " + std::to_string(i));
  return {file_->offset(i), file_->moment_stride(i)};
}

void Optimizer::zero_grad(bool set_to_none) {
  for (Parameter* p : params_) {
    if (set_to_none)
      p->grad = Tensor();
    else if (p->grad.defined()) {
      auto* lines = static_cast<char*>(p->grad.raw());  // in 64-byte lines, the tail last
      const int64_t n = static_cast<int64_t>(p->grad.nbytes());
      for_ranges((n + 63) / 64, 16, [&](int64_t b, int64_t e) {
        std::memset(lines + 64 * b, 0, static_cast<size_t>(std::min(n, 64 * e) - 64 * b));
      });
    }
  }
}

SGD::SGD(std::vector<Parameter*> params, SGDOptions o, Allocator* alloc)
    : Optimizer(std::move(params), alloc), options(o) {
  const std::string why = invalid(o);
  GRAFT_CHECK(why.empty(), ErrorKind::InvalidArgument, "SGD: " + why);
  buf_.resize(params_.size());
}

void Optimizer::step() {
  begin_step();
  for (size_t i = 0; i < params_.size();
       ++i)  // like PyTorch: a parameter with grad None is skipped
    if (params_[i]->grad.defined()) update(i, params_[i]->grad);
}

int Optimizer::index_of(const Parameter& p) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i] == &p) return static_cast<int>(i);
  return -1;
}

void SGD::update(size_t i, const Tensor& grad) {
  {
    Parameter& p = *params_[i];
    GRAFT_CHECK(grad.dtype() == p.data.dtype() && grad.numel() == p.data.numel(),
                ErrorKind::ShapeMismatch,
                "SGD: the gradient of '" + p.name + "' has the wrong size");
    by_dtype(p.data.dtype(), [&]<class T>() {
      T* w = p.data.data<T>();
      const T* g = grad.data<T>();
      const int64_t n = p.data.numel();
      const T lr = static_cast<T>(options.lr), wd = static_cast<T>(options.weight_decay),
              mom = static_cast<T>(options.momentum), damp = static_cast<T>(1 - options.dampening);
      if (options.momentum == 0) {
        for_ranges(n, 2, [&](int64_t k0, int64_t k1) {
          if (wd != T(0))
            for (int64_t k = k0; k < k1; ++k) w[k] -= lr * (g[k] + wd * w[k]);
          else
            for (int64_t k = k0; k < k1; ++k) w[k] -= lr * g[k];
        });
        return;
      }
      bool fresh = !buf_[i].defined();
      if (fresh)
        buf_[i] = Tensor::empty(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState,
                                p.name + ".momentum");
      T* b = buf_[i].data<T>();
      const bool nesterov = options.nesterov;
      for_ranges(n, 6, [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k) {
          T d = wd != T(0) ? g[k] + wd * w[k] : g[k];
          b[k] = fresh ? d : mom * b[k] + damp * d;
          d = nesterov ? d + mom * b[k] : b[k];
          w[k] -= lr * d;
        }
      });
    });
  }
}

AdamW::AdamW(std::vector<Parameter*> params, AdamWOptions o, Allocator* alloc)
    : Optimizer(std::move(params), alloc), options(o) {
  const std::string why = invalid(o);
  GRAFT_CHECK(why.empty(), ErrorKind::InvalidArgument, "AdamW: " + why);
  m_.resize(params_.size());
  v_.resize(params_.size());
  steps_.assign(params_.size(), 0);
}

void AdamW::update(size_t i, const Tensor& grad) {
  {
    Parameter& p = *params_[i];
    GRAFT_CHECK(grad.dtype() == p.data.dtype() && grad.numel() == p.data.numel(),
                ErrorKind::ShapeMismatch,
                "AdamW: the gradient of '" + p.name + "' has the wrong size");
    if (!file_ && !m_[i].defined()) {
      m_[i] = Tensor::zeros(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState,
                            p.name + ".exp_avg");
      v_[i] = Tensor::zeros(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState,
                            p.name + ".exp_avg_sq");
    }
    const int64_t step = ++steps_[i];
    const DType dt = p.data.dtype();
    void* w = p.data.raw();
    const void* g = grad.raw();
    if (!file_) {
      adamw_apply(dt, w, g, m_[i].raw(), v_[i].raw(), p.data.numel(), step, options);
      return;
    }
    by_dtype(p.data.dtype(), [&]<class T>() {
      // The state file streams the state in units (at most 32 MiB of each moment): the same
      // elementwise update, a unit at a time.
      const size_t u0 = file_->first_unit(i), u1 = u0 + file_->num_units(i);
      for (size_t u = u0; u < u1; ++u) {
        char* st = file_->acquire(u);
        const int64_t e0 = file_->unit_begin(u) / static_cast<int64_t>(sizeof(T));
        const int64_t n = file_->unit_bytes(u) / static_cast<int64_t>(sizeof(T));
        adamw_apply(dt, static_cast<T*>(w) + e0, static_cast<const T*>(g) + e0, st,
                    st + file_->unit_stride(u), n, step, options);
        file_->release(u);
      }
    });
  }
}

void AdamW::set_state_file(const StateFileOptions& o) {
  for (size_t i = 0; i < params_.size(); ++i)
    GRAFT_CHECK(!m_[i].defined() && steps_[i] == 0, ErrorKind::InvalidArgument,
                "AdamW: set_state_file before the first step ('" + params_[i]->name +
                    "' already has state)");
  std::vector<int64_t> sizes;
  for (const Parameter* p : params_) sizes.push_back(static_cast<int64_t>(p->data.nbytes()));
  file_ = std::make_unique<StateFile>(o, std::move(sizes), 2, *alloc_);
}

// --- state as plain data -------------------------------------------------------------------------
namespace {
std::string sgd_check_tensors(const std::vector<std::string>& names, int64_t) {
  return names.size() > 1 ? "more than one momentum_buffer" : "";
}
std::string adamw_check_tensors(const std::vector<std::string>& names, int64_t step) {
  const bool full = names.size() == 2 && names[0] == "exp_avg" && names[1] == "exp_avg_sq";
  return (step > 0 ? full : names.empty())
             ? ""
             : "AdamW state needs exp_avg and exp_avg_sq exactly when its step is > 0";
}

// A kind's hyperparameters as a name -> value map (flags 0 or 1), and back.
template <class O>
std::map<std::string, double> to_map(const O& o) {
  std::map<std::string, double> m;
  O copy = o;
  each_hyper(copy, [&](const char* name, auto& field) { m[name] = static_cast<double>(field); });
  return m;
}
template <class O>
O from_map(const std::map<std::string, double>& m) {
  O o;
  each_hyper(o, [&](const char* name, auto& field) {
    using F = std::remove_reference_t<decltype(field)>;
    if constexpr (std::is_same_v<F, bool>)
      field = m.at(name) != 0;
    else
      field = m.at(name);
  });
  return o;
}
template <class O>
bool hyper_valid(const std::map<std::string, double>& m) {
  return invalid(from_map<O>(m)).empty();
}
template <class O>
OptimizerKind make_kind(const char* name, std::vector<std::string> tensors,
                        std::string (*check)(const std::vector<std::string>&, int64_t)) {
  OptimizerKind k{name, {}, std::move(tensors), hyper_valid<O>, check};
  O o;
  each_hyper(o, [&](const char* n, auto& field) {
    k.hyper.emplace_back(n, std::is_same_v<std::remove_reference_t<decltype(field)>, bool>);
  });
  return k;
}
const OptimizerKind kSGD = make_kind<SGDOptions>("sgd", {"momentum_buffer"}, sgd_check_tensors);
const OptimizerKind kAdamW =
    make_kind<AdamWOptions>("adamw", {"exp_avg", "exp_avg_sq"}, adamw_check_tensors);

// The defined tensor named `name` of one parameter's state, or an undefined one.
Tensor slot(const std::map<std::string, Tensor>& m, const std::string& name) {
  auto it = m.find(name);
  return it == m.end() ? Tensor() : it->second;
}
}  // namespace

const OptimizerKind* find_optimizer_kind(const std::string& name) {
  if (name == kSGD.name) return &kSGD;
  if (name == kAdamW.name) return &kAdamW;
  return nullptr;
}

void Optimizer::check_state(const OptimizerState& st) const {
  const std::string k = kind();
  const OptimizerKind* kd = find_optimizer_kind(k);
  GRAFT_CHECK(kd, ErrorKind::InvalidArgument,
              "optimizer state: unsupported optimizer kind '" + k + "'");
  const std::string pre = k + " state: ";
  for (const auto& [name, flag] : kd->hyper) {
    auto it = st.hyper.find(name);
    GRAFT_CHECK(it != st.hyper.end(), ErrorKind::InvalidArgument,
                pre + "hyperparameter '" + name + "' is missing");
    GRAFT_CHECK(!flag || it->second == 0 || it->second == 1, ErrorKind::InvalidArgument,
                pre + "hyperparameter '" + name + "' is a flag (0 or 1)");
  }
  GRAFT_CHECK(kd->hyper_valid(st.hyper), ErrorKind::InvalidArgument,
              pre + "hyperparameters out of range");
  GRAFT_CHECK(st.steps >= 0, ErrorKind::InvalidArgument, pre + "negative step count");
  GRAFT_CHECK(st.tensors.size() == params_.size() && st.counters.size() == params_.size(),
              ErrorKind::InvalidArgument,
              pre + "it has " + std::to_string(st.tensors.size()) + " tensor entries and " +
                  std::to_string(st.counters.size()) + " counters, the optimizer updates " +
                  std::to_string(params_.size()) + " parameters");
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = *params_[i];
    std::vector<std::string> names;
    for (const auto& [name, t] : st.tensors[i]) {
      GRAFT_CHECK(std::find(kd->tensors.begin(), kd->tensors.end(), name) != kd->tensors.end(),
                  ErrorKind::InvalidArgument,
                  pre + "unknown tensor '" + name + "' for '" + p.name + "'");
      if (!t.defined()) continue;
      GRAFT_CHECK(t.dtype() == p.data.dtype() && t.shape() == p.data.shape(),
                  ErrorKind::ShapeMismatch,
                  pre + name + " of '" + p.name + "' is " + dtype_name(t.dtype()) + " " +
                      shape_str(t.shape()) + ", the parameter " + dtype_name(p.data.dtype()) + " " +
                      shape_str(p.data.shape()));
    }
    if (st.tensors_in_file && file_ && st.tensors[i].empty() && st.counters[i] > 0)
      names = kd->tensors;  // in the state file already
    else
      for (const std::string& name : kd->tensors)
        if (slot(st.tensors[i], name).defined()) names.push_back(name);
    GRAFT_CHECK(st.counters[i] >= 0, ErrorKind::InvalidArgument,
                pre + "negative counter for '" + p.name + "'");
    const std::string why = kd->check_tensors(names, st.counters[i]);
    GRAFT_CHECK(why.empty(), ErrorKind::InvalidArgument, pre + "'" + p.name + "': " + why);
  }
}

OptimizerState SGD::state() const {
  OptimizerState st;
  st.hyper = to_map(options);
  st.steps = steps();
  st.tensors.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    if (buf_[i].defined()) st.tensors[i]["momentum_buffer"] = buf_[i];
  st.counters.assign(params_.size(), 0);
  return st;
}

void SGD::load_state(const OptimizerState& st) {
  check_state(st);
  options = from_map<SGDOptions>(st.hyper);
  for (size_t i = 0; i < params_.size(); ++i) buf_[i] = slot(st.tensors[i], "momentum_buffer");
  load_steps(st.steps);
}

OptimizerState AdamW::state_in_ram() const {
  OptimizerState st;
  st.hyper = to_map(options);
  st.steps = steps();
  st.tensors.resize(params_.size());
  st.tensors_in_file = file_ != nullptr;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (m_[i].defined()) st.tensors[i]["exp_avg"] = m_[i];
    if (v_[i].defined()) st.tensors[i]["exp_avg_sq"] = v_[i];
  }
  st.counters = steps_;
  return st;
}

OptimizerState AdamW::state() const {
  OptimizerState st = state_in_ram();
  st.tensors_in_file = false;
  if (!file_) return st;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (steps_[i] == 0) continue;  // read from the file (this much RAM, for a checkpoint)
    const Parameter& p = *params_[i];
    Tensor m = Tensor::empty(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState,
                             p.name + ".exp_avg");
    Tensor v = Tensor::empty(p.data.shape(), p.data.dtype(), *alloc_, Category::OptimizerState,
                             p.name + ".exp_avg_sq");
    std::vector<char> both(2 * p.data.nbytes());
    file_->read(i, both.data());
    std::memcpy(m.raw(), both.data(), p.data.nbytes());
    std::memcpy(v.raw(), both.data() + p.data.nbytes(), p.data.nbytes());
    st.tensors[i]["exp_avg"] = m;
    st.tensors[i]["exp_avg_sq"] = v;
  }
  return st;
}

void AdamW::load_state(const OptimizerState& st) {
  check_state(st);
  options = from_map<AdamWOptions>(st.hyper);
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i] = slot(st.tensors[i], "exp_avg");
    v_[i] = slot(st.tensors[i], "exp_avg_sq");
    if (!file_) continue;
    if (m_[i].defined()) {  // into the file; RAM keeps none of it
      const size_t b = params_[i]->data.nbytes();
      std::vector<char> both(2 * b);
      std::memcpy(both.data(), m_[i].raw(), b);
      std::memcpy(both.data() + b, v_[i].raw(), b);
      file_->write(i, both.data());
      m_[i] = v_[i] = Tensor();
    } else if (!(st.tensors_in_file && st.counters[i] > 0)) {
      file_->forget(i);  // none yet: what the file held before must not be read
    }
  }
  steps_ = st.counters;
  load_steps(st.steps);
}

double lr_schedule_factor(const std::string& schedule, int64_t done, int64_t total,
                          int64_t warmup) {
  GRAFT_CHECK(total >= 0 && warmup >= 0 && done >= 0, ErrorKind::InvalidArgument,
              "learning-rate schedule: steps must be >= 0");
  const bool known = schedule == "constant" || schedule == "linear" || schedule == "cosine";
  GRAFT_CHECK(known, ErrorKind::InvalidArgument,
              "unknown learning-rate schedule '" + schedule + "' (use constant, linear or cosine)");
  if (done < warmup)
    return static_cast<double>(done) / static_cast<double>(std::max<int64_t>(1, warmup));
  if (schedule == "constant") return 1;
  const double progress = static_cast<double>(done - warmup) /
                          static_cast<double>(std::max<int64_t>(1, total - warmup));
  if (schedule == "linear")
    return std::max(0.0, static_cast<double>(total - done) /
                             static_cast<double>(std::max<int64_t>(1, total - warmup)));
  return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace graft
