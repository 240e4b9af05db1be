// Helpers shared by the op families: dtype dispatch and numpy-style broadcasting.
// Internal to src/ops (not installed).
#pragma once

#include <algorithm>
#include <cstring>
#include <thread>

#include "graft/ops.h"

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

// Threads for the op families' own loops (per channel, per plane): num_threads(), at least one.
inline int max_threads() { return std::max(1, num_threads()); }
// Splits [0, n) into up to max_threads() contiguous ranges and runs f(thread, begin, end) on each,
// the calling thread taking the first; fewer threads when n * work_per_item (element operations)
// is small (below ~64k a thread costs more than it saves). For loops between GEMMs, never around
// them: OpenBLAS runs its own threads inside each GEMM.
template <class F>
void parallel_for(int64_t n, int64_t work_per_item, F&& f) {
  const int t = static_cast<int>(
      std::min<int64_t>({max_threads(), n, std::max<int64_t>(1, n * work_per_item / 65536)}));
  if (t <= 1) {
    if (n > 0) f(0, int64_t{0}, n);
    return;
  }
  std::vector<std::thread> th;
  th.reserve(t - 1);
  for (int i = 1; i < t; ++i) th.emplace_back([&f, i, n, t] { f(i, n * i / t, n * (i + 1) / t); });
  f(0, int64_t{0}, n / t);
  for (auto& x : th) x.join();
}

// Sums f(i) over [0, n) in double with 8 independent partial sums (vectorizable; the order is
// fixed, so results do not depend on the thread count).
template <class F>
double sum8(int64_t n, F&& f) {
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

// Shape check helper for the shape functions.
inline void require_float(InferCtx& c, int i) {
  if (!is_float(c.dtype(i)))
    c.error(ErrorKind::Unsupported, std::string("input '") + c.in(i).name + "' has dtype " +
                                        dtype_name(c.dtype(i)) +
                                        "; this op needs float32 or float64");
}

// Input i must be numeric: an integer or float32 / float64.
inline void require_numeric(InferCtx& c, int i) {
  if (!is_int(c.dtype(i))) require_float(c, i);
}

// ONNX TensorProto element-type code of a dtype (Cast's `to`).
int onnx_dtype_code_of(DType d);

// Shape function: output 0 has input 0's dtype and shape.
void infer_same(InferCtx& c);

}  // namespace graft::opsutil
