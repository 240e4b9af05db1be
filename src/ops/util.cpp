// Broadcasting helpers (see util.h).
#include "util.h"

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
    const int64_t rows = n_out ? numel(from) / n_out : 0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = in + r * n_out;
      for (int64_t i = 0; i < n_out; ++i) out[i] += src[i];
    }
    return;
  }
  auto st = bcast_strides(to, from);
  for_each_bcast<1>(from, {st},
                    [&](int64_t i, const std::array<int64_t, 1>& o) { out[o[0]] += in[i]; });
}
template void sum_to_shape<float>(const float*, const Shape&, float*, const Shape&, bool);
template void sum_to_shape<double>(const double*, const Shape&, double*, const Shape&, bool);

void infer_same(InferCtx& c) { c.set_out(0, c.dtype(0), c.shape(0)); }

}  // namespace graft::opsutil
