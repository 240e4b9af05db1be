// Einsum and its gradient (Einsums again): the equation read against the shapes, and the
// contraction as batched GEMMs through the op families' one GEMM entry point (linalg.cpp).
#include <cctype>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

// ---- Einsum -------------------------------------------------------------------------------------
// Equations with explicit or implicit output, repeated indices within an operand (diagonals),
// "..." broadcasting and any number of operands. Labels are numbered densely: letters first, then
// one label per broadcast dim of the ellipsis (right-aligned across operands, as numpy); a dim of
// size 1 broadcasts against its label's size.
//
// The kernel contracts left to right, two operands at a time, each pair as a batched GEMM
// (opsutil::gemm): labels in both operands and the result are the batch, those of one operand and
// the result are M or N, those of both operands only are K. An operand already laid out as
// [batch, M, K] or [batch, K, M] is read in place; otherwise (another order, a diagonal, a
// broadcast, a label summed away) it is first gathered into that layout. One operand alone is a
// gather that sums the labels the output drops.
struct EinsumSpec {
  std::vector<std::vector<int>> terms;  // per operand, the label of each dim
  std::vector<int> out;                 // the output's labels
  std::vector<int64_t> size;            // per label
  std::vector<char> letter;             // per label: its letter, 0 for an ellipsis dim
};

EinsumSpec einsum_spec(const Node& n, const std::vector<Shape>& shapes) {
  auto bad = [&](ErrorKind k, const std::string& m) {
    fail_at(k, n.name, n.label() + ": equation '" + n.attrs.get_string("equation", "") + "': " + m);
  };
  if (!n.attrs.has("equation"))
    fail_at(ErrorKind::InvalidModel, n.name, n.label() + ": the equation attribute is missing");
  std::string eq;
  for (char ch : n.attrs.get_string("equation", "", n.label()))
    if (!std::isspace(static_cast<unsigned char>(ch))) eq += ch;
  std::string lhs = eq, rhs;
  const size_t arrow = eq.find("->");
  const bool explicit_out = arrow != std::string::npos;
  if (explicit_out) {
    lhs = eq.substr(0, arrow);
    rhs = eq.substr(arrow + 2);
  }
  // Splits a term into letters and the position of "..." (-1: none).
  auto scan = [&](const std::string& t, std::string& letters, int& ell) {
    ell = -1;
    for (size_t i = 0; i < t.size(); ++i) {
      if (t.compare(i, 3, "...") == 0) {
        if (ell >= 0) bad(ErrorKind::InvalidModel, "a term has two ellipses");
        ell = static_cast<int>(letters.size());
        i += 2;
      } else if (std::isalpha(static_cast<unsigned char>(t[i]))) {
        letters += t[i];
      } else {
        bad(ErrorKind::InvalidModel, std::string("unexpected character '") + t[i] + "'");
      }
    }
  };
  std::vector<std::string> terms;
  for (size_t p = 0;;) {
    size_t q = lhs.find(',', p);
    terms.push_back(lhs.substr(p, q == std::string::npos ? std::string::npos : q - p));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  if (terms.size() != shapes.size())
    bad(ErrorKind::InvalidModel,
        std::to_string(terms.size()) + " terms for " + std::to_string(shapes.size()) + " inputs");
  EinsumSpec s;
  int id_of_letter[128];
  std::fill(std::begin(id_of_letter), std::end(id_of_letter), -1);
  auto letter_id = [&](char ch) {
    int& id = id_of_letter[static_cast<unsigned char>(ch)];
    if (id < 0) {
      id = static_cast<int>(s.letter.size());
      s.letter.push_back(ch);
      s.size.push_back(-1);
    }
    return id;
  };
  std::vector<std::string> letters(terms.size());
  std::vector<int> ell(terms.size()), n_ell(terms.size(), 0);
  int E = 0;
  for (size_t i = 0; i < terms.size(); ++i) {
    scan(terms[i], letters[i], ell[i]);
    for (char ch : letters[i]) letter_id(ch);
    const int rank = static_cast<int>(shapes[i].size()), nl = static_cast<int>(letters[i].size());
    if (ell[i] < 0 ? rank != nl : rank < nl)
      bad(ErrorKind::ShapeMismatch, "term '" + terms[i] + "' does not fit input " +
                                        std::to_string(i) + " of shape " + shape_str(shapes[i]));
    if (ell[i] >= 0) n_ell[i] = rank - nl;
    E = std::max(E, n_ell[i]);
  }
  const int first_ell = static_cast<int>(s.letter.size());
  for (int k = 0; k < E; ++k) {
    s.letter.push_back(0);
    s.size.push_back(-1);
  }
  for (size_t i = 0; i < terms.size(); ++i) {
    std::vector<int>& t = s.terms.emplace_back();
    for (int j = 0; j < static_cast<int>(letters[i].size()); ++j) {
      if (j == ell[i])
        for (int k = 0; k < n_ell[i]; ++k) t.push_back(first_ell + E - n_ell[i] + k);
      t.push_back(id_of_letter[static_cast<unsigned char>(letters[i][j])]);
    }
    if (ell[i] == static_cast<int>(letters[i].size()))
      for (int k = 0; k < n_ell[i]; ++k) t.push_back(first_ell + E - n_ell[i] + k);
    for (size_t d = 0; d < t.size(); ++d) {
      int64_t& sz = s.size[t[d]];
      const int64_t dim = shapes[i][d];
      for (size_t e = 0; e < d; ++e)
        if (t[e] == t[d] && shapes[i][e] != dim)
          bad(ErrorKind::ShapeMismatch, "a repeated index of input " + std::to_string(i) +
                                            " spans dims of different sizes in " +
                                            shape_str(shapes[i]));
      if (sz < 0 || sz == 1)
        sz = dim;
      else if (dim != 1 && dim != sz)
        bad(ErrorKind::ShapeMismatch,
            "an index has size " + std::to_string(sz) + " in one place and " + std::to_string(dim) +
                " in input " + std::to_string(i) + " of shape " + shape_str(shapes[i]));
    }
  }
  if (explicit_out) {
    std::string out_letters;
    int out_ell = -1;
    scan(rhs, out_letters, out_ell);
    if (E > 0 && out_ell < 0)
      bad(ErrorKind::InvalidModel,
          "the inputs' '...' covers dims but the output has no '...' (as numpy)");
    for (int j = 0; j <= static_cast<int>(out_letters.size()); ++j) {
      if (j == out_ell)
        for (int k = 0; k < E; ++k) s.out.push_back(first_ell + k);
      if (j == static_cast<int>(out_letters.size())) break;
      const int id = id_of_letter[static_cast<unsigned char>(out_letters[j])];
      if (id < 0)
        bad(ErrorKind::InvalidModel,
            std::string("output index '") + out_letters[j] + "' is not in any input");
      if (std::count(s.out.begin(), s.out.end(), id))
        bad(ErrorKind::InvalidModel,
            std::string("output index '") + out_letters[j] + "' is repeated");
      s.out.push_back(id);
    }
  } else {  // the ellipsis dims, then the letters used once, in alphabetical (ASCII) order
    for (int k = 0; k < E; ++k) s.out.push_back(first_ell + k);
    std::vector<int> count(first_ell, 0);
    for (const auto& t : s.terms)
      for (int l : t)
        if (l < first_ell) ++count[l];
    std::string once;
    for (int l = 0; l < first_ell; ++l)
      if (count[l] == 1) once += s.letter[l];
    std::sort(once.begin(), once.end());
    for (char ch : once) s.out.push_back(id_of_letter[static_cast<unsigned char>(ch)]);
  }
  return s;
}

Shape einsum_out_shape(const EinsumSpec& s) {
  Shape o;
  for (int l : s.out) o.push_back(s.size[l]);
  return o;
}

void infer_einsum(InferCtx& c) {
  std::vector<Shape> shapes;
  for (int i = 0; i < c.n_in(); ++i) {
    require_numeric(c, i);
    if (c.dtype(i) != c.dtype(0)) c.error(ErrorKind::InvalidModel, "inputs differ in dtype");
    shapes.push_back(c.shape(i));
  }
  c.set_out(0, c.dtype(0), einsum_out_shape(einsum_spec(c.node(), shapes)));
}

// An operand seen through its labels: one stride per distinct label (a repeated label's strides
// add up: the diagonal; a dim of size 1 against a larger label has stride 0: the broadcast).
template <class T>
struct EView {
  const T* p = nullptr;
  std::vector<int> labels;
  std::vector<int64_t> strides;
};

template <class T>
EView<T> einsum_view(const T* p, const std::vector<int>& term, const Shape& shape) {
  EView<T> v;
  v.p = p;
  int64_t st = 1;
  std::vector<int64_t> dim_stride(term.size());
  for (size_t d = term.size(); d-- > 0;) {
    dim_stride[d] = shape[d] == 1 ? 0 : st;
    st *= shape[d];
  }
  for (size_t d = 0; d < term.size(); ++d) {
    auto it = std::find(v.labels.begin(), v.labels.end(), term[d]);
    if (it == v.labels.end()) {
      v.labels.push_back(term[d]);
      v.strides.push_back(dim_stride[d]);
    } else {
      v.strides[it - v.labels.begin()] += dim_stride[d];
    }
  }
  return v;
}

template <class T>
int64_t view_stride(const EView<T>& v, int label) {
  auto it = std::find(v.labels.begin(), v.labels.end(), label);
  return it == v.labels.end() ? 0 : v.strides[it - v.labels.begin()];
}

// Is the view exactly the row-major array of `layout` (every label, in that order)?
template <class T>
bool view_dense_as(const EView<T>& v, const std::vector<int>& layout,
                   const std::vector<int64_t>& size) {
  if (v.labels != layout) return false;
  int64_t st = 1;
  for (size_t d = layout.size(); d-- > 0;) {
    if (size[layout[d]] != 1 && v.strides[d] != st) return false;
    st *= size[layout[d]];
  }
  return true;
}

// dst (row-major over `target`) = the view summed over `summed`, in its accumulation type.
template <class T>
void einsum_gather(const EView<T>& v, const std::vector<int>& target,
                   const std::vector<int>& summed, const std::vector<int64_t>& size, T* dst) {
  using Acc = std::conditional_t<std::is_floating_point_v<T>, double, T>;
  const int nt = static_cast<int>(target.size()), ns = static_cast<int>(summed.size());
  std::vector<int64_t> tsz(nt), tst(nt), ssz(ns), sst(ns);
  int64_t total = 1, stotal = 1;
  for (int d = 0; d < nt; ++d) {
    tsz[d] = size[target[d]];
    tst[d] = view_stride(v, target[d]);
    total *= tsz[d];
  }
  for (int d = 0; d < ns; ++d) {
    ssz[d] = size[summed[d]];
    sst[d] = view_stride(v, summed[d]);
    stotal *= ssz[d];
  }
  if (total == 0) return;
  std::vector<int64_t> ti(nt, 0), si(ns, 0);
  int64_t base = 0;
  if (ns == 0 && nt > 0) {  // a permutation (or diagonal, broadcast): rows along the last dim
    const int64_t inner = tsz[nt - 1], is = tst[nt - 1];
    for (int64_t o = 0; o < total; o += inner) {
      const T* src = v.p + base;
      for (int64_t i = 0; i < inner; ++i) dst[o + i] = src[i * is];
      for (int d = nt - 2; d >= 0; --d) {
        base += tst[d];
        if (++ti[d] < tsz[d]) break;
        base -= tst[d] * tsz[d];
        ti[d] = 0;
      }
    }
    return;
  }
  for (int64_t o = 0; o < total; ++o) {
    if (ns == 0) {
      dst[o] = v.p[base];
    } else {
      Acc acc = 0;
      int64_t off = base;
      std::fill(si.begin(), si.end(), 0);
      for (int64_t q = 0; q < stotal; ++q) {
        acc += static_cast<Acc>(v.p[off]);
        for (int d = ns - 1; d >= 0; --d) {
          off += sst[d];
          if (++si[d] < ssz[d]) break;
          off -= sst[d] * ssz[d];
          si[d] = 0;
        }
      }
      dst[o] = static_cast<T>(acc);
    }
    for (int d = nt - 1; d >= 0; --d) {
      base += tst[d];
      if (++ti[d] < tsz[d]) break;
      base -= tst[d] * tsz[d];
      ti[d] = 0;
    }
  }
}

// C[b] = op(A[b]) op(B[b]) for every batch b: opsutil::gemm for floats, a plain loop for ints.
template <class T>
void batched_gemm(bool ta, bool tb, int64_t nb, int64_t M, int64_t N, int64_t K, const T* A,
                  const T* B, T* C) {
  for (int64_t b = 0; b < nb; ++b) {
    const T* a = A + b * M * K;
    const T* bb = B + b * K * N;
    T* cc = C + b * M * N;
    if constexpr (std::is_floating_point_v<T>) {
      gemm<T>(ta, tb, M, N, K, T(1), a, bb, T(0), cc);
    } else {
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          T acc = 0;
          for (int64_t k = 0; k < K; ++k)
            acc += a[ta ? k * M + i : i * K + k] * bb[tb ? j * K + k : k * N + j];
          cc[i * N + j] = acc;
        }
    }
  }
}

// dst (row-major over `out`) = the contraction of views X and Y over the labels `out` drops.
template <class T>
void einsum_pair(const EView<T>& X, const EView<T>& Y, const std::vector<int>& out,
                 const std::vector<int64_t>& size, T* dst, KernelCtx& c, DType dt) {
  auto has = [](const std::vector<int>& v, int l) {
    return std::find(v.begin(), v.end(), l) != v.end();
  };
  // Groups for the roles P (left of the GEMM) and Q (right).
  struct Plan {
    const EView<T>* P = nullptr;
    const EView<T>* Q = nullptr;
    std::vector<int> batch, m, n, k, sum_p, sum_q;
    bool p_direct = false, p_trans = false, q_direct = false, q_trans = false, out_direct = false;
    int copies() const { return !p_direct + !q_direct + !out_direct; }
  };
  auto plan = [&](const EView<T>& P, const EView<T>& Q) {
    Plan pl;
    pl.P = &P;
    pl.Q = &Q;
    for (int l : out) {
      const bool p = has(P.labels, l), q = has(Q.labels, l);
      (p && q ? pl.batch : p ? pl.m : pl.n).push_back(l);
    }
    for (int l : P.labels)
      if (!has(out, l)) (has(Q.labels, l) ? pl.k : pl.sum_p).push_back(l);
    for (int l : Q.labels)
      if (!has(out, l) && !has(P.labels, l)) pl.sum_q.push_back(l);
    auto cat = [](std::vector<int> a, const std::vector<int>& b, const std::vector<int>& c3) {
      a.insert(a.end(), b.begin(), b.end());
      a.insert(a.end(), c3.begin(), c3.end());
      return a;
    };
    if (view_dense_as(P, cat(pl.batch, pl.m, pl.k), size)) {
      pl.p_direct = true;
    } else if (view_dense_as(P, cat(pl.batch, pl.k, pl.m), size)) {
      pl.p_direct = pl.p_trans = true;
    }
    if (view_dense_as(Q, cat(pl.batch, pl.k, pl.n), size)) {
      pl.q_direct = true;
    } else if (view_dense_as(Q, cat(pl.batch, pl.n, pl.k), size)) {
      pl.q_direct = pl.q_trans = true;
    }
    pl.out_direct = cat(pl.batch, pl.m, pl.n) == out;
    return pl;
  };
  Plan a = plan(X, Y), b = plan(Y, X);
  const Plan& pl = b.copies() < a.copies() ? b : a;
  auto prod = [&](const std::vector<int>& ls) {
    int64_t p = 1;
    for (int l : ls) p *= size[l];
    return p;
  };
  const int64_t NB = prod(pl.batch), M = prod(pl.m), N = prod(pl.n), K = prod(pl.k);
  auto cat2 = [](std::vector<int> x, const std::vector<int>& y, const std::vector<int>& z) {
    x.insert(x.end(), y.begin(), y.end());
    x.insert(x.end(), z.begin(), z.end());
    return x;
  };
  Tensor pbuf, qbuf, cbuf;
  const T* pp = pl.P->p;
  const T* qp = pl.Q->p;
  if (!pl.p_direct) {
    pbuf = Tensor::empty({NB * M * K}, dt, c.alloc, Category::Workspace, "einsum");
    einsum_gather(*pl.P, cat2(pl.batch, pl.m, pl.k), pl.sum_p, size, pbuf.data<T>());
    pp = pbuf.data<T>();
  }
  if (!pl.q_direct) {
    qbuf = Tensor::empty({NB * K * N}, dt, c.alloc, Category::Workspace, "einsum");
    einsum_gather(*pl.Q, cat2(pl.batch, pl.k, pl.n), pl.sum_q, size, qbuf.data<T>());
    qp = qbuf.data<T>();
  }
  T* cp = dst;
  if (!pl.out_direct) {
    cbuf = Tensor::empty({NB * M * N}, dt, c.alloc, Category::Workspace, "einsum");
    cp = cbuf.data<T>();
  }
  batched_gemm<T>(pl.p_trans, pl.q_trans, NB, M, N, K, pp, qp, cp);
  if (!pl.out_direct) {
    EView<T> cv;
    cv.p = cp;
    cv.labels = cat2(pl.batch, pl.m, pl.n);
    cv.strides.resize(cv.labels.size());
    int64_t st = 1;
    for (size_t d = cv.labels.size(); d-- > 0;) {
      cv.strides[d] = st;
      st *= size[cv.labels[d]];
    }
    einsum_gather(cv, out, {}, size, dst);
  }
}

void einsum_kernel(KernelCtx& c) {
  std::vector<Shape> shapes;
  for (size_t i = 0; i < c.ins.size(); ++i) shapes.push_back(c.in(static_cast<int>(i)).shape());
  const EinsumSpec s = einsum_spec(c.node, shapes);
  const DType dt = c.in(0).dtype();
  dispatch_numeric(dt, c, [&]<class T>() {
    const int n = static_cast<int>(shapes.size());
    std::vector<EView<T>> views;
    for (int i = 0; i < n; ++i)
      views.push_back(einsum_view(c.in(i).data<T>(), s.terms[i], shapes[i]));
    T* y = c.out(0).data<T>();
    if (n == 1) {
      std::vector<int> summed;
      for (int l : views[0].labels)
        if (std::find(s.out.begin(), s.out.end(), l) == s.out.end()) summed.push_back(l);
      einsum_gather(views[0], s.out, summed, s.size, y);
      return;
    }
    EView<T> cur = views[0];
    Tensor buf;
    for (int j = 1; j < n; ++j) {
      if (j == n - 1) {
        einsum_pair(cur, views[j], s.out, s.size, y, c, dt);
        break;
      }
      // Keep the labels the output or a later operand still needs.
      std::vector<char> needed(s.size.size(), 0);
      for (int l : s.out) needed[l] = 1;
      for (int q = j + 1; q < n; ++q)
        for (int l : views[q].labels) needed[l] = 1;
      std::vector<int> keep;
      for (const auto* v : {&cur, &views[j]})
        for (int l : v->labels)
          if (needed[l] && std::find(keep.begin(), keep.end(), l) == keep.end()) keep.push_back(l);
      int64_t count = 1;
      for (int l : keep) count *= s.size[l];
      Tensor next = Tensor::empty({count}, dt, c.alloc, Category::Workspace, "einsum");
      einsum_pair(cur, views[j], keep, s.size, next.data<T>(), c, dt);
      buf = next;  // keeps the intermediate alive while `cur` reads it
      cur.p = buf.data<T>();
      cur.labels = keep;
      cur.strides.assign(keep.size(), 0);
      int64_t st = 1;
      for (size_t d = keep.size(); d-- > 0;) {
        cur.strides[d] = st;
        st *= s.size[keep[d]];
      }
    }
  });
}

// Rough: graft's Einsums (attention in exported transformers) are small contractions.
double einsum_flops(const Graph& g, const Node& n) { return 2 * output_elements(g, n) * 64; }

// Y = einsum(X_0, ..., X_n-1). dX_i = einsum of dY with the other operands, the output being X_i's
// term. Labels X_i alone has were summed: dY does not vary along them, so the result is expanded
// back. A label repeated in X_i (a diagonal) is split into fresh labels joined by identity
// matrices, so the gradient lands on the diagonal only. Broadcast dims (size 1 in X_i) come back
// summed by the driver.
void grad_einsum(GradBuilder& g) {
  const Node& node = g.node();
  const int n = static_cast<int>(node.inputs.size());
  std::vector<Shape> shapes;
  for (int i = 0; i < n; ++i) shapes.push_back(g.shape(g.x(i)));
  EinsumSpec s = einsum_spec(node, shapes);
  const DType dt = g.val(g.dy(0)).dtype;
  // Letters for every label: its own, or a free one (ellipsis dims, split diagonals).
  std::string free_letters;
  for (char ch : std::string("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    if (std::find(s.letter.begin(), s.letter.end(), ch) == s.letter.end()) free_letters += ch;
  auto fresh = [&]() {
    GRAFT_CHECK(!free_letters.empty(), ErrorKind::Unsupported,
                node.label() + ": the gradient's equation needs more than 52 index letters");
    char ch = free_letters.back();
    free_letters.pop_back();
    return ch;
  };
  for (char& ch : s.letter)
    if (!ch) ch = fresh();
  auto str = [&](const std::vector<int>& t) {
    std::string r;
    for (int l : t) r += s.letter[l];
    return r;
  };
  for (int i = 0; i < n; ++i) {
    if (!g.needs(i)) continue;
    std::vector<int> ins{g.dy(0)};
    std::vector<std::string> terms{str(s.out)};
    for (int j = 0; j < n; ++j)
      if (j != i) {
        ins.push_back(g.x(j));
        terms.push_back(str(s.terms[j]));
      }
    // X_i's term with repeats split: "ii" -> "iz" plus an identity "iz".
    std::string ti;
    for (size_t d = 0; d < s.terms[i].size(); ++d) {
      const int l = s.terms[i][d];
      if (std::find(s.terms[i].begin(), s.terms[i].begin() + d, l) == s.terms[i].begin() + d) {
        ti += s.letter[l];
        continue;
      }
      const char z = fresh();
      ti += z;
      const int64_t m = s.size[l];
      std::vector<int64_t> eye(static_cast<size_t>(m * m), 0);
      for (int64_t q = 0; q < m; ++q) eye[q * m + q] = 1;
      int e = g.emit1("Reshape", {g.ints(eye), g.ints({m, m})});
      Attrs ca;
      ca.set_int("to", onnx_dtype_code_of(dt));
      ins.push_back(g.emit1("Cast", {e}, ca));
      terms.push_back(std::string{s.letter[l], z});
    }
    // Letters of X_i found in no other term were summed away: leave them out, expand after.
    std::string kept;
    Shape reshaped, expanded;
    for (size_t d = 0; d < ti.size(); ++d) {
      bool elsewhere = false;
      for (const auto& t : terms) elsewhere = elsewhere || t.find(ti[d]) != std::string::npos;
      const int64_t full = s.size[s.terms[i][d]];
      if (elsewhere) kept += ti[d];
      reshaped.push_back(elsewhere ? full : 1);
      expanded.push_back(full);
    }
    std::string eq;
    for (size_t t = 0; t < terms.size(); ++t) eq += (t ? "," : "") + terms[t];
    Attrs a;
    a.set_string("equation", eq + "->" + kept);
    int d = g.emit1("Einsum", ins, a);
    if (kept.size() != ti.size()) {
      d = g.emit1("Reshape", {d, g.ints(reshaped)});
      d = g.emit1("Expand", {d, g.ints(expanded)});
    }
    g.set_dx(i, d);
  }
}

const OpDef kOps[] = {
    {.name = "Einsum",
     .max_in = 1 << 20,
     .infer = infer_einsum,
     .kernel = einsum_kernel,
     .grad = grad_einsum,
     .flops = einsum_flops},
};

}  // namespace

void register_einsum_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
