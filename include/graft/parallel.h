// graft's threads: one pool that the kernels and the optimizers split their loops over
// (src/core/thread_pool.cpp), and the thread count shared with the GEMM libraries.
//
// Loops split into contiguous ranges of independent items, so results never depend on the number
// of threads or on which thread ran what.
#pragma once

#include <algorithm>
#include <cstdint>

// Note [ISA clones]
// graft builds for baseline x86-64 (SSE2: 4 floats, 2 doubles per vector), so plain loops the
// compiler vectorizes run far below what AVX-512 does with them. Hot kernels whose loops are
// plain (depthwise convolutions, BatchNorm's sums and its backward, max pooling, AdamW's update)
// mark their float32 entry point GRAFT_ISA_CLONES: GCC compiles it also for AVX2 and AVX-512
// (target_clones) and picks the copy once at load time; their helpers are GRAFT_INLINE so that
// each copy has its own. Results do not depend on the copy where the file is built with
// -ffp-contract=off (no fused multiply-adds the code does not spell) and the summation order is
// written out (sum8). A loop with a square root vectorizes only with -fno-math-errno (otherwise
// each sqrt is a call that may set errno): optim.cpp is built with it.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define GRAFT_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define GRAFT_ISA_CLONES
#endif
#define GRAFT_INLINE [[gnu::always_inline]] inline

namespace graft {

// Threads used by GEMMs (OpenBLAS, oneDNN's OpenMP team) and by graft's own loops; <= 0 leaves the
// library default.
void set_num_threads(int n);
int num_threads();

// Note [OpenBLAS under a data limit] (thread_pool.cpp): throws Error(OutOfMemory), naming the
// limit and what to do, when a data-size limit (ulimit -d) leaves no room for the buffers
// OpenBLAS's worker threads reserve (`threads` of them in all, the calling thread included) and
// would otherwise retry forever. set_num_threads checks a larger count before it starts the new
// workers; the command line checks the ones started with the library before anything else.
void check_blas_room(int threads);

// Threads for graft's own loops (per channel, per plane): num_threads(), at least one.
inline int max_threads() { return std::max(1, num_threads()); }

// Runs fn(ctx, task, slot) for every task in [0, n) on up to max_threads() threads, the calling
// thread among them (libgomp's OpenMP team, or graft's own persistent pool with GRAFT_POOL=own:
// Note [one thread pool], thread_pool.cpp), and returns when all have finished. Threads claim tasks
// as they come free (a descheduled worker on a busy machine leaves its share to the others), so
// which thread runs which task is not fixed and tasks must be independent; `slot` (<
// max_threads()) is the running thread's, distinct among tasks running at once. Runs all tasks
// inline, in order, in slot 0 when called from a pool task (nesting), while another thread has the
// pool, or in a forked child.
void run_tasks(int n, void (*fn)(void*, int, int), void* ctx);
// Whether run_tasks runs on libgomp's OpenMP team (the default) rather than graft's own pool
// (GRAFT_POOL=own). On the team, a oneDNN call inside a task runs on that task's thread alone.
bool pool_is_openmp();

// Below this many element operations a loop runs on the calling thread: waking a worker costs a
// few microseconds, which this much work pays for (docs/performance.md, "What changed").
constexpr int64_t kParallelGrain = 32768;

// Splits [0, n) into contiguous ranges, up to 4 per thread and none under kParallelGrain element
// operations (n * work_per_item), and runs f(slot, begin, end) on each, slot < max_threads() being
// the running thread's (an index into per-thread scratch). For loops between GEMMs, never around
// them: the GEMMs run their own threads (oneDNN's team, OpenBLAS's). Callers split over independent
// items only, so results do not depend on the number of threads or on which thread ran what.
template <class F>
void parallel_for(int64_t n, int64_t work_per_item, F&& f) {
  if (n <= 0) return;
  const int64_t work = n * std::max<int64_t>(1, work_per_item);
  const int threads = max_threads();
  const int t = threads <= 1 ? 1
                             : static_cast<int>(std::min<int64_t>(
                                   {4 * threads, n, std::max<int64_t>(1, work / kParallelGrain)}));
  if (t <= 1) {
    f(0, int64_t{0}, n);
    return;
  }
  struct Ctx {
    F* f;
    int64_t n;
    int t;
  } ctx{&f, n, t};
  run_tasks(
      t,
      [](void* p, int i, int slot) {
        auto* c = static_cast<Ctx*>(p);
        (*c->f)(slot, c->n * i / c->t, c->n * (i + 1) / c->t);
      },
      &ctx);
}
// parallel_for over [0, n) in blocks of `block` items (begin a multiple of block): for
// vectorized loops over flat arrays, so that no thread's range starts mid-vector.
template <class F>
void parallel_blocks(int64_t n, int64_t work_per_item, F&& f, int64_t block = 64) {
  const int64_t nb = (n + block - 1) / block;
  parallel_for(nb, block * work_per_item,
               [&](int t, int64_t b0, int64_t b1) { f(t, b0 * block, std::min(n, b1 * block)); });
}

// Runs f(begin, end) over [0, n) elements in parallel (f: a plain, vectorizable loop).
template <class F>
void parallel_elems(int64_t n, int64_t work_per_item, F&& f) {
  parallel_blocks(n, work_per_item, [&](int, int64_t b, int64_t e) { f(b, e); });
}

// parallel_elems through a function pointer, for callers that keep templates out of their files
// (the optimizers' updates): fn(ctx, begin, end) over contiguous ranges covering [0, n), each
// starting at a multiple of 64.
void parallel_ranges(int64_t n, int64_t work_per_item, void (*fn)(void*, int64_t, int64_t),
                     void* ctx);

}  // namespace graft
