// graft core: typed errors, dtypes, the tracking allocator and the Tensor.
//
// Every byte graft holds is a Storage handed out by an Allocator, which keeps exact counts:
// current bytes, peak bytes (resettable), and both per memory category. Tests assert these counts
// to the byte, so nothing here rounds or pads the *accounted* size.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace graft {

// ---------------------------------------------------------------------------------------------
// Errors. One exception type with a kind, so callers (CLI, Python) can map kinds to exit codes and
// exception classes. Messages name the node / value at fault and say what to do.
enum class ErrorKind {
  InvalidModel,     // the file or graph is malformed
  Unsupported,      // valid ONNX that graft does not implement (op, dtype, attribute, opset)
  ShapeMismatch,    // shapes that do not fit together
  InvalidArgument,  // a bad option, name or input from the caller
  OutOfMemory,      // a budget or the system refused an allocation
  Io,               // reading or writing a file failed
  NonFinite,        // a NaN / Inf was produced while checking was on
  Communication,    // another rank failed, hung or differs (data parallelism)
  Internal,         // a graft bug
};
const char* error_kind_name(ErrorKind k);

// Errors are data: kind, the node at fault (its name, "" when none) and the message are fields, so
// the CLI and Python map them without parsing what() (which is "<kind>: <message>").
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg, const std::string& node = "");
  ErrorKind kind() const { return kind_; }
  const std::string& node() const { return node_; }
  const std::string& message() const { return message_; }

 private:
  ErrorKind kind_;
  std::string node_, message_;
};

[[noreturn]] void fail(ErrorKind kind, const std::string& msg);
// The same, naming the node at fault (its name goes in Error::node; `msg` already names it).
[[noreturn]] void fail_at(ErrorKind kind, const std::string& node, const std::string& msg);

#define GRAFT_CHECK(cond, kind, msg)           \
  do {                                         \
    if (!(cond)) ::graft::fail((kind), (msg)); \
  } while (0)

// ---------------------------------------------------------------------------------------------
// BF16: bfloat16 storage graft chooses itself for matrix-product operands a bf16 session keeps for
// the backward (Note [bf16 operands], src/plan/bf16_operands.cpp); no model value, input, output
// or parameter has it, and only matrix products (and views) read it.
enum class DType : uint8_t { F32, F64, I64, Bool, I32, BF16 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);
inline bool is_float(DType t) { return t == DType::F32 || t == DType::F64; }
inline bool is_int(DType t) { return t == DType::I64 || t == DType::I32; }

using Shape = std::vector<int64_t>;
// Number of elements; throws InvalidModel on a negative dim or an int64 overflow.
int64_t numel(const Shape& s);
// The same, with `what` (e.g. "input 'x'") named in the error.
int64_t numel(const Shape& s, const std::string& what);
std::string shape_str(const Shape& s);

// ---------------------------------------------------------------------------------------------
enum class Category : uint8_t { Parameter, Gradient, Activation, OptimizerState, Workspace };
constexpr int kNumCategories = 5;
const char* category_name(Category c);

class Allocator;

// A block of memory. Owned blocks come from an Allocator and return to it on destruction;
// external blocks (e.g. PyTorch's parameter storage, shared zero-copy) are not counted and keep
// their owner alive through `keepalive`.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Category category = Category::Activation;
  Allocator* owner = nullptr;
  // > 0: a BlockCache block of this many bytes (it goes back there); 0: from operator new.
  size_t mapped = 0;
  std::shared_ptr<void> keepalive;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage();
};

// Note [mapped block cache] (core.cpp): graft's large blocks are its own anonymous mappings, kept
// when freed and handed to the next request of the same size, so a steady training step neither
// faults a page nor leaves holes in malloc's heap. What is kept plus what is in use never exceeds
// the most ever in use at once (since construction or the last trim()): the process holds its
// own peak and no more. One per process (global()), shared by every Allocator.
class BlockCache {
 public:
  BlockCache() = default;
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;
  ~BlockCache();  // unmaps what is kept (blocks still in use must have gone back first)

  // A block of `bytes` rounded up to pages (page-aligned): a kept range of that size, else the
  // front of the smallest larger kept range, else a new (or grown) mapping; its size in *mapped.
  // nullptr if the system refuses even after every kept range went back.
  void* take(size_t bytes, size_t* mapped);
  void give(void* p, size_t mapped);  // `mapped` as take() set it
  // Every kept block back to the system; the ceiling restarts from what is in use now.
  void trim();
  // Under an explicit MALLOC_MMAP_THRESHOLD_ (glibc asked to return large blocks when freed, the
  // benchmarks' memory policy) the global cache is trimmed at the end of every outermost run
  // (Allocator::RunScope): blocks are reused within a run only. Tests set it by hand.
  bool trims_after_runs() const { return trim_after_runs_; }
  void set_trim_after_runs(bool on) { trim_after_runs_ = on; }

  struct Stats {
    int64_t in_use, kept, high, hits, splits, maps, unmaps, resizes;
  };
  Stats stats() const;

  static BlockCache& global();  // never destroyed: blocks may go back during static destruction

 private:
  // mu_ held for these:
  void unmap_kept(int64_t down_to);
  void keep(char* p, size_t n);  // into kept_ and kept_at_, merged with its kept neighbours
  void unkeep(std::multimap<size_t, char*>::iterator it);
  mutable std::mutex mu_;
  std::multimap<size_t, char*>
      kept_;                         // kept ranges by size (of one size: most recently kept first)
  std::map<char*, size_t> kept_at_;  // the same ranges by address
  bool trim_after_runs_ = false;
  int64_t in_use_ = 0, kept_bytes_ = 0, high_ = 0, hits_ = 0, splits_ = 0, maps_ = 0, unmaps_ = 0,
          resizes_ = 0;
};

struct MemoryEvent {
  int64_t step;   // executor step (or -1 outside a run)
  int64_t bytes;  // current bytes after the event
  std::array<int64_t, kNumCategories> by_category;
};

class Allocator {
 public:
  Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;
  ~Allocator();

  // Allocates `bytes` (64-byte aligned). Throws OutOfMemory if the system refuses or the limit
  // set by set_limit would be exceeded. `what` names the value for the error message.
  std::shared_ptr<Storage> allocate(size_t bytes, Category c, const std::string& what = "");
  // Moves a block's bytes from one category to another (a gradient temporary adopted as .grad).
  void recategorize(Storage& s, Category c);

  int64_t current() const { return current_; }
  int64_t peak() const { return peak_; }
  int64_t current(Category c) const { return by_cat_[static_cast<int>(c)]; }
  // Per-category bytes at the moment the peak was reached.
  const std::array<int64_t, kNumCategories>& at_peak() const { return at_peak_; }
  void reset_peak();
  int64_t allocations() const { return n_allocs_; }

  // 0 = unlimited.
  void set_limit(int64_t bytes) { limit_ = bytes; }
  int64_t limit() const { return limit_; }

  // Timeline of (step, bytes) after every allocate/free while enabled.
  void set_timeline(bool on) { timeline_on_ = on; }
  void set_step(int64_t step) { step_ = step; }
  const std::vector<MemoryEvent>& timeline() const { return timeline_; }
  void clear_timeline() { timeline_.clear(); }

  // A process-wide default.
  static Allocator& global();

  // Blocks of at least reuse_min_bytes() (MALLOC_MMAP_THRESHOLD_, else 1 MiB) come from a
  // BlockCache (the process's, unless set_block_cache says otherwise) and go back to it; smaller
  // ones from operator new. GRAFT_BLOCK_REUSE=0 and AddressSanitizer builds use operator new for
  // all.
  size_t reuse_min_bytes() const { return reuse_min_; }
  void set_reuse_min_bytes(size_t bytes) { reuse_min_ = bytes; }  // tests
  void set_block_cache(BlockCache* c) { cache_ = c; }             // tests; nullptr: none

  // An executor run, or a TrainSession step (forward and backward): where the cache trims after
  // runs (BlockCache::trims_after_runs), the end of the outermost one trims it.
  class RunScope {
   public:
    explicit RunScope(Allocator& a);
    ~RunScope();
    RunScope(const RunScope&) = delete;
    RunScope& operator=(const RunScope&) = delete;

   private:
    Allocator& a_;
  };

 private:
  friend struct Storage;
  void release(Storage& s);
  mutable std::mutex mu_;  // runs on several threads share one allocator
  void record();
  int64_t current_ = 0, peak_ = 0, limit_ = 0, n_allocs_ = 0, step_ = -1;
  size_t reuse_min_;
  BlockCache* cache_;
  int run_depth_ = 0;
  std::array<int64_t, kNumCategories> by_cat_{}, at_peak_{};
  bool timeline_on_ = false;
  std::vector<MemoryEvent> timeline_;
};

// Scratch a kernel needs for one call outside any plan (oneDNN's packed GEMM operand, Note
// [packed GEMM operand] in gemm_dnnl.cpp): a block of the process's BlockCache when that is on
// (so a same-size request on the next call reuses the pages, and the cache's bound and trims cover
// it), else operator new. Throws OutOfMemory when the system refuses.
class ScratchBlock {
 public:
  explicit ScratchBlock(size_t bytes);
  ~ScratchBlock();
  ScratchBlock(const ScratchBlock&) = delete;
  ScratchBlock& operator=(const ScratchBlock&) = delete;
  void* data() const { return p_; }

 private:
  void* p_ = nullptr;
  size_t mapped_ = 0;  // > 0: from the BlockCache
};

// Memory this process may still take, in bytes: the smaller of /proc/meminfo's MemAvailable and
// what its cgroup (v2 memory.max, v1 limit_in_bytes) leaves; -1 when neither can be read.
int64_t available_memory_bytes();
// A "Key:   123 kB" line of a /proc file (/proc/self/status, /proc/meminfo), in bytes; -1 if the
// file or the key is absent.
int64_t proc_kb_field(const char* file, const char* key);

// ---------------------------------------------------------------------------------------------
// A dense, contiguous, row-major tensor. Copies share storage (like torch.Tensor).
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const Shape& shape, DType dt, Allocator& a, Category c,
                      const std::string& what = "");
  static Tensor zeros(const Shape& shape, DType dt, Allocator& a, Category c,
                      const std::string& what = "");
  // Wraps memory graft does not own (not counted by any allocator).
  static Tensor external(void* data, const Shape& shape, DType dt, std::shared_ptr<void> keepalive);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? i + static_cast<int>(shape_.size()) : i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  void* raw() const { return storage_ ? storage_->data : nullptr; }
  template <class T>
  T* data() const {
    return static_cast<T*>(raw());
  }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  // Same storage, new shape (numel must match).
  Tensor reshaped(const Shape& s) const;
  // A deep copy into a new block.
  Tensor clone(Allocator& a, Category c) const;
  // Reads element i as double (any dtype), for tests and printing.
  double at(int64_t i) const;

 private:
  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::F32;
  Shape shape_;
  int64_t numel_ = 0;
};

}  // namespace graft
