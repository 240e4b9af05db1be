// Note [bf16 GEMMs]
// Mixed precision the way PyTorch's CPU autocast does it for matrix products, with fp32 storage:
// inside a Bf16MatmulScope, a float32 GEMM C = alpha op(A) op(B) + beta C rounds A and B to
// bfloat16 (round to nearest even, into per-call scratch of half their size) and runs oneDNN's
// bf16 matmul (AMX tiles on Sapphire Rapids, AVX512-BF16 before), which accumulates in float32
// and writes C in float32 (alpha as the output scale, beta as a sum post-op). Everything outside
// the product stays float32: activations, weights (the "master" copy), gradients, optimizer state,
// softmax, norms, losses and reductions, so numerically sensitive ops keep their precision.
// Primitives are created once per shape and transposition and kept (oneDNN's creation costs far
// more than a small GEMM); products under 2^18 multiply-adds skip oneDNN and run the same
// arithmetic (rounded operands, float32 accumulation) through OpenBLAS. float64 GEMMs never change.
//
// Note [bf16 operand scratch]
// The rounded copies of A and B and oneDNN's scratchpad (scratchpad_mode::user, as for float32)
// live in one ScratchBlock per product, from the process's block cache, given back as the product
// returns. They were once per-thread buffers that grew to the largest operands of a forward or
// backward and lived until its end, plus oneDNN's library-owned scratchpad: GPT-2 124M's LM head
// (dW = dLogits^T X rounds a 2048 x 50257 dLogits, 206 MB) kept them through the whole backward,
// and graft's bf16 step peaked 0.37 GiB above its float32 step. From the block cache, the next
// product's copies and the planner's values reuse the same pages. An operand whose copy would pass
// 32 MiB (the LM head's dLogits, its 50257 x 768 weight) is rounded a panel at a time: a block of
// rows of C (A's panel) or of columns (B's), each a product of its own, the other operand rounded
// once; a panel is a multiple of 64 rows or columns, so each still runs at the kernel's rate.
//
// Note [float32 GEMM backend]
// Outside a Bf16MatmulScope, float32 GEMMs of at least 2^18 multiply-adds run oneDNN's float32
// matmul primitive (brgemm kernels, JIT for AVX-512) on the operands in place (strides express
// lda/ldb and the transpositions); smaller ones run OpenBLAS's sgemm (a primitive call costs
// microseconds). Measured each library alone in its process (python3 -m graft.bench_gemm,
// docs/performance.md "One GEMM library"): on narrow products (the Linear layers of small models,
// convnext's MLPs, weight gradients) oneDNN runs clearly faster than OpenBLAS; on 1024^3 and the
// seed's 1024x4096x4096 products the two are within this machine's noise. Products above 2^31
// multiply-adds used to stay on OpenBLAS for that reason, but in a training step they cost more
// there: OpenBLAS's pthreads spin on one core after each product while graft's loops (ReLU, bias
// gradients, SGD) run on the OpenMP team, which slowed those loops severalfold
// (docs/performance.md, "Large products on oneDNN too"). The primitive runs on the OpenMP team
// oneDNN's convolutions and PyTorch's loops use (Note [one thread pool], util.cpp). oneDNN's
// dnnl_sgemm is faster still on the large products, but mallocs its packing buffers per call,
// outside graft's accounting; the primitive's scratchpad is graft's: one buffer per thread, kept
// between calls, as large as the largest product needed (sizes in docs/performance.md).
// GRAFT_GEMM=openblas runs every float32 GEMM on OpenBLAS (an A/B switch for benchmarks;
// GRAFT_GEMM=dnnl, which once forced the large products onto oneDNN, is now the default). The
// exception: products of 2^31 or more with B not transposed and N not a multiple of 16 run on
// OpenBLAS again (Note [a ragged N]).
//
// Note [a ragged N]
// With B not transposed (row-major K x N: the dX = dY W and dW = dY^T X products of a Linear
// layer) and N not a multiple of 16, B's rows are not 64-byte aligned and oneDNN 2.6's brgemm
// matmul runs well below its rate: the seed's 1024x8194x8194 dX ran slower than the transposed
// forward product and than OpenBLAS, which made graft's seed-size step slower than eager's.
// Such products of at least 2^31 multiply-adds run on OpenBLAS, with the same peak RSS. Smaller
// ones stay on oneDNN, where it is about as fast or faster. Tried first: splitting the product
// into its first N - N % 16 columns and the rest, both on oneDNN (as fast as OpenBLAS), but a
// sub-matrix B (ldb != N) is not brgemm's: oneDNN picks its gemm:jit implementation, which
// mallocs packing buffers per thread per call outside graft's accounting (a higher peak RSS at
// the seed's size). The numbers: docs/performance.md, "A ragged N: the seed's own size".
//
// Note [packed GEMM operand]
// With B row-major K x N (not transposed: the dX = dY W and dW = dY^T X products of a Linear layer,
// and every product of GPT-2's Conv1D layers), oneDNN 2.6's brgemm matmul copies B's blocks into
// its own layout as it goes and runs far below its rate on many shapes: 1576x3072x768 ran at 130
// GFLOP/s against 290 with B transposed, and 768x3072x1576 (A transposed) at 90-130; torch.mm
// (MKL) ran both at ~250 (docs/performance.md, "Real size, round 3"). Such products of at
// least 2^25 multiply-adds are created with B's format `any`, and B is reordered into the layout
// the primitive picks before each call (a reorder primitive, on the OpenMP team: ~1 ms for a
// 768x3072 B, against the 15-30 ms it saves), into a ScratchBlock: the block cache's, so the next
// call of the size reuses its pages and the cache's bound covers it. Packed B larger than 64 MiB
// (GPT-2's tied 50257x768 embedding as the B of the LM head's dX) stays in place: that copy would
// raise the step's peak. GRAFT_GEMM_PACK=0 turns packing off (an A/B switch).
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <tuple>

#include "graft/ops.h"
#include "lru.h"
#include "util.h"

namespace graft {

namespace {
// Note [packed GEMM operand]: which products pack B, and GRAFT_GEMM_PACK=0 keeps B in the
// caller's layout (an A/B switch for benchmarks).
constexpr int64_t kPackMinMacs = int64_t{1} << 25;
constexpr size_t kPackMaxBytes = size_t{64} << 20;
bool packs_b_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("GRAFT_GEMM_PACK");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  return on;
}

thread_local bool t_bf16 = false;
// Note [bf16 operand scratch]: the largest rounded copy of one operand a product makes at once.
constexpr size_t kBf16PanelBytes = size_t{32} << 20;
// Below this, a product's scratch is a per-thread buffer of this size, kept: attention's per-head
// products on the worker threads allocated and freed theirs from malloc's per-thread arenas, which
// kept ~0.1 GiB of GPT-2's bf16 step (docs/bf16.md).
constexpr size_t kSmallScratchBytes = size_t{1} << 20;

// f32 -> bf16 bits, round to nearest even (NaN stays NaN): the one rounding rule of both paths.
inline uint16_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);  // quiet
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
void row_to_bf16(const float* s, int64_t n, uint16_t* d) {
  for (int64_t c = 0; c < n; ++c) d[c] = bf16_bits(s[c]);
}
// The same with AVX512-BF16's conversion instruction, 16 at a time (it rounds to nearest even too,
// and flushes float32 denormals to zero), the row's last n % 16 through a masked vector so that
// every element of a row takes the instruction: a value rounds the same wherever it sits (a
// product rounds its operand row by row, RoundToBf16 in flat blocks: Note [bf16 gradient
// operands]).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void row_to_bf16_avx(const float* s,
                                                                                     int64_t n,
                                                                                     uint16_t* d) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), reinterpret_cast<__m256i&>(v));
  }
  if (c < n) {
    const auto m = static_cast<__mmask16>((1u << (n - c)) - 1);
    __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + c));
    _mm256_mask_storeu_epi16(d + c, m, reinterpret_cast<__m256i&>(v));
  }
}

// `rows` x `cols` from a row stride of `ld` into a dense buffer.
bool bf16_convert_avx() {
  static const bool avx = __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return avx;
}
void to_bf16(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst) {
  const bool avx = bf16_convert_avx();
  parallel_for(rows, 2 * cols, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (avx)
        row_to_bf16_avx(src + r * ld, cols, dst + r * cols);
      else
        row_to_bf16(src + r * ld, cols, dst + r * cols);
    }
  });
}

// A matmul primitive per (shape, transpositions, leading dimensions, alpha, beta, dtype). For
// bf16 the operands are the dense rounded copies, so lda and ldb are those of the copies.
using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, float,
                       float, bool>;
struct Prim {
  dnnl::matmul mm;
  dnnl::memory::desc a, b, c, scratch;
  // Note [packed GEMM operand]: where `pack` is a primitive, B (in the caller's layout b_user) is
  // reordered into b (the primitive's own blocked layout) in scratch before each call.
  dnnl::memory::desc b_user;
  dnnl::reorder pack;
};

opsutil::LruCache<Key, const Prim>& primitives() {
  static opsutil::LruCache<Key, const Prim> cache(
      opsutil::kPrimitiveCacheCapacity);  // Note [primitive caches] (lru.h)
  return cache;
}

std::shared_ptr<const Prim> primitive(bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                                      int64_t lda, int64_t ldb, int64_t ldc, float alpha,
                                      float beta, bool bf16) {
  const Key key{M, N, K, ta, tb, lda, ldb, ldc, alpha, beta, bf16};
  return primitives().get(key, [&]() -> std::shared_ptr<const Prim> {
    using dt = dnnl::memory::data_type;
    const dt in = bf16 ? dt::bf16 : dt::f32;
    // op(A) is M x K, stored as M rows of stride lda (K x M, stride lda, when transposed); likewise
    // op(B): strides express the transposition, so no transposing copy is made.
    dnnl::memory::desc a({M, K}, in, ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
    dnnl::memory::desc b({K, N}, in, tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
    dnnl::memory::desc c({M, N}, dt::f32, dnnl::memory::dims{ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (alpha != 1.f) attr.set_output_scales(0, {alpha});
    if (beta != 0.f) {
      dnnl::post_ops po;
      po.append_sum(beta);
      attr.set_post_ops(po);
    }
    if (!bf16 && !tb && M * N * K >= kPackMinMacs && packs_b_enabled()) {
      // Note [packed GEMM operand]: B row-major, in the layout the primitive picks.
      dnnl::memory::desc any({K, N}, in, dnnl::memory::format_tag::any);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, any, c), attr, opsutil::dnnl_engine());
      const dnnl::memory::desc packed = pd.weights_desc();
      if (packed != b && packed.get_size() <= kPackMaxBytes) {
        dnnl::reorder::primitive_desc rd(opsutil::dnnl_engine(), b, opsutil::dnnl_engine(), packed);
        return std::make_shared<const Prim>(
            Prim{dnnl::matmul(pd), a, packed, c, pd.scratchpad_desc(), b, dnnl::reorder(rd)});
      }
    }
    try {
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, opsutil::dnnl_engine());
      return std::make_shared<const Prim>(
          Prim{dnnl::matmul(pd), a, b, c, pd.scratchpad_desc(), {}, {}});
    } catch (const dnnl::error& e) {
      if (!bf16) throw;  // the caller falls back to OpenBLAS
      fail(ErrorKind::Unsupported,
           std::string("bf16 matrix products are not available on this CPU (oneDNN: ") + e.what() +
               "); they need AVX-512 (fast with AVX512-BF16 or AMX): use fp32 precision");
    }
  });
}

// GRAFT_GEMM=openblas: every float32 GEMM on OpenBLAS (Note [float32 GEMM backend]; any other
// value, "dnnl" included, is the default).
bool sgemm_openblas_only() {
  static const bool c = [] {
    const char* v = std::getenv("GRAFT_GEMM");
    return v && std::strcmp(v, "openblas") == 0;
  }();
  return c;
}

// The primitive's scratchpad, per thread, grown as needed and kept (Note [float32 GEMM backend]).
thread_local std::unique_ptr<char[]> t_scratch;
thread_local size_t t_scratch_n = 0;
}  // namespace

Bf16MatmulScope::Bf16MatmulScope(bool bf16) : prev_(t_bf16) { t_bf16 = bf16; }
Bf16MatmulScope::~Bf16MatmulScope() { t_bf16 = prev_; }

bool bf16_matmul_native() {
  static const bool native = [] {
    const auto isa = dnnl::get_effective_cpu_isa();
    return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
  }();
  return native;
}

namespace opsutil {

dnnl::engine& dnnl_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

bool bf16_gemm_active() { return t_bf16; }

void round_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  constexpr int64_t kRow = 4096;  // rows of to_bf16's parallel loop
  const int64_t rows = n / kRow;
  if (rows) to_bf16(src, rows, kRow, kRow, dst);
  if (n % kRow) to_bf16(src + rows * kRow, 1, n % kRow, n % kRow, dst + rows * kRow);
}

void round_to_bf16_here(const float* src, int64_t n, uint16_t* dst) {
  if (bf16_convert_avx())
    row_to_bf16_avx(src, n, dst);
  else
    row_to_bf16(src, n, dst);
}

void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  parallel_for(n, 1, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = bf16_to_float(src[i]);
  });
}

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  gemm_bf16_mixed(ta, tb, M, N, K, alpha, A, false, lda, B, false, ldb, beta, C, ldc);
}

void gemm_bf16_mixed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                     bool a16, int64_t lda, const void* B, bool b16, int64_t ldb, float beta,
                     float* C, int64_t ldc) {
  // Stored shapes: A is M x K (K x M when transposed) with row stride lda; B likewise.
  const int64_t ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
  const auto* af = static_cast<const float*>(A);
  const auto* bf = static_cast<const float*>(B);
  const auto* ah = static_cast<const uint16_t*>(A);
  const auto* bh = static_cast<const uint16_t*>(B);
  if (M * N * K < (int64_t{1} << 18)) {
    // Small products (a oneDNN call costs microseconds, more than the product): the same
    // arithmetic, bfloat16-rounded operands and float32 accumulation, through OpenBLAS.
    std::vector<float> a(static_cast<size_t>(ra * ca)), b(static_cast<size_t>(rb * cb));
    // An operand as dense float32 holding its bfloat16 values (rounded here, or stored so).
    auto widen = [](const void* src, bool is16, int64_t rows, int64_t cols, int64_t ld,
                    float* dst) {
      std::vector<uint16_t> rounded;
      const uint16_t* h = static_cast<const uint16_t*>(src);
      if (!is16) {
        rounded.resize(static_cast<size_t>(rows * cols));
        to_bf16(static_cast<const float*>(src), rows, cols, ld, rounded.data());
        h = rounded.data(), ld = cols;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = bf16_to_float(h[r * ld + c]);
    };
    widen(A, a16, ra, ca, lda, a.data());
    widen(B, b16, rb, cb, ldb, b.data());
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha,
                a.data(), static_cast<blasint>(ca), b.data(), static_cast<blasint>(cb), beta, C,
                static_cast<blasint>(ldc));
    return;
  }
  // Note [bf16 operand scratch]: the rounded operands and oneDNN's scratchpad in one block per
  // call, from the block cache; an operand whose copy would pass kBf16PanelBytes is rounded a panel
  // at a time (rows of C for A, columns of C for B), the other once. A bfloat16 operand (Note [bf16
  // operands]) is used in place, with its own leading dimension, and needs no copy.
  int64_t pm = M, pn = N;
  const auto panel = [](int64_t whole, int64_t per) {
    const int64_t fit = static_cast<int64_t>(kBf16PanelBytes / 2) / per;
    return std::min(whole, std::max<int64_t>(64, fit / 64 * 64));
  };
  const bool copy_a = !a16 && static_cast<size_t>(M * K) * 2 > kBf16PanelBytes;
  const bool copy_b = !b16 && static_cast<size_t>(K * N) * 2 > kBf16PanelBytes;
  if (copy_a && (M * K >= K * N || !copy_b))
    pm = panel(M, K);
  else if (copy_b)
    pn = panel(N, K);
  // The primitive of an m x n block: a bfloat16 operand in place (its own leading dimension), a
  // rounded one as its dense copy.
  const auto prim = [&](int64_t m, int64_t n) {
    const int64_t la = a16 ? lda : (ta ? m : K), lb = b16 ? ldb : (tb ? K : n);
    return primitive(ta, tb, m, n, K, la, lb, ldc, alpha, beta, true);
  };
  size_t pad = prim(pm, pn)->scratch.get_size();
  if (M % pm) pad = std::max(pad, prim(M % pm, N)->scratch.get_size());
  if (N % pn) pad = std::max(pad, prim(M, N % pn)->scratch.get_size());
  const auto round_up = [](size_t n) { return (n + 63) & ~size_t{63}; };
  const size_t a_bytes = a16 ? 0 : round_up(static_cast<size_t>(pm * K) * 2),
               b_bytes = b16 ? 0 : round_up(static_cast<size_t>(K * pn) * 2);
  const size_t need = a_bytes + b_bytes + pad;
  std::optional<ScratchBlock> block;
  char* base;
  if (need <= kSmallScratchBytes) {  // this thread's own small buffer, reused
    struct AlignedDelete {
      void operator()(char* p) const { ::operator delete[](p, std::align_val_t(64)); }
    };
    thread_local std::unique_ptr<char[], AlignedDelete> t_small;
    if (!t_small) t_small.reset(new (std::align_val_t(64)) char[kSmallScratchBytes]);
    base = t_small.get();
  } else {
    block.emplace(need);
    base = static_cast<char*>(block->data());
  }
  auto* a = reinterpret_cast<uint16_t*>(base);
  auto* b = reinterpret_cast<uint16_t*>(base + a_bytes);
  auto& eng = opsutil::dnnl_engine();
  dnnl::stream s(eng);
  if (!a16 && pm == M) to_bf16(af, ra, ca, lda, a);
  if (!b16 && pn == N) to_bf16(bf, rb, cb, ldb, b);
  for (int64_t m0 = 0; m0 < M; m0 += pm) {
    const int64_t m = std::min(pm, M - m0);
    if (pm < M) to_bf16(ta ? af + m0 : af + m0 * lda, ta ? K : m, ta ? m : K, lda, a);
    for (int64_t n0 = 0; n0 < N; n0 += pn) {
      const int64_t n = std::min(pn, N - n0);
      if (pn < N) to_bf16(tb ? bf + n0 * ldb : bf + n0, tb ? n : K, tb ? K : n, ldb, b);
      const std::shared_ptr<const Prim> p = prim(m, n);
      void* pa = a16 ? const_cast<uint16_t*>(ah) : a;
      void* pb = b16 ? const_cast<uint16_t*>(bh) : b;
      dnnl::memory ma(p->a, eng, pa), mb(p->b, eng, pb), mc(p->c, eng, C + m0 * ldc + n0),
          ms(p->scratch, eng, base + a_bytes + b_bytes);
      p->mm.execute(s, {{DNNL_ARG_SRC, ma},
                        {DNNL_ARG_WEIGHTS, mb},
                        {DNNL_ARG_DST, mc},
                        {DNNL_ARG_SCRATCHPAD, ms}});
    }
  }
  s.wait();
}

bool gemm_f32_dnnl(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const int64_t macs = M * N * K;
  if (sgemm_openblas_only() || macs < (int64_t{1} << 18)) return false;
  // Note [a ragged N]: large products with B not transposed and N not a multiple of 16.
  if (!tb && N % 16 != 0 && macs >= (int64_t{1} << 31)) return false;
  std::shared_ptr<const Prim> p;
  try {
    p = primitive(ta, tb, M, N, K, lda, ldb, ldc, alpha, beta, false);
  } catch (const dnnl::error&) {
    return false;  // no float32 matmul for this CPU or layout: OpenBLAS runs it
  }
  const size_t need = p->scratch.get_size();
  if (need > t_scratch_n) {
    t_scratch.reset(new char[need]);
    t_scratch_n = need;
  }
  auto& eng = opsutil::dnnl_engine();
  dnnl::stream s(eng);
  std::optional<ScratchBlock> packed;
  dnnl::memory mb;
  if (p->pack) {
    packed.emplace(p->b.get_size());
    mb = dnnl::memory(p->b, eng, packed->data());
    dnnl::memory user(p->b_user, eng, const_cast<float*>(B));
    p->pack.execute(s, user, mb);
  } else {
    mb = dnnl::memory(p->b, eng, const_cast<float*>(B));
  }
  dnnl::memory ma(p->a, eng, const_cast<float*>(A)), mc(p->c, eng, C),
      ms(p->scratch, eng, t_scratch.get());
  p->mm.execute(
      s,
      {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_SCRATCHPAD, ms}});
  s.wait();
  return true;
}

size_t dnnl_gemm_primitives() { return primitives().size(); }

}  // namespace opsutil
}  // namespace graft
