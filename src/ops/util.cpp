// Broadcasting helpers shared by the op families (see util.h).
#include "util.h"

#include <cstring>

namespace graft::opsutil {

bool broadcast_shape(const Shape& a, const Shape& b, Shape& out) {
  size_t r = std::max(a.size(), b.size());
  out.assign(r, 1);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    if (da == db || db == 1)
      out[i] = da;
    else if (da == 1)
      out[i] = db;
    else
      return false;
  }
  return true;
}

Shape broadcast_all(InferCtx& c, int first, int last) {
  if (last < 0) last = c.n_in();
  Shape out;
  bool any = false;
  for (int i = first; i < last; ++i) {
    if (!c.has_in(i)) continue;
    if (!any) {
      out = c.shape(i);
      any = true;
      continue;
    }
    Shape next;
    if (!broadcast_shape(out, c.shape(i), next))
      c.error(ErrorKind::ShapeMismatch, "cannot broadcast " + shape_str(out) + " with input '" +
                                            c.in(i).name + "' of shape " + shape_str(c.shape(i)));
    out = next;
  }
  return out;
}

std::vector<int64_t> bcast_strides(const Shape& in, const Shape& out) {
  const size_t r = out.size(), off = r - in.size();
  std::vector<int64_t> st(r, 0);
  int64_t s = 1;
  for (size_t i = in.size(); i-- > 0;) {
    st[i + off] = in[i] == 1 ? 0 : s;
    s *= in[i];
  }
  return st;
}

template <class T>
void sum_to_shape(const T* in, const Shape& from, T* out, const Shape& to, bool accumulate) {
  const int64_t n_out = numel(to);
  if (!accumulate) std::fill(out, out + n_out, T(0));
  // Fast path: `to` is a suffix of `from` (bias gradients): sum rows.
  size_t off = from.size() - to.size();
  bool suffix = true;
  for (size_t i = 0; i < to.size(); ++i) suffix &= to[i] == from[i + off];
  if (suffix) {
    // Parallel over column blocks; each column adds its rows in row order (thread-count free).
    const int64_t rows = n_out ? numel(from) / n_out : 0;
    parallel_blocks(
        n_out, rows,
        [&](int, int64_t i0, int64_t i1) {
          for (int64_t r = 0; r < rows; ++r) {
            const T* src = in + r * n_out;
            for (int64_t i = i0; i < i1; ++i) out[i] += src[i];
          }
        },
        16);
    return;
  }
  auto st = bcast_strides(to, from);
  for_each_bcast<1>(from, {st},
                    [&](int64_t i, const std::array<int64_t, 1>& o) { out[o[0]] += in[i]; });
}
template void sum_to_shape<float>(const float*, const Shape&, float*, const Shape&, bool);
template void sum_to_shape<double>(const double*, const Shape&, double*, const Shape&, bool);

template <class T>
void add_n(T* d, const T* s, int64_t n) {
  parallel_elems(n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) d[i] += s[i];
  });
}

void infer_same(InferCtx& c) { c.set_out(0, c.dtype(0), c.shape(0)); }

int onnx_dtype_code_of(DType d) { return onnx_elem_type(d); }

double output_elements(const Graph& g, const Node& n) {
  double out = 0;
  for (int v : n.outputs)
    if (v >= 0) out += static_cast<double>(numel(g.values[v].shape));
  return out;
}

}  // namespace graft::opsutil

namespace graft {
void add_elements(Tensor& dst, const Tensor& src) {
  GRAFT_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), ErrorKind::Internal,
              "add_elements: tensors differ in dtype or size");
  if (dst.dtype() == DType::F32)
    opsutil::add_n(dst.data<float>(), src.data<float>(), dst.numel());
  else if (dst.dtype() == DType::F64)
    opsutil::add_n(dst.data<double>(), src.data<double>(), dst.numel());
  else
    fail(ErrorKind::Internal, "add_elements on a non-float tensor");
}
}  // namespace graft
