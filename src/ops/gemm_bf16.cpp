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
#include <cblas.h>
#include <immintrin.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>

#include "graft/ops.h"
#include "util.h"

namespace graft {

namespace {
thread_local bool t_bf16 = false;
// The bf16 copies of the current product's operands: grown as needed and reused by every product
// of the scope (no allocation, page faults or zeroing per call), freed when the outermost scope
// ends (the end of a forward or a backward).
struct Scratch {
  std::unique_ptr<uint16_t[]> p;
  size_t n = 0;
  uint16_t* get(size_t want) {
    if (want > n) {
      p.reset(new uint16_t[want]);
      n = want;
    }
    return p.get();
  }
};
thread_local Scratch t_a, t_b;

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
// and flushes float32 denormals to zero).
__attribute__((target("avx512f,avx512bf16"))) void row_to_bf16_avx(const float* s, int64_t n,
                                                                   uint16_t* d) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + c));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + c), reinterpret_cast<__m256i&>(v));
  }
  row_to_bf16(s + c, n - c, d + c);
}

// `rows` x `cols` from a row stride of `ld` into a dense buffer.
void to_bf16(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst) {
  static const bool avx = __builtin_cpu_supports("avx512bf16");
  opsutil::parallel_for(rows, 2 * cols, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (avx)
        row_to_bf16_avx(src + r * ld, cols, dst + r * cols);
      else
        row_to_bf16(src + r * ld, cols, dst + r * cols);
    }
  });
}

using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int64_t, float, float>;
struct Prim {
  dnnl::matmul mm;
  dnnl::memory::desc a, b, c;
};

Prim& primitive(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t ldc, float alpha,
                float beta) {
  static std::mutex mu;
  static std::map<Key, Prim> cache;
  std::lock_guard<std::mutex> lk(mu);
  const Key key{M, N, K, ta, tb, ldc, alpha, beta};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  using dt = dnnl::memory::data_type;
  // The bf16 copies are dense: op(A) is M x K stored as M x K (or K x M when transposed), and
  // likewise op(B); strides express the transposition, so no transposing copy is made.
  dnnl::memory::desc a({M, K}, dt::bf16, ta ? dnnl::memory::dims{1, M} : dnnl::memory::dims{K, 1});
  dnnl::memory::desc b({K, N}, dt::bf16, tb ? dnnl::memory::dims{1, K} : dnnl::memory::dims{N, 1});
  dnnl::memory::desc c({M, N}, dt::f32, dnnl::memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.f) attr.set_output_scales(0, {alpha});
  if (beta != 0.f) {
    dnnl::post_ops po;
    po.append_sum(beta);
    attr.set_post_ops(po);
  }
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), attr, opsutil::dnnl_engine());
    return cache.emplace(key, Prim{dnnl::matmul(pd), a, b, c}).first->second;
  } catch (const dnnl::error& e) {
    fail(ErrorKind::Unsupported,
         std::string("bf16 matrix products are not available on this CPU (oneDNN: ") + e.what() +
             "); they need AVX-512 (fast with AVX512-BF16 or AMX): use fp32 precision");
  }
}
}  // namespace

Bf16MatmulScope::Bf16MatmulScope(bool bf16) : prev_(t_bf16) { t_bf16 = bf16; }
Bf16MatmulScope::~Bf16MatmulScope() {
  t_bf16 = prev_;
  if (!prev_) t_a = Scratch(), t_b = Scratch();
}

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

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // Stored shapes: A is M x K (K x M when transposed) with row stride lda; B likewise.
  const int64_t ra = ta ? K : M, ca = ta ? M : K, rb = tb ? N : K, cb = tb ? K : N;
  if (M * N * K < (int64_t{1} << 18)) {
    // Small products (a oneDNN call costs microseconds, more than the product): the same
    // arithmetic, bfloat16-rounded operands and float32 accumulation, through OpenBLAS.
    std::vector<float> a(static_cast<size_t>(ra * ca)), b(static_cast<size_t>(rb * cb));
    auto round = [](const float* src, int64_t rows, int64_t cols, int64_t ld, float* dst) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint32_t x = static_cast<uint32_t>(bf16_bits(src[r * ld + c])) << 16;
          std::memcpy(dst + r * cols + c, &x, 4);
        }
    };
    round(A, ra, ca, lda, a.data());
    round(B, rb, cb, ldb, b.data());
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha,
                a.data(), static_cast<blasint>(ca), b.data(), static_cast<blasint>(cb), beta, C,
                static_cast<blasint>(ldc));
    return;
  }
  Prim& p = primitive(ta, tb, M, N, K, ldc, alpha, beta);
  uint16_t* a = t_a.get(static_cast<size_t>(M * K));
  uint16_t* b = t_b.get(static_cast<size_t>(K * N));
  to_bf16(A, ra, ca, lda, a);
  to_bf16(B, rb, cb, ldb, b);
  dnnl::stream s(opsutil::dnnl_engine());
  dnnl::memory ma(p.a, opsutil::dnnl_engine(), a), mb(p.b, opsutil::dnnl_engine(), b),
      mc(p.c, opsutil::dnnl_engine(), C);
  p.mm.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  s.wait();
}

}  // namespace opsutil
}  // namespace graft
