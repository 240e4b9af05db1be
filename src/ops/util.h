// Helpers shared by the op families: dtype dispatch, numpy-style broadcasting, the GEMM entry
// point. Internal to src/ops (not installed); the loops split over graft's threads with
// parallel_for (graft/parallel.h).
#pragma once

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>

#include "graft/ops.h"
#include "graft/parallel.h"

namespace dnnl {
struct engine;
}

namespace graft::opsutil {

// Numpy/ONNX multidirectional broadcast of two shapes; empty optional on mismatch.
bool broadcast_shape(const Shape& a, const Shape& b, Shape& out);
// Infers the broadcast of all (present) inputs; errors name the node.
Shape broadcast_all(InferCtx& c, int first = 0, int last = -1);

// Strides (in elements) of `in` broadcast to `out` (0 along broadcast dims), rank of `out`.
std::vector<int64_t> bcast_strides(const Shape& in, const Shape& out);

// Calls f(out_index, in_offsets...) for every output element; inputs given by broadcast strides.
// Collapses to a flat loop when every input already has the output's shape.
template <int N, class F>
void for_each_bcast(const Shape& out, const std::array<std::vector<int64_t>, N>& strides, F&& f) {
  const int r = static_cast<int>(out.size());
  const int64_t total = numel(out);
  if (total == 0) return;
  if (r == 0) {
    std::array<int64_t, N> off{};
    f(0, off);
    return;
  }
  std::vector<int64_t> idx(r, 0);
  std::array<int64_t, N> off{};
  const int64_t inner = out[r - 1];
  std::array<int64_t, N> inner_stride;
  for (int k = 0; k < N; ++k) inner_stride[k] = strides[k][r - 1];
  for (int64_t o = 0; o < total; o += inner) {
    std::array<int64_t, N> base{};
    for (int k = 0; k < N; ++k) {
      int64_t b = 0;
      for (int d = 0; d < r - 1; ++d) b += idx[d] * strides[k][d];
      base[k] = b;
    }
    for (int64_t i = 0; i < inner; ++i) {
      for (int k = 0; k < N; ++k) off[k] = base[k] + i * inner_stride[k];
      f(o + i, off);
    }
    for (int d = r - 2; d >= 0; --d) {
      if (++idx[d] < out[d]) break;
      idx[d] = 0;
    }
  }
}

// Splits `shape` around [axis_begin, axis_end) into (outer, mid, inner) element counts.
inline void split3(const Shape& s, int a0, int a1, int64_t& outer, int64_t& mid, int64_t& inner) {
  outer = mid = inner = 1;
  for (int i = 0; i < static_cast<int>(s.size()); ++i)
    (i < a0 ? outer : i < a1 ? mid : inner) *= s[i];
}

// Calls f.template operator()<T>() with T the C++ type of dt.
template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32:
      f.template operator()<float>();
      break;
    case DType::F64:
      f.template operator()<double>();
      break;
    case DType::I64:
      f.template operator()<int64_t>();
      break;
    case DType::Bool:
      f.template operator()<bool>();
      break;
    case DType::I32:
      f.template operator()<int32_t>();
      break;
    case DType::BF16:  // Note [bf16 operands], [bf16 activations]: only the kernels that read
                       // them on purpose (products, convolutions, BatchNorm, ReluGrad) and views
      fail(ErrorKind::Internal, "a bfloat16 operand reached a kernel that does not read bfloat16");
  }
}
// Calls f.template operator()<T>() for an integer dtype (int64, int32); false for others.
template <class F>
bool dispatch_int(DType dt, F&& f) {
  if (dt == DType::I64)
    f.template operator()<int64_t>();
  else if (dt == DType::I32)
    f.template operator()<int32_t>();
  else
    return false;
  return true;
}
template <class F>
void dispatch_float(DType dt, const KernelCtx& c, F&& f) {
  switch (dt) {
    case DType::F32:
      f.template operator()<float>();
      break;
    case DType::F64:
      f.template operator()<double>();
      break;
    default:
      c.error(ErrorKind::Unsupported,
              std::string("dtype ") + dtype_name(dt) + " is not supported by this op");
  }
}

// Sums `in` (shape `from`) into `out` (shape `to`), where `from` is `to` broadcast. Adds when
// `accumulate`, else overwrites.
template <class T>
void sum_to_shape(const T* in, const Shape& from, T* out, const Shape& to, bool accumulate);

// The one GEMM entry point of the op families (src/ops/linalg.cpp: OpenBLAS):
// C(M,N) = alpha * op(A) op(B) + beta * C, row-major, natural leading dimensions.
template <class T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, const T* B,
          T beta, T* C);
// The same with explicit leading dimensions (sub-matrices of wider row-major buffers).
template <class T>
void gemm_ld(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda,
             const T* B, int64_t ldb, T beta, T* C, int64_t ldc);

// Note [bf16 GEMMs] (gemm_dnnl.cpp): whether this thread is in a Bf16MatmulScope, and the float32
// GEMM that rounds its operands to bfloat16 (what gemm_ld runs then).
bool bf16_gemm_active();
// The process's oneDNN CPU engine (gemm_dnnl.cpp), shared by the bf16 GEMMs and the convolutions.
dnnl::engine& dnnl_engine();
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
               int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Note [bf16 operands]: the same product with either operand (or both) already bfloat16 (A16 /
// B16: A or B points at uint16_t bits, used in place with its leading dimension; a float32
// operand is rounded as gemm_bf16 rounds it). Runs in bf16 whatever the scope.
void gemm_bf16_mixed(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                     bool a16, int64_t lda, const void* B, bool b16, int64_t ldb, float beta,
                     float* C, int64_t ldc);
// A product's operand as a kernel finds it: float32 / float64, or (Note [bf16 operands])
// bfloat16 bits the plan stored.
struct GemmOperand {
  const char* p;
  bool bf16;
  size_t elem;
  explicit GemmOperand(const Tensor& t)
      : p(static_cast<const char*>(t.raw())),
        bf16(t.dtype() == DType::BF16),
        elem(dtype_size(t.dtype())) {}
  template <class T>
  explicit GemmOperand(const T* x)
      : p(reinterpret_cast<const char*>(x)), bf16(false), elem(sizeof(T)) {}
  const void* at(int64_t i) const { return p + static_cast<size_t>(i) * elem; }
};
// gemm_ld on operands at element offsets oa / ob: gemm_bf16_mixed when either is bfloat16.
template <class T>
void gemm_operands(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const GemmOperand& A,
                   int64_t oa, int64_t lda, const GemmOperand& B, int64_t ob, int64_t ldb, T beta,
                   T* C, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (A.bf16 || B.bf16)
      return gemm_bf16_mixed(ta, tb, M, N, K, alpha, A.at(oa), A.bf16, lda, B.at(ob), B.bf16, ldb,
                             beta, C, ldc);
  }
  gemm_ld<T>(ta, tb, M, N, K, alpha, static_cast<const T*>(A.at(oa)), lda,
             static_cast<const T*>(B.at(ob)), ldb, beta, C, ldc);
}
// n float32 values to bfloat16 bits, rounded to nearest even exactly as the bf16 GEMMs round
// their operands (threaded).
void round_to_bf16(const float* src, int64_t n, uint16_t* dst);
// The same on the calling thread (the same bits: every element takes one rounding instruction,
// wherever it sits): for kernels that write a bfloat16 output block by block (Note [bf16 writers]).
void round_to_bf16_here(const float* src, int64_t n, uint16_t* dst);
// A bfloat16 value (the top 16 bits of a float32) as float32: exact.
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Note [bf16 activations]: a bfloat16 operand read element by element as float32, with the
// indexing and offsets of a `const float*`, so that one template loop serves both.
struct Bf16Ptr {
  const uint16_t* p;
  float operator[](int64_t i) const { return bf16_to_float(p[i]); }
  Bf16Ptr operator+(int64_t o) const { return {p + o}; }
};
// Calls fn with X's elements as the kernel's T: a `const T*`, or a Bf16Ptr where X is a bfloat16
// activation (Note [bf16 activations]; only float32 kernels take one).
template <class T, class Fn>
void with_x_reader(KernelCtx& c, const Tensor& x, Fn&& fn) {
  if (x.dtype() != DType::BF16) return fn(x.data<T>());
  if constexpr (std::is_same_v<T, float>)
    fn(Bf16Ptr{x.data<uint16_t>()});
  else
    c.error(ErrorKind::Internal, "a bfloat16 X in float64 arithmetic");
}
// n bfloat16 values widened to float32 (threaded; exact).
void widen_bf16(const uint16_t* src, int64_t n, float* dst);
// Note [float32 GEMM backend] (gemm_dnnl.cpp): runs a float32 GEMM on oneDNN's matmul primitive
// and returns true, or returns false (the size or GRAFT_GEMM says OpenBLAS) without touching C.
bool gemm_f32_dnnl(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                   int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// How many GEMM primitives are cached now (Note [primitive caches], lru.h; for the tests).
size_t dnnl_gemm_primitives();

// Broadcasting by rows: the output's dims collapsed (size-1 dims dropped, neighbours merged where
// every input is contiguous across them) into outer dims and one inner dim, along which each
// input's stride is 0 (broadcast) or 1. Kernels then run plain loops over row segments.
template <int N>
struct BcastRows {
  int64_t total = 0, inner = 1;
  std::vector<int64_t> dims;               // collapsed outer dims (outermost first)
  std::array<std::vector<int64_t>, N> st;  // per input, stride of each outer dim
  std::array<int64_t, N> ist{};            // per input, stride along the inner dim (0 or 1)
};
template <int N>
BcastRows<N> bcast_rows(const Shape& out, const std::array<const Shape*, N>& in) {
  BcastRows<N> p;
  p.total = numel(out);
  std::array<std::vector<int64_t>, N> full;
  for (int k = 0; k < N; ++k) full[k] = bcast_strides(*in[k], out);
  std::vector<int64_t> dims;  // innermost first while collecting
  std::array<std::vector<int64_t>, N> st;
  for (int d = static_cast<int>(out.size()) - 1; d >= 0; --d) {
    if (out[d] == 1) continue;
    bool merge = !dims.empty();
    for (int k = 0; k < N && merge; ++k) merge = full[k][d] == st[k].back() * dims.back();
    if (merge) {
      dims.back() *= out[d];
    } else {
      dims.push_back(out[d]);
      for (int k = 0; k < N; ++k) st[k].push_back(full[k][d]);
    }
  }
  if (dims.empty()) return p;  // one element
  p.inner = dims.front();
  for (int k = 0; k < N; ++k) {
    p.ist[k] = st[k].front();
    p.st[k].assign(st[k].rbegin(), st[k].rend() - 1);
  }
  p.dims.assign(dims.rbegin(), dims.rend() - 1);
  return p;
}
// Calls seg(out_offset, in_offsets, len) over row segments covering the output, in parallel
// (work: element operations per output element); inputs advance by ist[k] along a segment.
template <int N, class F>
void for_each_row(const BcastRows<N>& p, int64_t work, F&& seg) {
  parallel_blocks(p.total, work, [&](int, int64_t b, int64_t e) {
    const int nd = static_cast<int>(p.dims.size());
    int64_t row = b / p.inner, j = b % p.inner;
    std::vector<int64_t> idx(nd);
    std::array<int64_t, N> off{};
    for (int d = nd - 1; d >= 0; --d) {
      idx[d] = row % p.dims[d];
      row /= p.dims[d];
      for (int k = 0; k < N; ++k) off[k] += idx[d] * p.st[k][d];
    }
    for (int64_t pos = b; pos < e;) {
      const int64_t len = std::min(p.inner - j, e - pos);
      std::array<int64_t, N> o;
      for (int k = 0; k < N; ++k) o[k] = off[k] + j * p.ist[k];
      seg(pos, o, len);
      pos += len;
      j = 0;
      for (int d = nd - 1; d >= 0; --d) {
        for (int k = 0; k < N; ++k) off[k] += p.st[k][d];
        if (++idx[d] < p.dims[d]) break;
        for (int k = 0; k < N; ++k) off[k] -= idx[d] * p.st[k][d];
        idx[d] = 0;
      }
    }
  });
}

// GRAFT_ISA_CLONES, GRAFT_INLINE: Note [ISA clones], graft/parallel.h.

// Sums f(i) over [0, n) in double with 8 independent partial sums (vectorizable; the order is
// fixed, so results do not depend on the thread count).
template <class F>
GRAFT_INLINE double sum8(int64_t n, F&& f) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += f(i + j);
  for (; i < n; ++i) acc[0] += f(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Calls f.template operator()<T>() for a numeric dtype: int64, int32, float32 or float64 (bool is
// an Unsupported error naming the node).
template <class F>
void dispatch_numeric(DType dt, const KernelCtx& c, F&& f) {
  if (!dispatch_int(dt, f)) dispatch_float(dt, c, f);
}

// normalize_axis (graft/ops.h), except that a scalar's axis 0 is accepted too, as its one element
// (Softmax, LogSoftmax, LayerNormalization and the reductions take it).
inline int normalize_axis_scalar_ok(int64_t axis, int rank, const Node& n) {
  return rank == 0 && axis == 0 ? 0 : normalize_axis(axis, rank, n);
}

// Shape check helper for the shape functions.
inline void require_float(InferCtx& c, int i) {
  if (!is_float(c.dtype(i)))
    c.error(ErrorKind::Unsupported, std::string("input '") + c.in(i).name + "' has dtype " +
                                        dtype_name(c.dtype(i)) +
                                        "; this op needs float32 or float64");
}

// Note [bf16 operands]: whether any of the product operands at inputs [first, first + n) is a
// bfloat16 operand the plan stored; then the product computes in float32 and the others must be
// float32 or bfloat16 (an error otherwise). False: the op's own dtype rule applies.
inline bool bf16_operands(InferCtx& c, int first, int n) {
  bool any = false, ok = true;
  for (int i = first; i < first + n; ++i) {
    any |= c.dtype(i) == DType::BF16;
    ok &= c.dtype(i) == DType::BF16 || c.dtype(i) == DType::F32;
  }
  if (any) c.check(ok, "a bfloat16 operand multiplies only float32 or bfloat16 ones");
  return any;
}
// Note [bf16 activations]: input i is float32 / float64, or a bfloat16 value the plan stored,
// which the kernel reads as float32: the dtype the op computes in.
inline DType float_or_bf16(InferCtx& c, int i) {
  if (c.dtype(i) == DType::BF16) return DType::F32;
  require_float(c, i);
  return c.dtype(i);
}
// The same on a kernel's inputs (the shape function checked the rest): the dtype it computes in.
inline DType operands_dtype(const KernelCtx& c, int first, int n) {
  for (int i = first; i < first + n; ++i)
    if (c.in(i).dtype() == DType::BF16) return DType::F32;
  return c.in(first).dtype();
}

// Input i must be numeric: an integer or float32 / float64.
inline void require_numeric(InferCtx& c, int i) {
  if (!is_int(c.dtype(i))) require_float(c, i);
}

// ONNX TensorProto element-type code of a dtype (Cast's `to`).
int onnx_dtype_code_of(DType d);

// Shape function: output 0 has input 0's dtype and shape.
void infer_same(InferCtx& c);

// For the cost functions (OpDef::flops): the elements of all the node's outputs, and the shape of
// its input i.
double output_elements(const Graph& g, const Node& n);
inline const Shape& input_shape(const Graph& g, const Node& n, int i) {
  return g.values[n.inputs[i]].shape;
}

// graft's counter-based random stream (Dropout, attention's dropout): element i of a stream
// `base` is splitmix64(base + i * golden), a function of its position alone, so threads draw any
// range of it independently and a backward draws the forward's bits again.
inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ULL;
// A random node's stream, from its seed attribute and its name (fixed when the node is prepared),
// and where that stream starts in a run with seed `run_seed`.
inline uint64_t node_stream(int64_t seed_attr, const std::string& name) {
  return static_cast<uint64_t>(seed_attr) * 1000003u + std::hash<std::string>{}(name);
}
inline uint64_t stream_base(uint64_t run_seed, uint64_t stream) {
  return splitmix64(run_seed * kGolden + stream);
}
// Element i of stream `base`, as 53 random bits.
inline uint64_t bits53_at(uint64_t base, uint64_t i) {
  return splitmix64(base + i * kGolden) >> 11;
}
inline constexpr double kTwo53 = 9007199254740992.0;
// Element i as a uniform draw from [0, 1).
inline double uniform_at(uint64_t base, uint64_t i) {
  return static_cast<double>(bits53_at(base, i)) / kTwo53;
}
// Element i's keep decision for a drop probability p: its 53 bits at least p * 2^53.
inline uint64_t keep_threshold(double p) { return static_cast<uint64_t>(p * kTwo53); }
inline bool keep_at(uint64_t base, uint64_t i, uint64_t threshold) {
  return bits53_at(base, i) >= threshold;
}

}  // namespace graft::opsutil
