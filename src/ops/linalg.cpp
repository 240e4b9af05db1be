// Matrix products: Gemm, MatMul (batched, broadcasting) and graft's FusedMatMul (MatMul with
// transposes, used by gradients); Einsum is in einsum.cpp. All GEMMs go through gemm() below, one
// place to pick a backend.
#include <cblas.h>

#include <functional>

#include "util.h"

namespace graft {
namespace opsutil {
// C(M,N) = alpha * op(A) op(B) + beta * C, row-major, explicit leading dimensions.
template <class T>
void gemm_ld(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
             const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  const auto TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
  const auto la = static_cast<blasint>(lda), lb = static_cast<blasint>(ldb);
  const auto lc = static_cast<blasint>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_gemm_active()) return gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    if (gemm_f32_dnnl(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
    cblas_sgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, la, B, lb, beta, C, lc);
  } else {
    cblas_dgemm(CblasRowMajor, TA, TB, M, N, K, alpha, A, la, B, lb, beta, C, lc);
  }
}
// The natural leading dimensions.
template <class T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B,
          T beta, T* C) {
  gemm_ld(ta, tb, M, N, K, alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
}
template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, const float*,
                          float, float*);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                           const double*, double, double*);
template void gemm_ld<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                             const float*, int64_t, float, float*, int64_t);
template void gemm_ld<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                              const double*, int64_t, double, double*, int64_t);
}  // namespace opsutil

namespace {
using namespace opsutil;

// Gemm's, MatMul's and FusedMatMul's attributes (MatMul has none: the defaults).
struct GemmAttrs {
  bool ta = false, tb = false;     // transA, transB
  double alpha = 1.0, beta = 1.0;  // Gemm only
};
GemmAttrs gemm_attrs(const Node& n) {
  const std::string where = n.label();
  return {n.attrs.get_int("transA", 0, where) != 0, n.attrs.get_int("transB", 0, where) != 0,
          n.attrs.get_float("alpha", 1.0, where), n.attrs.get_float("beta", 1.0, where)};
}
std::shared_ptr<const void> prepare_gemm(const Node& n) { return prepared(gemm_attrs(n)); }

// ---- Gemm ---------------------------------------------------------------------------------------
// A and B: both float32 or both float64, or (Note [bf16 operands]) float32 with a bfloat16 operand.
DType product_dtype(InferCtx& c, const char* differ) {
  if (bf16_operands(c, 0, 2)) return DType::F32;
  require_float(c, 0);
  c.check(c.dtype(1) == c.dtype(0), differ);
  return c.dtype(0);
}

void infer_gemm(InferCtx& c) {
  const DType dt = product_dtype(c, "A and B differ in dtype");
  c.check(c.shape(0).size() == 2 && c.shape(1).size() == 2, "A and B must be 2-D");
  const GemmAttrs a = gemm_attrs(c.node());
  const bool ta = a.ta, tb = a.tb;
  int64_t M = c.shape(0)[ta ? 1 : 0], K = c.shape(0)[ta ? 0 : 1];
  int64_t K2 = c.shape(1)[tb ? 1 : 0], N = c.shape(1)[tb ? 0 : 1];
  c.check(K == K2, "inner dimensions differ: A " + shape_str(c.shape(0)) + ", B " +
                       shape_str(c.shape(1)) + " (transA=" + std::to_string(ta) +
                       ", transB=" + std::to_string(tb) + ")");
  if (c.has_in(2)) {
    Shape out;
    c.check(broadcast_shape({M, N}, c.shape(2), out) && out == Shape{M, N},
            "C of shape " + shape_str(c.shape(2)) + " does not broadcast to " + shape_str({M, N}));
    c.check(c.dtype(2) == dt, "C differs in dtype");
  }
  c.set_out(0, dt, {M, N});
}

// C = alpha op(A) op(B) + beta C with natural leading dimensions, A and B at element offsets.
template <class T>
void product(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const GemmOperand& A,
             int64_t oa, const GemmOperand& B, int64_t ob, T beta, T* C) {
  gemm_operands<T>(ta, tb, M, N, K, alpha, A, oa, ta ? M : K, B, ob, tb ? K : N, beta, C, N);
}

void gemm_kernel(KernelCtx& c) {
  dispatch_float(operands_dtype(c, 0, 2), c, [&]<class T>() {
    const GemmAttrs& a = c.attrs<GemmAttrs>();
    const bool ta = a.ta, tb = a.tb;
    const T alpha = static_cast<T>(a.alpha), beta = static_cast<T>(a.beta);
    const Tensor &A = c.in(0), &B = c.in(1);
    Tensor& Y = c.out(0);
    int64_t M = Y.dim(0), N = Y.dim(1), K = A.dim(ta ? 0 : 1);
    T* y = Y.data<T>();
    T b = c.accumulate ? T(1) : T(0);
    if (c.accumulate && c.has_in(2)) c.error(ErrorKind::Internal, "accumulating a Gemm with C");
    if (c.has_in(2) && beta != T(0)) {
      const Tensor& C = c.in(2);
      const T* pc = C.data<T>();
      if (C.shape() == Y.shape()) {
        if (pc != y) std::copy(pc, pc + M * N, y);
      } else {
        auto st = bcast_strides(C.shape(), Y.shape());
        for_each_bcast<1>(Y.shape(), {st},
                          [&](int64_t i, const std::array<int64_t, 1>& o) { y[i] = pc[o[0]]; });
      }
      b = beta;
    }
    product<T>(ta, tb, M, N, K, alpha, GemmOperand(A), 0, GemmOperand(B), 0, b, y);
  });
}

void grad_gemm(GradBuilder& g) {
  const GemmAttrs at = gemm_attrs(g.node());
  const bool ta = at.ta, tb = at.tb;
  const double alpha = at.alpha, beta = at.beta;
  int dy = g.dy(0), A = g.x(0), B = g.x(1);
  auto gemm_node = [&](int a, int b, bool t1, bool t2) {
    Attrs x;
    x.set_int("transA", t1);
    x.set_int("transB", t2);
    if (alpha != 1.0) x.set_float("alpha", alpha);
    return g.emit1("Gemm", {a, b}, x);
  };
  if (g.needs(0)) g.set_dx(0, ta ? gemm_node(B, dy, tb, true) : gemm_node(dy, B, false, !tb));
  if (g.needs(1)) g.set_dx(1, tb ? gemm_node(dy, A, true, ta) : gemm_node(A, dy, !ta, false));
  if (g.node().inputs.size() > 2 && g.x(2) >= 0 && g.needs(2)) {
    int d = dy;
    if (beta != 1.0) d = g.emit1("Mul", {dy, g.scalar(beta, g.val(dy).dtype)});
    g.set_dx(2, d);
  }
}

// ---- MatMul / FusedMatMul -----------------------------------------------------------------------
// Shapes after numpy's 1-D promotion: a -> [..., M, K], b -> [..., K, N].
struct MMShapes {
  Shape batch;  // broadcast batch dims
  int64_t M, N, K;
  Shape out;
};
MMShapes mm_shapes(const Shape& sa0, const Shape& sb0, bool ta, bool tb,
                   const std::function<void(const std::string&)>& err) {
  Shape sa = sa0, sb = sb0;
  if (sa.empty() || sb.empty()) err("MatMul inputs must have rank >= 1");
  bool a1 = sa.size() == 1, b1 = sb.size() == 1;
  if (a1) sa.insert(sa.begin(), 1);
  if (b1) sb.push_back(1);
  if (ta) std::swap(sa[sa.size() - 1], sa[sa.size() - 2]);
  if (tb) std::swap(sb[sb.size() - 1], sb[sb.size() - 2]);
  MMShapes r;
  r.M = sa[sa.size() - 2];
  r.K = sa.back();
  r.N = sb.back();
  if (sb[sb.size() - 2] != r.K)
    err("inner dimensions differ: " + shape_str(sa0) + " x " + shape_str(sb0));
  Shape ba(sa.begin(), sa.end() - 2), bb(sb.begin(), sb.end() - 2);
  if (!broadcast_shape(ba, bb, r.batch))
    err("batch dimensions do not broadcast: " + shape_str(sa0) + " x " + shape_str(sb0));
  r.out = r.batch;
  if (!a1) r.out.push_back(r.M);
  if (!b1) r.out.push_back(r.N);
  return r;
}

void infer_matmul(InferCtx& c) {
  const DType dt = product_dtype(c, "inputs differ in dtype");
  const GemmAttrs a = gemm_attrs(c.node());
  auto r = mm_shapes(c.shape(0), c.shape(1), a.ta, a.tb,
                     [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
  c.set_out(0, dt, r.out);
}

void matmul_kernel(KernelCtx& c) {
  dispatch_float(operands_dtype(c, 0, 2), c, [&]<class T>() {
    const bool ta = c.attrs<GemmAttrs>().ta, tb = c.attrs<GemmAttrs>().tb;
    const Tensor &A = c.in(0), &B = c.in(1);
    auto r = mm_shapes(A.shape(), B.shape(), ta, tb,
                       [&](const std::string& m) { c.error(ErrorKind::ShapeMismatch, m); });
    T* y = c.out(0).data<T>();
    const T beta = c.accumulate ? T(1) : T(0);  // add into an existing .grad
    const GemmOperand pa(A), pb(B);
    const int64_t nb = numel(r.batch), MK = r.M * r.K, KN = r.K * r.N, MN = r.M * r.N;
    const bool a_batched = A.rank() > 2, b_batched = B.rank() > 2;
    // A batch of [M,K] against one [K,N]: a single GEMM with M' = batch*M.
    if (!b_batched && !ta &&
        (A.rank() <= 2 || numel(Shape(A.shape().begin(), A.shape().end() - 2)) == nb)) {
      product<T>(false, tb, nb * r.M, r.N, r.K, T(1), pa, 0, pb, 0, beta, y);
      return;
    }
    Shape sa = A.shape(), sb = B.shape();
    if (sa.size() == 1) sa.insert(sa.begin(), 1);
    if (sb.size() == 1) sb.push_back(1);
    Shape bsa(sa.begin(), sa.end() - 2), bsb(sb.begin(), sb.end() - 2);
    auto sta = bcast_strides(bsa, r.batch), stb = bcast_strides(bsb, r.batch);
    (void)a_batched;
    for_each_bcast<2>(r.batch, {sta, stb}, [&](int64_t i, const std::array<int64_t, 2>& o) {
      product<T>(ta, tb, r.M, r.N, r.K, T(1), pa, o[0] * MK, pb, o[1] * KN, beta, y + i * MN);
    });
    (void)nb;
  });
}

// Y = A B with broadcasting. dA = dY B^T summed to A's shape; dB = A^T dY likewise. 1-D operands
// are promoted to 2-D first (numpy rules) and the results reshaped back.
void grad_matmul(GradBuilder& g) {
  const GemmAttrs at = gemm_attrs(g.node());
  const bool ta = at.ta, tb = at.tb;
  int A = g.x(0), B = g.x(1), dy = g.dy(0);
  Shape sa = g.shape(A), sb = g.shape(B);
  bool a1 = sa.size() == 1, b1 = sb.size() == 1;
  if (a1) A = g.emit1("Reshape", {A, g.ints({1, sa[0]})});
  if (b1) B = g.emit1("Reshape", {B, g.ints({sb[0], 1})});
  if (a1 || b1) {
    Shape s2 = g.shape(dy);
    if (a1) s2.insert(s2.end() - (b1 ? 0 : 1), 1);
    if (b1) s2.push_back(1);
    dy = g.emit1("Reshape", {dy, g.ints(s2)});
  }
  auto fmm = [&](int a, int b, bool t1, bool t2) {
    Attrs x;
    x.set_int("transA", t1);
    x.set_int("transB", t2);
    return g.emit1("FusedMatMul", {a, b}, x, "graft");
  };
  if (g.needs(0)) {
    // op(A) = A^T if ta. d op(A) = dY op(B)^T.
    int d = ta ? fmm(B, dy, tb, true) : fmm(dy, B, false, !tb);
    if (a1)
      d = g.emit1(
          "SumToShape", {d},
          [&] {
            Attrs x;
            x.set_ints("shape", {1, sa[0]});
            return x;
          }(),
          "graft");
    g.set_dx(0, d);
  }
  if (g.needs(1) && sb.size() == 2 && sa.size() > 2 && !ta) {
    // A batch of rows against one weight (a Linear on [batch, seq, features]): one GEMM over all
    // rows gives the weight's gradient directly, with no per-batch partial products to sum.
    const int64_t k = sa.back(), rows = numel(sa) / std::max<int64_t>(k, 1);
    const int64_t n = g.shape(dy).back();
    int a2 = g.emit1("Reshape", {A, g.ints({rows, k})});
    int d2 = g.emit1("Reshape", {dy, g.ints({rows, n})});
    g.set_dx(1, tb ? fmm(d2, a2, true, false) : fmm(a2, d2, true, false));
  } else if (g.needs(1)) {
    int d = tb ? fmm(dy, A, true, ta) : fmm(A, dy, !ta, false);
    if (b1)
      d = g.emit1(
          "SumToShape", {d},
          [&] {
            Attrs x;
            x.set_ints("shape", {sb[0], 1});
            return x;
          }(),
          "graft");
    g.set_dx(1, d);
  }
}

// 2 * out * K: K from A's shape (and transA; Gemm's and FusedMatMul's, MatMul has none).
double matmul_flops(const Graph& g, const Node& n) {
  if (n.inputs.size() < 2 || input_shape(g, n, 0).empty()) return 0;
  const Shape& a = input_shape(g, n, 0);
  const bool ta = n.attrs.get_int("transA", 0) != 0;
  const int64_t k = a.size() >= 2 && ta ? a[a.size() - 2] : a.back();
  return 2 * output_elements(g, n) * static_cast<double>(k);
}

// ---- RoundToBf16 (graft) ------------------------------------------------------------------------
// Note [bf16 operands]: a float32 value to the bfloat16 bits a bf16 product would round it to.
void infer_round_bf16(InferCtx& c) {
  c.check(c.dtype(0) == DType::F32, "RoundToBf16 reads float32");
  c.set_out(0, DType::BF16, c.shape(0));
}
void round_bf16_kernel(KernelCtx& c) {
  round_to_bf16(c.in(0).data<float>(), c.in(0).numel(), c.out(0).data<uint16_t>());
}

const OpDef kOps[] = {
    {.name = "Gemm",
     .min_in = 2,
     .max_in = 3,
     .infer = infer_gemm,
     .prepare = prepare_gemm,
     .kernel = gemm_kernel,
     .grad = grad_gemm,
     .inplace_input = 2,
     .accumulate_out = true,
     .flops = matmul_flops},
    {.name = "MatMul",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_matmul,
     .prepare = prepare_gemm,
     .kernel = matmul_kernel,
     .grad = grad_matmul,
     .accumulate_out = true,
     .flops = matmul_flops},
    {.name = "FusedMatMul",
     .domain = "graft",
     .min_in = 2,
     .max_in = 2,
     .infer = infer_matmul,
     .prepare = prepare_gemm,
     .kernel = matmul_kernel,
     .grad = grad_matmul,
     .accumulate_out = true,
     .flops = matmul_flops},
    // Emitted by the planner's bf16-operand pass, after autodiff: no gradient.
    {.name = "RoundToBf16",
     .domain = "graft",
     .infer = infer_round_bf16,
     .kernel = round_bf16_kernel,
     .foldable = false,
     .pointwise = true,
     .blocked = blocked_elementwise},
};

}  // namespace

void register_linalg_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
