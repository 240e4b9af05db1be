// Errors, dtypes, the tracking allocator and Tensor (see include/graft/core.h).
#include "graft/core.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
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
    case DType::BF16:
      return 2;
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
    case DType::BF16:
      return "bfloat16";
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

// Note [mapped block cache]
// A training step frees most of what it allocates, and the next step asks for the same sizes in
// the same order. Given back to malloc, large blocks cost twice: under glibc's default policy the
// mmap threshold adapts upward (to 32 MiB) after the first large frees, so later blocks come from
// malloc's heap, where a freed block in the middle cannot go back to the system and new ones do
// not fit the holes exactly (ResNet-50 at 16 x 224^2: the process held 0.65 GiB over graft's
// planned peak, eager's 0.42 GiB over its own; docs/performance.md); and a block that malloc does
// map, or a heap top it trims, is faulted in afresh on the next use. So graft maps its blocks of
// at least reuse_min_bytes() (1 MiB; MALLOC_MMAP_THRESHOLD_ where that is set) itself and keeps
// them when they are freed: the next request of the same page-rounded size takes one (the most
// recently freed first), with no system call and no page fault.
// The promise: kept + in use <= the most ever in use at once (since the cache began or was last
// trimmed). A free keeps the sum. A request of a size none kept has takes part of a larger kept
// range (Note [kept ranges split and merge]); failing one, it is mapped afresh where that fits
// under the ceiling with everything kept, else the largest kept range grows to it (mremap: only its
// new pages fault), and kept ranges are unmapped (the smallest that alone suffices, else the
// largest, and again) until the sum fits under the ceiling or the request raises it. So the process
// never holds more than its own peak of graft blocks, which is what graft's plan sizes; between
// steps it holds that peak, as PyTorch's CUDA caching allocator does, and graft.empty_cache()
// (trim()) gives it back. One cache for the process, so a module's several shapes and sessions
// share one ceiling. A reused block is as large as a fresh one. Below 1 MiB blocks stay with
// malloc: its heap reuses them without a system call, and what its holes cost is small beside the
// large blocks' (a ResNet-18 at 4 x 64^2, blocks of 64 KiB up, stepped ~10-25% slower with them in
// the cache than in glibc's heap: the ceiling makes sizes that change within a step map or resize;
// ResNet-50's peak is the same 1.73-1.74 GiB either way). Off (operator new for every block)
// under AddressSanitizer, where a reused block would hide a use after free, and with
// GRAFT_BLOCK_REUSE=0.
// Where MALLOC_MMAP_THRESHOLD_ is set, the process has asked glibc to give large blocks back when
// they are freed (the benchmarks' memory policy, under which a step's anonymous-memory rise is
// compared with eager's): graft then follows the same policy for its own blocks, up to one run:
// the cache is trimmed when an outermost run (Allocator::RunScope) ends, so blocks are reused
// within a forward, a backward or a step (which never raises its peak) but none is held between
// runs.
// Note [kept ranges split and merge]
// What is kept is address ranges, not whole blocks: a request with no kept range of its size takes
// the front of the smallest larger one (the rest stays kept), and a freed block merges with kept
// ranges beside it. A step's sizes differ between forward and backward (ViT-B/16: the backward
// frees 4.8, 14.5 and 19.4 MB blocks in another mix than the next forward asks for them), so with
// whole blocks only, each step mapped 63 new ones and resized 188 (784 MiB of page faults per
// step, ~8% of its time); split and merged, the same pages serve every step. In use + kept is
// unchanged by a split or a merge, so the ceiling above holds as before; a range merged across two
// mappings is unmapped with one munmap (which takes any page range), and when mremap refuses to
// grow it (two of the kernel's areas) it is unmapped and a new block mapped.
// (This replaced block reuse within one executor run, which kept blocks from operator new up to
// the run's live peak and gave them all back to malloc at its end: the heap's holes stayed.)
namespace {
size_t default_reuse_min() {
  static const size_t n = [] {
    size_t bytes = size_t{1} << 20;
    if (const char* e = std::getenv("MALLOC_MMAP_THRESHOLD_")) {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(e, &end, 10);
      if (end != e && *end == '\0' && v > 0) bytes = static_cast<size_t>(v);
    }
    return std::max<size_t>(bytes, 32 << 10);
  }();
  return n;
}

bool block_cache_enabled() {
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

size_t page_round(size_t bytes) {
  static const size_t page = [] {
    const long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<size_t>(p) : size_t{4096};
  }();
  return (bytes + page - 1) / page * page;
}
}  // namespace

Allocator::Allocator()
    : reuse_min_(default_reuse_min()),
      cache_(block_cache_enabled() ? &BlockCache::global() : nullptr) {}

Allocator::~Allocator() = default;

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
  if (cache_ && bytes >= reuse_min_ && bytes > 0) {
    s->data = cache_->take(bytes, &s->mapped);
  } else {
    // Exactly `bytes`, 64-byte aligned: no padding, so AddressSanitizer sees a read one past the
    // end.
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
  if (current_ > peak_) {
    peak_ = current_;
    at_peak_ = by_cat_;
  }
  record();
  return s;
}

void Allocator::release(Storage& s) {
  std::lock_guard<std::mutex> lock(mu_);
  if (s.mapped)
    cache_->give(s.data, s.mapped);
  else
    ::operator delete(s.data, std::align_val_t(64));
  current_ -= static_cast<int64_t>(s.bytes);
  by_cat_[static_cast<int>(s.category)] -= static_cast<int64_t>(s.bytes);
  s.data = nullptr;
  record();
}

ScratchBlock::ScratchBlock(size_t bytes) {
  if (block_cache_enabled() && bytes >= default_reuse_min())
    p_ = BlockCache::global().take(bytes, &mapped_);
  else
    p_ = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t(64), std::nothrow);
  if (!p_)
    fail(ErrorKind::OutOfMemory,
         "the system refused " + std::to_string(bytes) + " bytes of kernel scratch");
}

ScratchBlock::~ScratchBlock() {
  if (mapped_)
    BlockCache::global().give(p_, mapped_);
  else
    ::operator delete(p_, std::align_val_t(64));
}

// ---------------------------------------------------------------------------------------------
BlockCache& BlockCache::global() {
  static BlockCache* c = [] {
    auto* b = new BlockCache;
    b->set_trim_after_runs(std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr);
    return b;
  }();
  return *c;
}

Allocator::RunScope::RunScope(Allocator& a) : a_(a) {
  std::lock_guard<std::mutex> lock(a_.mu_);
  ++a_.run_depth_;
}

Allocator::RunScope::~RunScope() {
  std::lock_guard<std::mutex> lock(a_.mu_);
  if (--a_.run_depth_ == 0 && a_.cache_ && a_.cache_->trims_after_runs()) a_.cache_->trim();
}

BlockCache::~BlockCache() { unmap_kept(0); }

void* BlockCache::take(size_t bytes, size_t* mapped) {
  const size_t r = page_round(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  // A kept range of the same page-rounded size (of several, the most recently kept: its pages are
  // the likeliest still in the CPU's caches); else the front of the smallest larger one, whose
  // rest stays kept (Note [kept ranges split and merge]). Either way no system call and no page
  // fault, and in use + kept is unchanged.
  if (auto it = kept_.lower_bound(r); it != kept_.end()) {
    char* p = it->second;
    const size_t n = it->first;
    unkeep(it);
    if (n > r) {
      keep(p + r, n - r);
      ++splits_;
    } else {
      ++hits_;
    }
    kept_bytes_ -= static_cast<int64_t>(r);
    in_use_ += static_cast<int64_t>(r);
    *mapped = r;
    return p;
  }
  // Every kept range is smaller. Where a new block fits under the ceiling with every kept one
  // still kept, it is mapped; else the largest kept range grows to it (mremap keeps its pages, so
  // only the new ones fault). What is kept then shrinks to fit the ceiling.
  char* p = nullptr;
  size_t was = 0;
  const int64_t after = in_use_ + static_cast<int64_t>(r);
  const int64_t ceiling = std::max(high_, after);
  if (!kept_.empty() && after + kept_bytes_ > ceiling) {
    auto it = std::prev(kept_.end());
    was = it->first;
    p = it->second;
    kept_bytes_ -= static_cast<int64_t>(was);
    unkeep(it);
  }
  unmap_kept(ceiling - after);
  bool resized = false;
  void* q = nullptr;
  if (p) {
    // A range merged from two mappings spans two of the kernel's areas, which mremap refuses.
    q = mremap(p, was, r, MREMAP_MAYMOVE);
    resized = q != MAP_FAILED;
    if (!resized) {
      munmap(p, was);
      ++unmaps_;
    }
  }
  if (resized) {
    ++resizes_;
  } else {
    q = mmap(nullptr, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (q == MAP_FAILED && kept_bytes_ > 0) {  // the system is short: give back every kept range
      unmap_kept(0);
      q = mmap(nullptr, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (q == MAP_FAILED) return nullptr;
    ++maps_;
  }
  *mapped = r;
  in_use_ = after;
  high_ = std::max(high_, in_use_);
  return q;
}

void BlockCache::give(void* p, size_t mapped) {
  std::lock_guard<std::mutex> lock(mu_);
  keep(static_cast<char*>(p), mapped);
  kept_bytes_ += static_cast<int64_t>(mapped);  // in use + kept is unchanged
  in_use_ -= static_cast<int64_t>(mapped);
}

void BlockCache::keep(char* p, size_t n) {
  // A kept neighbour leaves both maps and joins the range.
  auto absorb = [&](std::map<char*, size_t>::iterator at) {
    auto it = kept_.lower_bound(at->second);
    while (it->second != at->first) ++it;
    p = std::min(p, at->first);
    n += at->second;
    kept_.erase(it);
    kept_at_.erase(at);
  };
  if (auto next = kept_at_.find(p + n); next != kept_at_.end()) absorb(next);
  if (auto at = kept_at_.lower_bound(p); at != kept_at_.begin()) {
    const auto prev = std::prev(at);
    if (prev->first + prev->second == p) absorb(prev);
  }
  kept_.emplace_hint(kept_.lower_bound(n), n, p);  // first of its size
  kept_at_.emplace(p, n);
}

void BlockCache::unkeep(std::multimap<size_t, char*>::iterator it) {
  kept_at_.erase(it->second);
  kept_.erase(it);
}

void BlockCache::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  unmap_kept(0);
  high_ = in_use_;
}

BlockCache::Stats BlockCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {in_use_, kept_bytes_, high_, hits_, splits_, maps_, unmaps_, resizes_};
}

void BlockCache::unmap_kept(int64_t down_to) {  // mu_ held
  // The smallest range that alone brings kept down far enough goes; failing one, the largest,
  // and again: a 64 KiB request should not cost a 256 KiB range that a later one would take.
  // munmap takes any page range, however many mappings it spans.
  while (kept_bytes_ > down_to && !kept_.empty()) {
    auto it = kept_.lower_bound(static_cast<size_t>(kept_bytes_ - down_to));
    if (it == kept_.end()) it = std::prev(kept_.end());
    it = std::prev(kept_.upper_bound(it->first));  // the least recently kept of that size
    munmap(it->second, it->first);
    kept_bytes_ -= static_cast<int64_t>(it->first);
    ++unmaps_;
    unkeep(it);
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
}  // namespace

int64_t proc_kb_field(const char* file, const char* key) {
  std::FILE* f = std::fopen(file, "r");
  if (!f) return -1;
  const size_t n = std::strlen(key);
  char line[256];
  int64_t kb = -1;
  while (kb < 0 && std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, n) == 0 && line[n] == ':')
      kb = std::strtoll(line + n + 1, nullptr, 10);
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

int64_t available_memory_bytes() {
  int64_t avail = proc_kb_field("/proc/meminfo", "MemAvailable");
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
    case DType::BF16: {
      const uint32_t b = static_cast<uint32_t>(data<uint16_t>()[i]) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
  }
  return 0;
}

}  // namespace graft
