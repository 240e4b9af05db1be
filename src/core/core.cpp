// Errors, dtypes, the tracking allocator and Tensor (see include/graft/core.h).
#include "graft/core.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

namespace graft {

const char* error_kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::InvalidModel:
      return "invalid model";
    case ErrorKind::Unsupported:
      return "unsupported";
    case ErrorKind::ShapeMismatch:
      return "shape mismatch";
    case ErrorKind::InvalidArgument:
      return "invalid argument";
    case ErrorKind::OutOfMemory:
      return "out of memory";
    case ErrorKind::Io:
      return "i/o error";
    case ErrorKind::NonFinite:
      return "non-finite value";
    case ErrorKind::Communication:
      return "communication error";
    case ErrorKind::Internal:
      return "internal error";
  }
  return "error";
}

namespace {
// Names in messages come from untrusted files: escape control and non-ASCII bytes so a message is
// always one printable line (no terminal escapes, no broken UTF-8).
std::string printable(const std::string& m) {
  std::string r;
  r.reserve(m.size());
  for (unsigned char c : m) {
    if (c >= 0x20 && c < 0x7f) {
      r += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      r += "\\x";
      r += hex[c >> 4];
      r += hex[c & 15];
    }
  }
  return r;
}
}  // namespace

Error::Error(ErrorKind kind, const std::string& msg, const std::string& node)
    : std::runtime_error(std::string(error_kind_name(kind)) + ": " + printable(msg)),
      kind_(kind),
      node_(printable(node)),
      message_(printable(msg)) {}

void fail(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }
void fail_at(ErrorKind kind, const std::string& node, const std::string& msg) {
  throw Error(kind, msg, node);
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F64:
      return 8;
    case DType::I64:
      return 8;
    case DType::Bool:
      return 1;
    case DType::I32:
      return 4;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::I64:
      return "int64";
    case DType::Bool:
      return "bool";
    case DType::I32:
      return "int32";
  }
  return "?";
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    GRAFT_CHECK(d >= 0, ErrorKind::InvalidModel, "negative dimension in shape " + shape_str(s));
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d)
      fail(ErrorKind::InvalidModel,
           "shape " + shape_str(s) + " has more elements than int64 holds");
    n *= d;
  }
  return n;
}

int64_t numel(const Shape& s, const std::string& what) {
  try {
    return numel(s);
  } catch (const Error& e) {
    throw Error(e.kind(), what + ": " +
                              std::string(e.what()).substr(
                                  std::string(error_kind_name(e.kind())).size() + 2));
  }
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

const char* category_name(Category c) {
  switch (c) {
    case Category::Parameter:
      return "parameter";
    case Category::Gradient:
      return "gradient";
    case Category::Activation:
      return "activation";
    case Category::OptimizerState:
      return "optimizer_state";
    case Category::Workspace:
      return "workspace";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
Storage::~Storage() {
  if (owner) owner->release(*this);
}

namespace {
size_t default_reuse_min();
}  // namespace

Allocator::Allocator() : reuse_min_(default_reuse_min()) {}

Allocator::~Allocator() { drop_kept(0); }

Allocator& Allocator::global() {
  static Allocator a;
  return a;
}

std::shared_ptr<Storage> Allocator::allocate(size_t bytes, Category c, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (limit_ > 0 && current_ + static_cast<int64_t>(bytes) > limit_)
    fail(ErrorKind::OutOfMemory, "allocating " + std::to_string(bytes) + " bytes" +
                                     (what.empty() ? "" : " for '" + what + "'") +
                                     " would exceed the memory limit of " + std::to_string(limit_) +
                                     " bytes (" + std::to_string(current_) + " in use)");
  auto s = std::make_shared<Storage>();
  if (reuse_depth_ > 0 && bytes >= reuse_min_) {
    for (size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i].first == bytes) {
        s->data = kept_[i].second;
        kept_[i] = kept_.back();
        kept_.pop_back();
        kept_bytes_ -= static_cast<int64_t>(bytes);
        ++n_reused_;
        break;
      }
  }
  if (!s->data && kept_bytes_ > 0) {
    // A new block: what is kept shrinks so that live + kept stays within the live peak.
    const int64_t live = current_ + static_cast<int64_t>(bytes);
    drop_kept(live >= reuse_high_ ? 0 : reuse_high_ - live);
  }
  // Exactly `bytes`, 64-byte aligned: no padding, so AddressSanitizer sees a read one past the end.
  if (!s->data) s->data = ::operator new(bytes, std::align_val_t(64), std::nothrow);
  if (!s->data && kept_bytes_ > 0) {  // the system is short: give back every kept block first
    drop_kept(0);
    s->data = ::operator new(bytes, std::align_val_t(64), std::nothrow);
  }
  if (!s->data)
    fail(ErrorKind::OutOfMemory, "the system refused " + std::to_string(bytes) + " bytes" +
                                     (what.empty() ? "" : " for '" + what + "'"));
  s->bytes = bytes;
  s->category = c;
  s->owner = this;
  current_ += static_cast<int64_t>(bytes);
  by_cat_[static_cast<int>(c)] += static_cast<int64_t>(bytes);
  ++n_allocs_;
  reuse_high_ = std::max(reuse_high_, current_);
  if (current_ > peak_) {
    peak_ = current_;
    at_peak_ = by_cat_;
  }
  record();
  return s;
}

void Allocator::release(Storage& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (reuse_depth_ > 0 && s.bytes >= reuse_min_ && kept_.size() < 256) {
    kept_.emplace_back(s.bytes, s.data);  // live + kept is unchanged: the invariant holds
    kept_bytes_ += static_cast<int64_t>(s.bytes);
  } else {
    ::operator delete(s.data, std::align_val_t(64));
  }
  current_ -= static_cast<int64_t>(s.bytes);
  by_cat_[static_cast<int>(s.category)] -= static_cast<int64_t>(s.bytes);
  s.data = nullptr;
  record();
}

// Note [block reuse within a run]
// A run frees most of what it allocates, and much of it has the size of something allocated
// later in the same run: a layer's activation gradient, the next layer's; a weight gradient
// delivered to PyTorch, the next layer's. Returning each block to malloc and asking again costs
// page faults whenever malloc maps the block afresh or has trimmed the top of its heap in between
// (docs/performance.md, "Page faults"). So while an executor run is going (a ReuseScope), a freed
// block of at least reuse_min_bytes() is kept and the next allocation of exactly its size takes it.
// reuse_min_bytes() is MALLOC_MMAP_THRESHOLD_ where that is set (glibc then maps every block from
// there up), else 64 KiB, the benchmarks' memory policy, so graft keeps the same blocks under
// either policy. (The default was 32 MiB, glibc's ceiling for its adaptive mmap threshold, on the
// reasoning that blocks from malloc's heap are malloc's to reuse. Under glibc's default policy
// that left ResNet-18's hook step faulting thousands of pages a step: its weight gradients went
// back to a heap glibc trimmed, or to mappings below the adapted threshold. Keeping them made the
// step faster with memory unchanged; the numbers: docs/performance.md, "Page faults".)
// The memory promise does not move: kept + live never exceeds the highest live byte count since
// the outermost scope began (a free keeps the sum; an allocation that would push it over first
// frees kept blocks: the smallest that suffices, else the largest), so the process holds no byte
// more than the run's own live peak, and when the outermost scope ends every kept block goes
// back. Live bytes, the peak, the categories and the limit count live blocks only, as before.
// Exact sizes only, so a reused block is as large as a fresh one; off under AddressSanitizer (a
// reused block would hide a use after free) and with GRAFT_BLOCK_REUSE=0.
namespace {
size_t default_reuse_min() {
  static const size_t n = [] {
    size_t bytes = size_t{64} << 10;
    if (const char* e = std::getenv("MALLOC_MMAP_THRESHOLD_")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(e, &end, 10);
      if (end != e && *end == '\0' && v > 0) bytes = static_cast<size_t>(v);
    }
    return std::max<size_t>(bytes, 32 << 10);
  }();
  return n;
}

bool block_reuse_enabled() {
#if defined(__SANITIZE_ADDRESS__)
  return false;
#else
  static const bool on = [] {
    const char* e = std::getenv("GRAFT_BLOCK_REUSE");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
#endif
}
}  // namespace

Allocator::ReuseScope::ReuseScope(Allocator& a) : a_(a) {
  if (!block_reuse_enabled()) return;
  std::lock_guard<std::mutex> lock(a_.mu_);
  if (a_.reuse_depth_++ == 0) a_.reuse_high_ = a_.current_;
}

Allocator::ReuseScope::~ReuseScope() {
  if (!block_reuse_enabled()) return;
  std::lock_guard<std::mutex> lock(a_.mu_);
  if (--a_.reuse_depth_ == 0) a_.drop_kept(0);
}

void Allocator::drop_kept(int64_t down_to) {  // mu_ held
  // The smallest block that alone brings kept down far enough goes; failing one, the largest,
  // and again: a 1 KiB allocation should not cost a 256 KiB block that a later one would take.
  while (kept_bytes_ > down_to && !kept_.empty()) {
    const int64_t need = kept_bytes_ - down_to;
    size_t pick = 0;
    for (size_t i = 1; i < kept_.size(); ++i) {
      const int64_t a = static_cast<int64_t>(kept_[i].first),
                    b = static_cast<int64_t>(kept_[pick].first);
      if (b >= need ? (a >= need && a < b) : a > b) pick = i;
    }
    ::operator delete(kept_[pick].second, std::align_val_t(64));
    kept_bytes_ -= static_cast<int64_t>(kept_[pick].first);
    kept_[pick] = kept_.back();
    kept_.pop_back();
  }
}

void Allocator::recategorize(Storage& s, Category c) {
  if (s.owner != this) return;
  std::lock_guard<std::mutex> lock(mu_);
  by_cat_[static_cast<int>(s.category)] -= static_cast<int64_t>(s.bytes);
  by_cat_[static_cast<int>(c)] += static_cast<int64_t>(s.bytes);
  s.category = c;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = current_;
  at_peak_ = by_cat_;
}

void Allocator::record() {
  if (timeline_on_) timeline_.push_back({step_, current_, by_cat_});
}

namespace {
int64_t read_int_file(const char* path) {
  std::FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  char buf[64] = {0};
  bool ok = std::fgets(buf, sizeof buf, f) != nullptr;
  std::fclose(f);
  if (!ok || buf[0] < '0' || buf[0] > '9') return -1;  // "max" or garbage: no limit
  return std::strtoll(buf, nullptr, 10);
}
int64_t meminfo_available() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return -1;
  char line[256];
  int64_t kb = -1;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "MemAvailable:", 13) == 0) kb = std::strtoll(line + 13, nullptr, 10);
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}
}  // namespace

int64_t available_memory_bytes() {
  int64_t avail = meminfo_available();
  auto room = [&](const char* limit_file, const char* usage_file) {
    int64_t limit = read_int_file(limit_file), used = read_int_file(usage_file);
    if (limit <= 0 || used < 0 || limit >= (int64_t(1) << 60)) return;
    int64_t left = std::max<int64_t>(0, limit - used);
    avail = avail < 0 ? left : std::min(avail, left);
  };
  room("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current");  // cgroup v2
  room("/sys/fs/cgroup/memory/memory.limit_in_bytes",
       "/sys/fs/cgroup/memory/memory.usage_in_bytes");  // v1
  return avail;
}

// ---------------------------------------------------------------------------------------------
Tensor Tensor::empty(const Shape& shape, DType dt, Allocator& a, Category c,
                     const std::string& what) {
  Tensor t;
  t.dtype_ = dt;
  t.shape_ = shape;
  t.numel_ = graft::numel(shape);
  if (t.numel_ > std::numeric_limits<int64_t>::max() / 8)
    fail(ErrorKind::OutOfMemory,
         "tensor " + what + " of shape " + shape_str(shape) + " is too large to allocate");
  t.storage_ = a.allocate(t.nbytes(), c, what);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dt, Allocator& a, Category c,
                     const std::string& what) {
  Tensor t = empty(shape, dt, a, c, what);
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

Tensor Tensor::external(void* data, const Shape& shape, DType dt, std::shared_ptr<void> keepalive) {
  Tensor t;
  t.dtype_ = dt;
  t.shape_ = shape;
  t.numel_ = graft::numel(shape);
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = t.nbytes();
  t.storage_->keepalive = std::move(keepalive);
  return t;
}

Tensor Tensor::reshaped(const Shape& s) const {
  GRAFT_CHECK(graft::numel(s) == numel_, ErrorKind::ShapeMismatch,
              "cannot reshape " + shape_str(shape_) + " to " + shape_str(s));
  Tensor t = *this;
  t.shape_ = s;
  return t;
}

Tensor Tensor::clone(Allocator& a, Category c) const {
  Tensor t = empty(shape_, dtype_, a, c);
  if (nbytes()) std::memcpy(t.raw(), raw(), nbytes());
  return t;
}

double Tensor::at(int64_t i) const {
  switch (dtype_) {
    case DType::F32:
      return data<float>()[i];
    case DType::F64:
      return data<double>()[i];
    case DType::I64:
      return static_cast<double>(data<int64_t>()[i]);
    case DType::Bool:
      return data<bool>()[i] ? 1.0 : 0.0;
    case DType::I32:
      return static_cast<double>(data<int32_t>()[i]);
  }
  return 0;
}

}  // namespace graft
