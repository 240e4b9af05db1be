// graft's thread pool (include/graft/parallel.h): run_tasks on libgomp's OpenMP team or on
// graft's own persistent workers, parallel_ranges, and the thread count shared with the GEMM
// libraries (OpenBLAS, oneDNN).
#include <pthread.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "graft/core.h"
#include "graft/parallel.h"

// libgomp's and OpenBLAS's entry points (graft links both: libgomp is the OpenMP runtime of
// Debian's oneDNN and of PyTorch), declared here rather than through <omp.h>, which a compiler
// without its OpenMP headers (clang without libomp-dev) lacks.
extern "C" void omp_set_num_threads(int);
extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

namespace graft {

// Note [OpenBLAS under a data limit]
// Debian's OpenBLAS (0.3.21, pthreads) starts its worker threads when the library loads (one fewer
// than its thread count) and when openblas_set_num_threads asks for more; each reserves a
// BUFFER_SIZE buffer (128 MiB of address space, mostly never touched) with malloc as it starts,
// and retries forever when that fails (blas_memory_alloc). Under an RLIMIT_DATA (ulimit -d) with
// less room than that, such a worker spins on a core and never becomes ready: the process then
// finishes its work and hangs at exit joining it (its buffered output lost), or hangs in the first
// product OpenBLAS splits over its threads. check_blas_room turns that into an error: it counts
// the buffers not yet in the process's data size (VmData, which the limit bounds; a worker that
// got its buffer has added 128 MiB to it) and refuses when the limit leaves less room than they
// need. That count takes each 128 MiB of the data size for a buffer already reserved, so in a
// process that holds much more (Python with torch) it finds none missing and never refuses: the
// check is for the command line, whose data size before the model is ~10 MiB.
// OPENBLAS_NUM_THREADS=1 (no workers) or a higher limit avoids the hang. A buffer the calling
// thread reserves at its first large OpenBLAS product (graft's large float32 products run on
// oneDNN; OpenBLAS takes the small, the float64 and Note [a ragged N]'s) is not covered.
namespace {
constexpr int64_t kBlasBuffer = (int64_t{128} << 20) + (int64_t{8} << 10);  // + malloc's header
}  // namespace

void check_blas_room(int threads) {
  struct rlimit rl;
  if (threads <= 1 || getrlimit(RLIMIT_DATA, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  const int64_t data = proc_kb_field("/proc/self/status", "VmData");
  if (data < 0) return;
  const int64_t limit = static_cast<int64_t>(rl.rlim_cur);
  const int64_t workers = threads - 1;
  const int64_t missing = std::max<int64_t>(0, workers - data / kBlasBuffer);
  if (missing == 0 || limit - data >= missing * kBlasBuffer) return;
  const int64_t mib = int64_t{1} << 20;
  throw Error(ErrorKind::OutOfMemory,
              "the data-size limit (ulimit -d) of " + std::to_string(limit / mib) + " MiB leaves " +
                  std::to_string(std::max<int64_t>(0, limit - data) / mib) +
                  " MiB, and OpenBLAS's " + std::to_string(threads) + " threads need " +
                  std::to_string(missing * kBlasBuffer / mib) +
                  " MiB more for their buffers (128 MiB each; under the limit OpenBLAS would retry "
                  "forever): raise the limit to at least " +
                  std::to_string((data + missing * kBlasBuffer) / mib + 64) +
                  " MiB, or run with OPENBLAS_NUM_THREADS=1 (and --threads 1)");
}

void set_num_threads(int n) {
  if (n > 0) {
    if (n > openblas_get_num_threads()) check_blas_room(n);
    openblas_set_num_threads(n);
    omp_set_num_threads(n);  // oneDNN's threads (float32 and bf16 GEMMs, convolutions)
  }
}
int num_threads() { return openblas_get_num_threads(); }

// ---- graft's own pool (GRAFT_POOL=own) ----------------------------------------------------------
// One job at a time: run_tasks takes `submit` with try_lock and runs inline when it cannot (a
// nested call from a task, or another thread's job in flight), so it never waits on itself. A job
// (fn, ctx, n) is published under `m` with a new generation number; a thread claims task i of job g
// by advancing `claim` from (g << 32 | i), so a thread still looking at an old job can never claim
// a task of a newer one; `left` counts unfinished tasks. Idle workers spin briefly (consecutive ops
// then need no wake-up), then sleep on `cv`. The pool is never destroyed (no join order at exit); a
// forked child has no workers, so it runs inline.
namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
struct Job {
  uint64_t gen = 0;
  void (*fn)(void*, int, int) = nullptr;
  void* ctx = nullptr;
  int n = 0;
  int slots = 1;  // max_threads() at submission: workers in higher slots sit it out
};
struct Pool {
  std::mutex submit, m;
  std::condition_variable cv, done_cv;
  Job job;                           // under m
  std::atomic<uint64_t> agen{0};     // job.gen, for spinning workers
  std::atomic<uint64_t> claim{0};    // gen << 32 | next task index
  std::atomic<int> left{0};          // tasks of the current job not finished
  std::atomic<bool> waiting{false};  // the caller sleeps on done_cv
  int workers = 0;                   // started so far (under submit)

  // Claims and runs tasks of job j until none are left, in the thread's slot.
  void work(const Job& j, int slot) {
    if (slot >= j.slots) return;
    uint64_t c = claim.load();
    for (;;) {
      if ((c >> 32) != (j.gen & 0xffffffffu) || static_cast<int>(c & 0xffffffffu) >= j.n) return;
      if (!claim.compare_exchange_weak(c, c + 1)) continue;
      j.fn(j.ctx, static_cast<int>(c & 0xffffffffu), slot);
      if (left.fetch_sub(1) == 1 && waiting.load()) {
        std::lock_guard<std::mutex> g(m);
        done_cv.notify_one();
      }
      c = claim.load();
    }
  }
  void loop(int slot) {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      for (int k = 0; agen.load(std::memory_order_acquire) == seen; ++k) {
        cpu_relax();
        if ((k & 63) == 63 && std::chrono::steady_clock::now() > until) break;
      }
      Job j;
      {
        std::unique_lock<std::mutex> l(m);
        cv.wait(l, [&] { return job.gen != seen; });
        j = job;
        seen = j.gen;
      }
      work(j, slot);
    }
  }
};
Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: workers may still be waiting at exit
  return *p;
}
std::atomic<bool> g_forked{false};
void mark_forked() { g_forked.store(true); }
}  // namespace

// libgomp's entry points (graft links libgomp, the OpenMP runtime of Debian's oneDNN and PyTorch):
// GOMP_parallel is what `#pragma omp parallel num_threads(t)` compiles to with GCC, called
// directly so that no file needs -fopenmp or <omp.h> (clang builds have neither).
extern "C" void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
extern "C" int omp_get_thread_num(void);

namespace {
// Note [one thread pool]
// ~~~~~~~~~~~~~~~~~~~~~~
// By default run_tasks runs its tasks on libgomp's OpenMP team, the threads oneDNN's convolutions
// and float32 matmuls and PyTorch's own loops already use: with a pool of graft's own beside it,
// libgomp's workers kept spinning after each oneDNN call and took a core from graft's. It was
// tried before the float32 GEMMs moved to oneDNN and lost then on convnext (its GEMMs ran on
// OpenBLAS's pthreads, a third set of threads). Measured on the zoo: docs/performance.md, "Three
// thread pools on two cores" and "One thread pool". GRAFT_POOL=own runs graft's own pool below
// (an A/B switch).
// run_tasks' contract on the OpenMP team: tasks claimed from a counter, slot = the team index.
void run_tasks_omp(int n, void (*fn)(void*, int, int), void* ctx) {
  std::atomic<int> next{0};
  std::exception_ptr err;
  std::mutex err_m;
  struct Team {
    void (*fn)(void*, int, int);
    void* ctx;
    int n;
    std::atomic<int>* next;
    std::exception_ptr* err;
    std::mutex* err_m;
  } team{fn, ctx, n, &next, &err, &err_m};
  GOMP_parallel(
      [](void* p) {
        auto* t = static_cast<Team*>(p);
        const int slot = omp_get_thread_num();
        for (int i; (i = t->next->fetch_add(1)) < t->n;) {
          try {
            t->fn(t->ctx, i, slot);
          } catch (...) {  // an exception must not leave a team thread
            std::lock_guard<std::mutex> g(*t->err_m);
            if (!*t->err) *t->err = std::current_exception();
            t->next->store(t->n);
          }
        }
      },
      &team, static_cast<unsigned>(std::min(n, max_threads())), 0);
  if (err) std::rethrow_exception(err);
}
}  // namespace

bool pool_is_openmp() {
  static const bool omp = [] {
    const char* v = std::getenv("GRAFT_POOL");
    return !(v && std::strcmp(v, "own") == 0);
  }();
  return omp;
}

void run_tasks(int n, void (*fn)(void*, int, int), void* ctx) {
  static const bool atfork = [] { return pthread_atfork(nullptr, nullptr, mark_forked) == 0; }();
  (void)atfork;
  Pool& p = pool();
  std::unique_lock<std::mutex> s(p.submit, std::try_to_lock);
  if (n <= 1 || !s.owns_lock() || g_forked.load(std::memory_order_relaxed)) {
    for (int i = 0; i < n; ++i) fn(ctx, i, 0);
    return;
  }
  if (pool_is_openmp()) return run_tasks_omp(n, fn, ctx);
  const int want = std::min(n, max_threads()) - 1;
  while (p.workers < want) {
    const int slot = ++p.workers;
    std::thread([&p, slot] { p.loop(slot); }).detach();
  }
  Job j;
  {
    std::lock_guard<std::mutex> g(p.m);
    j = {p.job.gen + 1, fn, ctx, n, max_threads()};
    p.left.store(n);
    p.waiting.store(false);
    p.claim.store((j.gen & 0xffffffffu) << 32);
    p.job = j;
    p.agen.store(j.gen, std::memory_order_release);
  }
  p.cv.notify_all();
  p.work(j, 0);
  // Wait for the tasks other threads claimed: spin a little, then sleep.
  for (int k = 0; k < 20000 && p.left.load() > 0; ++k) cpu_relax();
  if (p.left.load() > 0) {
    std::unique_lock<std::mutex> l(p.m);
    p.waiting.store(true);
    p.done_cv.wait(l, [&] { return p.left.load() == 0; });
  }
}

void parallel_ranges(int64_t n, int64_t work_per_item, void (*fn)(void*, int64_t, int64_t),
                     void* ctx) {
  parallel_elems(n, work_per_item, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
}

}  // namespace graft
