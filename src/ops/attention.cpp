// graft's fused scaled-dot-product attention: Attention and AttentionGrad.
//
// Attention(Q [B, H, Tq, D], K [B, Hk, Tk, D], V [B, Hk, Tk, Dv], mask?, scale?; causal,
//           dropout, seed) -> O [B, H, Tq, Dv], LSE [B, H, Tq]
// O = dropout(softmax(scale * Q K^T + mask)) V per (batch, head) (dropout: Note [attention
// dropout]), query head h reading key/value head
// h / (H / Hk) (grouped-query attention: H a multiple of Hk). scale: a constant scalar input (read
// in double: an ONNX float attribute would round it to float32), or the attribute `scale`, or
// 1 / sqrt(D). The
// optional mask broadcasts to [B, H, Tq, Tk]: boolean (true = attend, PyTorch's convention) or
// float (added to the scores). causal: query i attends to keys j <= i (PyTorch's is_causal, the
// triangle aligned top-left). LSE is each row's log-sum-exp of the masked, scaled scores; a query
// that attends to nothing gets O = 0 and LSE = -inf (PyTorch 2.x's _safe_softmax gives 0 there).
// AttentionGrad(dO?, Q, K, V, LSE, mask?, dLSE?, scale?; causal, dropout, stream) -> dQ, dK,
// dV, dMask? (a float
// mask's gradient at full size [B, H, Tq, Tk], made only when the mask needs one; dO or dLSE
// absent: no gradient flows into that output).
// With the attribute `views` (Note [attention views]) Q, K, V and O are any tensors holding the
// heads' rows at strides, and K and V may be absent (packed in Q's tensor).
//
// Note [fused attention]
// Eager attention materializes the B x H x Tq x Tk probabilities, keeps them for the backward and
// holds their gradient beside them there: at long sequences that is a model's largest activation.
// Here the scores never exist for more than a block of query rows at a time. The forward takes,
// per (batch, head), `rows` query rows at once (rows * Tk scores, about 1 MiB, at least 256 rows),
// computes their scores with one GEMM, the exact softmax of each row (max, exp, sum: a whole row is
// in the block, so no online rescaling is needed) and their output with a second GEMM, and keeps
// only the row's log-sum-exp for the backward. The backward recomputes the block's probabilities
// from Q, K and the LSE (P = exp(S - LSE)), then
//   dV += P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(P * dP)),   dQ = scale dS K,
//   dK += scale dS^T Q,
// so what attention adds to a step is O(T) (the LSE, and a block of scores and their gradient),
// not O(T^2). rowsum(P * dP) equals FlashAttention's rowsum(dO * O) (O = P V), but needs no O:
// the backward does not keep the output, which the next layer usually keeps in another layout
// (the heads transposed back), so the forward's result is not held twice. The GEMMs run on graft's
// GEMM entry point (oneDNN / OpenBLAS) and the row softmax on the op families' threads, the heads
// in parallel where there are enough of them (Note [heads in parallel]).
// Causal blocks stop at their last row's diagonal, and on short sequences their GEMMs run in
// sub-blocks that each stop at their own (sub_rows).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "util.h"
#include "vmath.h"

namespace graft {
namespace {
using namespace opsutil;

// Note [attention views]
// Q, K, V and O are [B, H, T, D] tensors unless the node has the attribute
//   views = [B, H, Hk, Tq, Tk, D, Dv,  then (offset, batch stride, head stride, row stride) for
//            Q, K, V and O, in elements]
// with which each may be any tensor that holds every head's rows at strides, a row's D (Dv)
// elements consecutive; O's shape is then the attribute `out_shape`. Those are the layouts the
// projections around attention write: nn.MultiheadAttention's packed [T, B, 3 E] (Q at columns
// 0..E, K at E..2E, V at 2E..3E, head h at h D of its third), GPT-2's packed [B, T, 3 E], a
// separate projection's [B, T, E], and the [T, B, E] or [B, T, E] the output projection reads.
// Attention reads and writes them in place (its GEMMs take a row stride), so the transposes,
// splits and copies that would make 4-D operands, and their gradients' counterparts in the
// backward, never run (ViT-B/16: 14 of them per layer). K and V may be absent, their views then
// in Q's tensor (one packed projection): AttentionGrad then makes one gradient, of that tensor.
// Every tensor's views must cover it exactly once (checked when shapes are inferred): the
// backward then writes each element of each gradient (dK and dV into zeros: they accumulate
// over query heads and blocks), and no two heads share bytes, so heads may run in parallel.
// attention_views (fuse_attention.cpp) is the rewrite that makes them.
struct HeadView {
  int64_t off = 0, sb = 0, sh = 0, st = 0;
  int64_t at(int64_t b, int64_t h) const { return off + b * sb + h * sh; }
};
constexpr size_t kViewInts = 7 + 4 * 4;

// The shapes of one Attention / AttentionGrad node, read from its inputs (or its views).
struct Dims {
  int64_t B, H, Hk, Tq, Tk, D, Dv;
  bool causal;
  double scale;
  HeadView q, k, v, o;  // where each (batch, head)'s rows are, and their stride
  // The mask's strides (in elements) over [B, H, Tq, Tk], 0 along broadcast dimensions.
  bool has_mask = false, bool_mask = false;
  int64_t ms[4] = {0, 0, 0, 0};
};

// The attributes, parsed once per node (Note [prepared attributes], ops.h).
struct AttentionAttrs {
  bool causal = false;
  double scale = 0;     // 0: none given
  double dropout = 0;   // the probability of dropping a probability (Note [attention dropout])
  uint64_t stream = 0;  // the dropout mask's stream: the seed attribute and the forward node's name
  std::vector<int64_t> views;  // Note [attention views] (empty: 4-D operands)
};
AttentionAttrs attention_attrs(const Node& n) {
  const std::string where = n.label();
  AttentionAttrs a{n.attrs.get_int("causal", 0, where) != 0,
                   n.attrs.get_float("scale", 0.0, where),
                   n.attrs.get_float("dropout", 0.0, where),
                   0,
                   {}};
  GRAFT_CHECK(a.dropout >= 0 && a.dropout < 1, ErrorKind::InvalidModel,
              where + ": dropout " + std::to_string(a.dropout) + " is not in [0, 1)");
  a.views = n.attrs.get_ints("views", {}, where);
  GRAFT_CHECK(a.views.empty() || a.views.size() == kViewInts, ErrorKind::InvalidModel,
              where + ": views has " + std::to_string(a.views.size()) + " values, not " +
                  std::to_string(kViewInts) + " (Note [attention views])");
  // AttentionGrad is told its forward's stream; a forward makes it from its seed and its name.
  a.stream = n.attrs.has("stream") ? static_cast<uint64_t>(n.attrs.get_int("stream", 0, where))
                                   : node_stream(n.attrs.get_int("seed", 0, where), n.name);
  return a;
}

// Note [attention dropout]
// Dropout on the probabilities (PyTorch's dropout_p): O = (P * M / (1 - p)) V with M a Bernoulli
// keep-mask. The mask is never stored: element (b, h, i, j) of a run's mask is a counter-based
// draw, splitmix64 of (the run's seed, the node's stream) at position ((b H + h) Tq + i) Tk + j,
// kept when its top 53 bits are at least p 2^53. The backward draws the same bits: dV takes the
// dropped probabilities, dP the mask's scaling, and dS = P * (dP - rowsum(P * dP)) as before (P
// undropped), so dropout adds no memory to attention's O(T), and running the node again (a
// recompute under a budget) draws the same mask: the op is not `random` in OpDef's sense.
struct DropMask {
  uint64_t base = 0, threshold = 0;
  double scale = 1;  // 1 / (1 - p)
  bool on = false;
  DropMask(const AttentionAttrs& a, uint64_t run_seed) {
    on = a.dropout > 0;
    if (!on) return;
    base = stream_base(run_seed, a.stream);
    threshold = keep_threshold(a.dropout);
    scale = 1.0 / (1.0 - a.dropout);
  }
  // x[j] *= the factor (0 or 1 / (1 - p)) of mask element first + j, j < n (first: the flat
  // position of a row's key 0).
  template <class T>
  void apply(uint64_t first, int64_t n, T* x) const {
    const T keep = static_cast<T>(scale);
    for (int64_t j = 0; j < n; ++j)
      x[j] *= keep_at(base, first + static_cast<uint64_t>(j), threshold) ? keep : T(0);
  }
};
std::shared_ptr<const void> prepare_attention(const Node& n) {
  return prepared(attention_attrs(n));
}

// The dims and views of 4-D operands (no `views`), or those `views` gives.
void set_views(Dims& d, const std::vector<int64_t>& views, const Shape& q, const Shape& k,
               const Shape& v) {
  if (views.empty()) {
    d.B = q[0], d.H = q[1], d.Tq = q[2], d.D = q[3];
    d.Hk = k[1], d.Tk = k[2], d.Dv = v[3];
    d.q = {0, d.H * d.Tq * d.D, d.Tq * d.D, d.D};
    d.k = {0, d.Hk * d.Tk * d.D, d.Tk * d.D, d.D};
    d.v = {0, d.Hk * d.Tk * d.Dv, d.Tk * d.Dv, d.Dv};
    d.o = {0, d.H * d.Tq * d.Dv, d.Tq * d.Dv, d.Dv};
    return;
  }
  const int64_t* x = views.data();
  d.B = x[0], d.H = x[1], d.Hk = x[2], d.Tq = x[3], d.Tk = x[4], d.D = x[5], d.Dv = x[6];
  HeadView* hv[4] = {&d.q, &d.k, &d.v, &d.o};
  for (int i = 0; i < 4; ++i) *hv[i] = {x[7 + 4 * i], x[8 + 4 * i], x[9 + 4 * i], x[10 + 4 * i]};
}

// `k`, `v` (absent: packed in q), `mask` and `scale`: the node's optional inputs (nullptr when
// absent).
Dims dims_of(const AttentionAttrs& a, const Tensor& q, const Tensor* k, const Tensor* v,
             const Tensor* mask, const Tensor* scale) {
  Dims d{};
  static const Shape none;
  set_views(d, a.views, q.shape(), k ? k->shape() : none, v ? v->shape() : none);
  d.causal = a.causal;
  d.scale = a.scale;
  if (scale)
    d.scale = scale->dtype() == DType::F64 ? scale->data<double>()[0] : scale->data<float>()[0];
  if (d.scale == 0) d.scale = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(1, d.D)));
  d.has_mask = mask != nullptr;
  if (mask) {
    d.bool_mask = mask->dtype() == DType::Bool;
    const std::vector<int64_t> st = bcast_strides(mask->shape(), {d.B, d.H, d.Tq, d.Tk});
    for (int i = 0; i < 4; ++i) d.ms[i] = st[i];
  }
  return d;
}

// Q, K and V (inputs first .. first + 2) share one float dtype; in a bf16 step any of them may be
// bfloat16 operands the plan stored (Note [bf16 operands]: attention reads Q, K and V only as
// operands of its products), and the arithmetic is float32's.
DType qkv_dtype(InferCtx& c, int first) {
  const int n = c.has_in(first + 1) ? 3 : 1;  // (K and V packed in Q's tensor: one)
  if (bf16_operands(c, first, n)) return DType::F32;
  c.check(is_float(c.dtype(first)) && (n == 1 || (c.dtype(first + 1) == c.dtype(first) &&
                                                  c.dtype(first + 2) == c.dtype(first))),
          "Q, K and V must share one float dtype");
  return c.dtype(first);
}

// Whether `rows` (start, length) tile [0, numel) exactly: each element in one row, none outside.
bool tiles_exactly(std::vector<std::pair<int64_t, int64_t>>& rows, int64_t numel) {
  std::sort(rows.begin(), rows.end());
  int64_t at = 0;
  for (const auto& [start, len] : rows) {
    if (start != at) return false;
    at += len;
  }
  return at == numel;
}

// Note [attention views]: checks a node's views against its tensors: Q, K, V at inputs first ..
// first + 2 (K and V absent: packed), O of shape `o_shape`; every tensor covered exactly once.
// Returns the dims.
Dims check_views(InferCtx& c, const std::vector<int64_t>& views, int first, const Shape& o_shape) {
  Dims d{};
  set_views(d, views, {}, {}, {});
  const bool packed = !c.has_in(first + 1);
  c.check(packed == !c.has_in(first + 2), "K and V must both be given or both be packed in Q");
  c.check(d.B >= 0 && d.H >= 1 && d.Hk >= 1 && d.H % d.Hk == 0 && d.Tq >= 0 && d.Tk >= 0 &&
              d.D >= 1 && d.Dv >= 1,
          "views: the sizes [B, H, Hk, Tq, Tk, D, Dv] must be positive, H a multiple of Hk");
  // The rows of one operand (rows x len elements at `hv`), appended to `rows` after bounds checks
  // against a tensor of `numel` elements (in 128 bits: views are untrusted input).
  auto add_rows = [&](const char* what, const HeadView& hv, int64_t heads, int64_t T, int64_t len,
                      int64_t numel, std::vector<std::pair<int64_t, int64_t>>& rows) {
    using I = __int128;  // (each product below is of two values under 2^63: no overflow)
    c.check(hv.off >= 0 && hv.sb >= 0 && hv.sh >= 0 && hv.st >= 0,
            std::string("views: ") + what + "'s offset and strides must not be negative");
    I count = 1;
    for (int64_t f : {d.B, heads, T, len}) {
      count *= f;
      c.check(count <= numel, std::string("views: ") + what + " has more elements than its tensor");
    }
    if (count == 0) return;
    c.check(hv.off <= numel && hv.sb <= numel && hv.sh <= numel && hv.st <= numel,
            std::string("views: ") + what + " reaches past its tensor's end");
    const I last = I(hv.off) + I(d.B - 1) * hv.sb + I(heads - 1) * hv.sh + I(T - 1) * hv.st + len;
    c.check(last <= numel, std::string("views: ") + what + " reaches past its tensor's end");
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < T; ++t) rows.push_back({hv.at(b, h) + t * hv.st, len});
  };
  // Each tensor's operands, rows of them all, must tile it.
  auto covers = [&](std::initializer_list<int> operands, int64_t numel, const char* msg) {
    const HeadView* hv[4] = {&d.q, &d.k, &d.v, &d.o};
    const int64_t heads[4] = {d.H, d.Hk, d.Hk, d.H}, T[4] = {d.Tq, d.Tk, d.Tk, d.Tq},
                  len[4] = {d.D, d.D, d.Dv, d.Dv};
    const char* what[4] = {"Q", "K", "V", "O"};
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (int i : operands) add_rows(what[i], *hv[i], heads[i], T[i], len[i], numel, rows);
    c.check(tiles_exactly(rows, numel), msg);
  };
  if (packed) {
    covers({0, 1, 2}, numel(c.shape(first)),
           "views: Q, K and V must cover their tensor exactly once");
  } else {
    covers({0}, numel(c.shape(first)), "views: Q must cover its tensor exactly once");
    covers({1}, numel(c.shape(first + 1)), "views: K must cover its tensor exactly once");
    covers({2}, numel(c.shape(first + 2)), "views: V must cover its tensor exactly once");
  }
  covers({3}, numel(o_shape), "views: O must cover out_shape exactly once");
  return d;
}

// O's shape under views: the attribute out_shape.
Shape out_shape_of(InferCtx& c) {
  const std::vector<int64_t> s = c.attrs().get_ints("out_shape", {}, c.node().label());
  c.check(!s.empty(), "views need the attribute out_shape (Note [attention views])");
  for (int64_t x : s) c.check(x >= 0, "out_shape must not be negative");
  return Shape(s.begin(), s.end());
}

// The dims of an Attention (q_in 0) or AttentionGrad (q_in 1) node from its 4-D Q, K and V, or
// from its views (Note [attention views]); `o_shape` gets O's shape.
Dims infer_dims(InferCtx& c, int q_in, Shape& o_shape) {
  const std::vector<int64_t> views = c.attrs().get_ints("views", {}, c.node().label());
  if (!views.empty()) {
    c.check(views.size() == kViewInts,
            "views must have " + std::to_string(kViewInts) + " values (Note [attention views])");
    o_shape = out_shape_of(c);
    return check_views(c, views, q_in, o_shape);
  }
  c.check(c.has_in(q_in + 1) && c.has_in(q_in + 2), "K and V are missing");
  const Shape &q = c.shape(q_in), &k = c.shape(q_in + 1), &v = c.shape(q_in + 2);
  c.check(q.size() == 4 && k.size() == 4 && v.size() == 4,
          "Q, K and V must be 4-D [batch, heads, sequence, head size]");
  c.check(k[0] == q[0] && v[0] == q[0], "Q, K and V must have the same batch size");
  c.check(k[3] == q[3], "Q and K must have the same head size");
  c.check(v[1] == k[1] && v[2] == k[2], "K and V must have the same heads and sequence length");
  c.check(k[1] > 0 && q[1] % k[1] == 0, "the query heads (" + std::to_string(q[1]) +
                                            ") must be a multiple of the key/value heads (" +
                                            std::to_string(k[1]) + ")");
  Dims d{};
  set_views(d, views, q, k, v);
  o_shape = {q[0], q[1], q[2], v[3]};
  return d;
}

// The optional mask (input m) and scale (input sc) of a node with dims d and dtype dt.
void check_mask_and_scale(InferCtx& c, const Dims& d, DType dt, int m, int sc) {
  if (c.has_in(sc))
    c.check(c.shape(sc).empty() && is_float(c.dtype(sc)), "the scale must be a float scalar");
  if (c.has_in(m)) {
    const Shape& ms = c.shape(m);
    c.check(ms.size() <= 4, "the mask must broadcast to [batch, heads, Tq, Tk]");
    const Shape full{d.B, d.H, d.Tq, d.Tk};
    Shape b;
    c.check(broadcast_shape(ms, full, b) && b == full,
            "the mask " + shape_str(ms) + " does not broadcast to " + shape_str(full));
    c.check(c.dtype(m) == DType::Bool || c.dtype(m) == dt,
            "the mask must be boolean or of Q's dtype");
  }
}

void infer_attention(InferCtx& c) {
  Shape os;
  const Dims d = infer_dims(c, 0, os);
  const DType dt = qkv_dtype(c, 0);
  check_mask_and_scale(c, d, dt, 3, 4);
  c.set_out(0, dt, os);
  if (c.has_out(1)) c.set_out(1, dt, {d.B, d.H, d.Tq});
}

// Query rows per block: about 2^18 scores (1 MiB of float32), but at least 256 rows (the inner
// dimension of the backward's dK and dV updates: thinner, those GEMMs re-read dK and dV for
// little work each), at most Tq.
int64_t block_rows(const Dims& d) {
  const int64_t r = std::max<int64_t>((int64_t{1} << 18) / std::max<int64_t>(1, d.Tk), 256);
  return std::min(r, std::max<int64_t>(1, d.Tq));
}

// Keys a block of rows [r0, r1) reads: all, or (causal) up to the last row's diagonal.
int64_t keys_for(const Dims& d, int64_t r1) { return d.causal ? std::min(d.Tk, r1) : d.Tk; }

// Causal: the GEMMs of a block run over sub-blocks of its rows, each up to its own last row's
// diagonal, so a block that spans the diagonal skips most of its upper triangle. Split only when
// a head has few blocks (short sequences: the triangle is then a large share of each block, and K
// and V stay in cache for the thinner dK / dV updates).
int64_t sub_rows(const Dims& d, int64_t rows) {
  if (!d.causal || (d.Tq + rows - 1) / rows >= 4) return rows;
  return std::max<int64_t>(64, rows / 4);
}
// f(s0, ms, ks) for the sub-blocks [s0, s0 + ms) of the block of rows [r0, r0 + m), ks the keys
// they read (kn without causal).
template <class F>
void each_sub(const Dims& d, int64_t sb, int64_t r0, int64_t m, int64_t kn, F&& f) {
  for (int64_t s0 = 0; s0 < m; s0 += sb) {
    const int64_t ms = std::min(sb, m - s0);
    f(s0, ms, d.causal ? std::min(kn, r0 + s0 + ms) : kn);
  }
}

// Note [heads in parallel]
// Per unit of work (a query head in the forward; in the backward a key/value head with the query
// heads that read it, since they add into the same dK and dV) attention is a few GEMMs of about
// rows x Tk x D and row loops over rows x Tk. At BERT's, ViT's and GPT-2's sizes (T 197-512, D 64)
// each is small, and splitting each one over the threads costs a fork and a join per GEMM and per
// row loop: `perf` put libgomp at half the GEMMs' share of attention's time. With at least four
// units per thread, the units run in parallel instead, each on one thread with its own block of
// scores (so the workspace is one block per thread), its GEMMs single-threaded (oneDNN runs on the
// calling thread inside a parallel region) and its row loops inline (parallel_for nests that way).
// No two units write the same bytes, and a unit's arithmetic is the same in both modes up to the
// GEMM library's own split of a product. GRAFT_ATTENTION_HEADS=0 keeps units one at a time, each
// GEMM and row loop threaded (an A/B switch); so does GRAFT_POOL=own (Note [one thread pool]),
// whose workers are not an OpenMP team: oneDNN would start a team of its own under each.
int unit_slots(int64_t units) {
  static const bool off = [] {
    const char* v = std::getenv("GRAFT_ATTENTION_HEADS");
    return (v && std::string(v) == "0") || !pool_is_openmp();
  }();
  const int t = max_threads();
  return !off && t > 1 && units >= 4 * int64_t{t} ? t : 1;
}
// Runs unit(slot, u) for u in [0, units): in parallel (slots > 1: slot < slots, the running
// thread's block of scores) or one after another in slot 0.
template <class F>
void each_unit(int64_t units, int slots, int64_t work_per_unit, F&& unit) {
  if (slots == 1) {
    for (int64_t u = 0; u < units; ++u) unit(0, u);
    return;
  }
  // The caller's precision on every thread: a bf16 step's products are bf16 whichever thread runs
  // a head (Bf16MatmulScope is per thread; without this the heads a worker ran were float32, so a
  // bf16 step's result depended on the schedule).
  const bool bf16 = bf16_gemm_active();
  parallel_for(units, std::max<int64_t>(work_per_unit, kParallelGrain),
               [&](int slot, int64_t u0, int64_t u1) {
                 Bf16MatmulScope precision(bf16);
                 for (int64_t u = u0; u < u1; ++u) unit(slot, u);
               });
}

// S[m x kn] (scores of rows r0.. of head (b, h), already scaled) gets the mask: -inf where a
// boolean mask says no, a float mask added. (The causal triangle is softmax_rows's.)
template <class T>
void mask_scores(const Dims& d, const Tensor* mask, int64_t b, int64_t h, int64_t r0, int64_t m,
                 int64_t kn, T* S) {
  if (!d.has_mask) return;
  const T ninf = -std::numeric_limits<T>::infinity();
  parallel_for(m, 2 * kn, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T* s = S + i * kn;
      const int64_t base = b * d.ms[0] + h * d.ms[1] + (r0 + i) * d.ms[2];
      if (d.bool_mask) {
        const bool* mk = mask->data<bool>() + base;
        for (int64_t j = 0; j < kn; ++j)
          if (!mk[j * d.ms[3]]) s[j] = ninf;
      } else {
        const T* mk = mask->data<T>() + base;
        for (int64_t j = 0; j < kn; ++j) s[j] += mk[j * d.ms[3]];
      }
    }
  });
}

// The keys row `row` attends to among the kn of its block: all, or (causal) up to its diagonal.
inline int64_t row_keys(const Dims& d, int64_t row, int64_t kn) {
  return d.causal ? std::min(kn, row + 1) : kn;
}

// Row softmax in place over S[m x kn] (rows r0..): P = exp(S - max) / sum; lse[i] = max +
// log(sum). A causal row's keys past its diagonal get P = 0 without being read. A row with no
// finite score becomes zeros with lse = -inf. With `lse_in`, P = exp(S - lse_in) instead (the
// backward's recomputation: its rows sum to 1 up to lse_in's rounding, which the backward divides
// out). float32 rows run vmath's one-pass kernels (max, then exp with the sum in double: Note
// [row sums in double], vmath_impl.h).
template <class T>
void softmax_rows(const Dims& d, int64_t r0, int64_t m, int64_t kn, T* S, T* lse_out,
                  const T* lse_in) {
  const T ninf = -std::numeric_limits<T>::infinity();
  const bool vec = std::is_same_v<T, float> && vmath::active();
  parallel_for(m, (vec ? 4 : 24) * kn, [&](int, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      T* s = S + i * kn;
      const int64_t lim = row_keys(d, r0 + i, kn);
      std::fill(s + lim, s + kn, T(0));
      T mx = ninf;
      if (lse_in) {
        mx = lse_in[i];
      } else {
        if constexpr (std::is_same_v<T, float>) {
          if (vec && lim > 0) mx = vmath::max_of(s, lim);
        }
        if (!vec)
          for (int64_t j = 0; j < lim; ++j) mx = std::max(mx, s[j]);
      }
      if (!(mx > ninf)) {  // attends to nothing (or NaN scores: they stay NaN below)
        if (std::isnan(static_cast<double>(mx))) {
          std::fill(s, s + lim, mx);
        } else {
          std::fill(s, s + lim, T(0));
        }
        if (lse_out) lse_out[i] = mx;
        continue;
      }
      double sum = 0;
      if constexpr (std::is_same_v<T, float>) {
        if (vec && lse_in) vmath::exp_shift(s, mx, s, lim);  // (the sum is not needed)
        if (vec && !lse_in) sum = vmath::exp_shift_sum(s, mx, s, lim);
      }
      if (!vec)
        for (int64_t j = 0; j < lim; ++j) sum += static_cast<double>(s[j] = std::exp(s[j] - mx));
      if (lse_in) continue;
      const T inv = static_cast<T>(1.0 / sum);
      if constexpr (std::is_same_v<T, float>) {
        if (vec) vmath::scale(s, inv, lim);
      }
      if (!vec)
        for (int64_t j = 0; j < lim; ++j) s[j] *= inv;
      if (lse_out) lse_out[i] = mx + static_cast<T>(std::log(sum));
    }
  });
}

void attention_kernel(KernelCtx& c) {
  const Tensor& q = c.in(0);
  const Tensor* mask = c.has_in(3) ? &c.in(3) : nullptr;
  const bool packed = !c.has_in(1);  // Note [attention views]
  const Tensor &k = packed ? q : c.in(1), &v = packed ? q : c.in(2);
  const Dims d = dims_of(c.attrs<AttentionAttrs>(), q, packed ? nullptr : &k, packed ? nullptr : &v,
                         mask, c.has_in(4) ? &c.in(4) : nullptr);
  const int64_t rows = block_rows(d), sb = sub_rows(d, rows), group = d.H / d.Hk;
  const DropMask drop(c.attrs<AttentionAttrs>(), c.seed);
  const int slots = unit_slots(d.B * d.H);  // Note [heads in parallel]
  const DType dt = operands_dtype(c, 0, packed ? 1 : 3);
  const GemmOperand qo(q), ko(k), vo(v);
  const int64_t ldq = d.q.st, ldk = d.k.st, ldv = d.v.st, ldo = d.o.st;
  dispatch_float(dt, c, [&]<class T>() {
    Tensor ws = Tensor::empty({slots, rows, d.Tk}, dt, c.alloc, Category::Workspace, "scores");
    Tensor lse_ws;
    T* lse_all = nullptr;
    if (c.has_out(1)) {
      lse_all = c.out(1).data<T>();
    } else {
      lse_ws = Tensor::empty({slots, rows}, dt, c.alloc, Category::Workspace, "lse");
    }
    auto unit = [&](int slot, int64_t bh) {
      const int64_t b = bh / d.H, h = bh % d.H, hk = h / group;
      T* S = ws.data<T>() + slot * rows * d.Tk;
      // element offsets of the head's Q, K and V (Note [attention views])
      const int64_t Q = d.q.at(b, h), K = d.k.at(b, hk), V = d.v.at(b, hk);
      T* O = c.out(0).data<T>() + d.o.at(b, h);
      for (int64_t r0 = 0; r0 < d.Tq; r0 += rows) {
        const int64_t m = std::min(rows, d.Tq - r0), kn = keys_for(d, r0 + m);
        T* lse = lse_all ? lse_all + bh * d.Tq + r0 : lse_ws.data<T>() + slot * rows;
        if (kn == 0) {  // no keys at all (Tk = 0)
          for (int64_t i = r0; i < r0 + m; ++i) std::fill(O + i * ldo, O + i * ldo + d.Dv, T(0));
          std::fill(lse, lse + m, -std::numeric_limits<T>::infinity());
          continue;
        }
        each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
          gemm_operands<T>(false, true, ms, ks, d.D, static_cast<T>(d.scale), qo,
                           Q + (r0 + s0) * ldq, ldq, ko, K, ldk, T(0), S + s0 * kn, kn);
        });
        mask_scores<T>(d, mask, b, h, r0, m, kn, S);
        softmax_rows<T>(d, r0, m, kn, S, lse, nullptr);
        if (drop.on)
          parallel_for(m, 8 * kn, [&](int, int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i)
              drop.apply(static_cast<uint64_t>((bh * d.Tq + r0 + i) * d.Tk), kn, S + i * kn);
          });
        each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
          gemm_operands<T>(false, false, ms, d.Dv, ks, T(1), GemmOperand(S), s0 * kn, kn, vo, V,
                           ldv, T(0), O + (r0 + s0) * ldo, ldo);
        });
      }
    };
    each_unit(d.B * d.H, slots, rows * d.Tk * (d.D + d.Dv), unit);
  });
}

void infer_attention_grad(InferCtx& c) {
  // dO?, Q, K?, V?, LSE, mask?, dLSE?, scale?
  Shape os;
  const Dims d = infer_dims(c, 1, os);
  c.check(!c.has_in(0) || c.shape(0) == os, "dO must have O's shape");
  c.check(c.has_in(4) && c.shape(4) == Shape{d.B, d.H, d.Tq}, "LSE must be [batch, heads, Tq]");
  c.check(!c.has_in(6) || c.shape(6) == c.shape(4), "dLSE must have LSE's shape");
  const DType dt = qkv_dtype(c, 1);
  c.set_out(0, dt, c.shape(1));
  // (packed: dK and dV are in output 0; outputs 1 and 2, if any, stay empty)
  if (c.has_out(1)) c.set_out(1, dt, c.has_in(2) ? c.shape(2) : Shape{0});
  if (c.has_out(2)) c.set_out(2, dt, c.has_in(3) ? c.shape(3) : Shape{0});
  if (c.has_out(3)) c.set_out(3, dt, {d.B, d.H, d.Tq, d.Tk});
}

void attention_grad_kernel(KernelCtx& c) {
  const Tensor &q = c.in(1), &lse_t = c.in(4);
  const bool packed = !c.has_in(2);  // Note [attention views]
  const Tensor &k = packed ? q : c.in(2), &v = packed ? q : c.in(3);
  const Tensor* dout = c.has_in(0) ? &c.in(0) : nullptr;
  const Tensor* mask = c.has_in(5) ? &c.in(5) : nullptr;
  const Tensor* dlse = c.has_in(6) ? &c.in(6) : nullptr;
  const Dims d = dims_of(c.attrs<AttentionAttrs>(), q, packed ? nullptr : &k, packed ? nullptr : &v,
                         mask, c.has_in(7) ? &c.in(7) : nullptr);
  const int64_t rows = block_rows(d), sb = sub_rows(d, rows), group = d.H / d.Hk;
  // packed: dK and dV are in dQ's tensor (output 0), which then starts at zeros as they do
  Tensor* dk_t = packed ? &c.out(0) : c.has_out(1) ? &c.out(1) : nullptr;
  Tensor* dv_t = packed ? &c.out(0) : c.has_out(2) ? &c.out(2) : nullptr;
  const bool want_mask = c.has_out(3);
  const DropMask drop(c.attrs<AttentionAttrs>(), c.seed);
  const int slots = unit_slots(d.B * d.Hk);  // Note [heads in parallel]
  const DType dt = operands_dtype(c, 1, packed ? 1 : 3);
  const GemmOperand qo(q), ko(k), vo(v);
  const int64_t ldq = d.q.st, ldk = d.k.st, ldv = d.v.st, ldo = d.o.st;
  dispatch_float(dt, c, [&]<class T>() {
    Tensor ws = Tensor::empty({slots, 2, rows, d.Tk}, dt, c.alloc, Category::Workspace, "scores");
    Tensor dws = Tensor::empty({slots, rows}, dt, c.alloc, Category::Workspace, "rowdot");
    if (want_mask) std::memset(c.out(3).raw(), 0, c.out(3).nbytes());
    // A unit: key/value head kh = (b, hk) and its query heads, which add into the same dK and dV.
    auto unit = [&](int slot, int64_t kh) {
      T* P = ws.data<T>() + slot * 2 * rows * d.Tk;
      T* dP = P + rows * d.Tk;
      T* Di = dws.data<T>() + slot * rows;
      const int64_t b = kh / d.Hk, hk = kh % d.Hk;
      // dK and dV accumulate over the group's heads and the row blocks: this unit's rows (and no
      // one else's) start at zero, while they are about to be read anyway (a whole-tensor memset
      // was a pass of its own over memory)
      for (int64_t j = 0; j < d.Tk; ++j) {
        if (dk_t) std::fill_n(dk_t->data<T>() + d.k.at(b, hk) + j * ldk, d.D, T(0));
        if (dv_t) std::fill_n(dv_t->data<T>() + d.v.at(b, hk) + j * ldv, d.Dv, T(0));
      }
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const int64_t qh = (b * d.H + h);
        // element offsets of the heads' Q, K and V (Note [attention views])
        const int64_t Q = d.q.at(b, h), K = d.k.at(b, hk), V = d.v.at(b, hk);
        const T* dO = dout ? dout->data<T>() + d.o.at(b, h) : nullptr;
        const T* L = lse_t.data<T>() + qh * d.Tq;
        const T* dL = dlse ? dlse->data<T>() + qh * d.Tq : nullptr;
        T* dQ = c.out(0).data<T>() + Q;
        T* dK = dk_t ? dk_t->data<T>() + K : nullptr;
        T* dV = dv_t ? dv_t->data<T>() + V : nullptr;
        for (int64_t r0 = 0; r0 < d.Tq; r0 += rows) {
          const int64_t m = std::min(rows, d.Tq - r0), kn = keys_for(d, r0 + m);
          if (kn == 0) {
            for (int64_t i = r0; i < r0 + m; ++i) std::fill(dQ + i * ldq, dQ + i * ldq + d.D, T(0));
            continue;
          }
          // P, recomputed from the saved log-sum-exp.
          each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
            gemm_operands<T>(false, true, ms, ks, d.D, static_cast<T>(d.scale), qo,
                             Q + (r0 + s0) * ldq, ldq, ko, K, ldk, T(0), P + s0 * kn, kn);
          });
          mask_scores<T>(d, mask, b, h, r0, m, kn, P);
          softmax_rows<T>(d, r0, m, kn, P, nullptr, L + r0);
          auto first = [&](int64_t i) {  // the flat position of row i's key 0 in the mask
            return static_cast<uint64_t>((qh * d.Tq + r0 + i) * d.Tk);
          };
          // dV += P^T dO, with the dropped probabilities (made in dP's buffer) under
          // dropout
          if (dV && dO) {
            const T* Pv = P;
            if (drop.on) {
              parallel_for(m, 8 * kn, [&](int, int64_t i0, int64_t i1) {
                for (int64_t i = i0; i < i1; ++i) {
                  std::copy(P + i * kn, P + (i + 1) * kn, dP + i * kn);
                  drop.apply(first(i), kn, dP + i * kn);
                }
              });
              Pv = dP;
            }
            each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
              gemm_ld<T>(true, false, ks, d.Dv, ms, T(1), Pv + s0 * kn, kn, dO + (r0 + s0) * ldo,
                         ldo, T(1), dV, ldv);
            });
          }
          // dP = dO V^T; dS = P * (dP - rowsum(P * dP) + dLSE), 0 past a causal row's diagonal
          if (dO)
            each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
              gemm_operands<T>(false, true, ms, ks, d.Dv, T(1), GemmOperand(dO), (r0 + s0) * ldo,
                               ldo, vo, V, ldv, T(0), dP + s0 * kn, kn);
            });
          else
            std::fill(dP, dP + m * kn, T(0));
          const bool vec = std::is_same_v<T, float> && vmath::active();
          parallel_for(m, (vec ? 2 : 5) * kn, [&](int, int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
              const int64_t lim = row_keys(d, r0 + i, kn);
              T* ds = dP + i * kn;
              const T* p = P + i * kn;
              if (drop.on) drop.apply(first(i), lim, ds);  // the gradient of P before dropout
              // rowsum(P * dP) over rowsum(P): P recomputed from a rounded log-sum-exp sums to
              // 1 + delta, and without the division the row sum of dS would be -delta * rowsum
              // (not 0), a bias in every gradient that is 0 in exact arithmetic (a key bias's).
              double acc = 0, psum = 0;
              if constexpr (std::is_same_v<T, float>) {
                if (vec) vmath::dot_and_sum(p, ds, lim, &acc, &psum);
              }
              if (!vec)
                for (int64_t j = 0; j < lim; ++j) {
                  acc += static_cast<double>(p[j]) * ds[j];
                  psum += p[j];
                }
              acc = psum > 0 ? acc / psum : 0.0;
              if (dL && std::isfinite(static_cast<double>(L[r0 + i]))) acc -= dL[r0 + i];
              Di[i] = static_cast<T>(acc);
              if constexpr (std::is_same_v<T, float>) {
                if (vec) vmath::sub_mul(p, Di[i], ds, lim);
              }
              if (!vec)
                for (int64_t j = 0; j < lim; ++j) ds[j] = p[j] * (ds[j] - Di[i]);
              std::fill(ds + lim, ds + kn, T(0));
            }
          });
          if (want_mask) {  // d mask = dS (the scores' gradient before the scale)
            T* dm = c.out(3).data<T>() + (qh * d.Tq + r0) * d.Tk;
            for (int64_t i = 0; i < m; ++i)
              std::copy(dP + i * kn, dP + (i + 1) * kn, dm + i * d.Tk);
          }
          // dQ = scale dS K;  dK += scale dS^T Q
          each_sub(d, sb, r0, m, kn, [&](int64_t s0, int64_t ms, int64_t ks) {
            gemm_operands<T>(false, false, ms, d.D, ks, static_cast<T>(d.scale), GemmOperand(dP),
                             s0 * kn, kn, ko, K, ldk, T(0), dQ + (r0 + s0) * ldq, ldq);
            if (dK)
              gemm_operands<T>(true, false, ks, d.D, ms, static_cast<T>(d.scale), GemmOperand(dP),
                               s0 * kn, kn, qo, Q + (r0 + s0) * ldq, ldq, T(1), dK, ldk);
          });
        }
      }
    };
    each_unit(d.B * d.Hk, slots, group * rows * d.Tk * (2 * d.D + 2 * d.Dv), unit);
  });
}

// dQ, dK, dV = AttentionGrad(dO, Q, K, V, LSE, mask, dLSE, scale); LSE is the forward's output 1
// (added for the backward when the forward did not make it). A float mask that needs a gradient
// gets dS at full size (summed to the mask's shape by the driver); a boolean mask never does.
void grad_attention(GradBuilder& g) {
  const Node& n = g.node();
  const AttentionAttrs at = attention_attrs(n);
  Attrs a;
  a.set_int("causal", at.causal ? 1 : 0);
  if (at.scale != 0) a.set_float("scale", at.scale);
  if (at.dropout > 0) {  // the same mask (Note [attention dropout])
    a.set_float("dropout", at.dropout);
    a.set_int("stream", static_cast<int64_t>(at.stream));
  }
  // the same views (Note [attention views]); packed: K and V absent, dQ the packed gradient
  if (!at.views.empty()) {
    a.set_ints("views", at.views);
    a.set_ints("out_shape", n.attrs.get_ints("out_shape", {}, n.label()));
  }
  const bool packed = n.inputs.size() < 2 || n.inputs[1] < 0;
  std::vector<int> ins = {g.dy(0), g.x(0), packed ? -1 : g.x(1), packed ? -1 : g.x(2), g.y(1)};
  const bool has_mask = n.inputs.size() > 3 && n.inputs[3] >= 0;
  ins.push_back(has_mask ? g.x(3) : -1);
  ins.push_back(n.outputs.size() > 1 && n.outputs[1] >= 0 ? g.dy(1) : -1);
  const bool has_scale = n.inputs.size() > 4 && n.inputs[4] >= 0;
  ins.push_back(has_scale ? g.x(4) : -1);
  const bool mask_grad = has_mask && g.needs(3) && is_float(g.val(g.x(3)).dtype);
  std::vector<int> outs = g.emit("AttentionGrad", ins, a, mask_grad ? 4 : 3, "graft");
  g.set_dx(0, outs[0]);
  if (!packed && g.needs(1))
    g.set_dx(1, outs[1]);
  else
    g.drop_output(outs[1]);
  if (!packed && g.needs(2))
    g.set_dx(2, outs[2]);
  else
    g.drop_output(outs[2]);
  if (mask_grad) g.set_dx(3, outs[3]);
}

// Two GEMMs of Tq x Tk x D per (batch, head) forward (half of it under the causal triangle).
double attention_flops(const Graph& g, const Node& n) {
  const AttentionAttrs a = attention_attrs(n);
  Dims d{};
  if (a.views.empty()) {
    const Shape &q = g.values[n.inputs[0]].shape, &k = g.values[n.inputs[1]].shape,
                &v = g.values[n.inputs[2]].shape;
    if (q.size() != 4 || k.size() != 4 || v.size() != 4) return 0;
    set_views(d, a.views, q, k, v);
  } else {
    set_views(d, a.views, {}, {}, {});
  }
  const double f =
      2.0 * static_cast<double>(d.B * d.H * d.Tq * d.Tk) * static_cast<double>(d.D + d.Dv);
  return a.causal ? f / 2 : f;
}

const OpDef kOps[] = {
    {.name = "Attention",
     .domain = "graft",
     .min_in = 1,  // (K and V: Note [attention views])
     .max_in = 5,
     .min_out = 1,
     .max_out = 2,
     .infer = infer_attention,
     .prepare = prepare_attention,
     .kernel = attention_kernel,
     .grad = grad_attention,
     .foldable = false,  // (with dropout, each run draws its own mask: never a constant)
     .nondiff_inputs = {4},
     .flops = attention_flops},
    {.name = "AttentionGrad",
     .domain = "graft",
     .min_in = 2,  // (K, V and LSE: the shape function)
     .max_in = 8,
     .min_out = 1,
     .max_out = 4,
     .infer = infer_attention_grad,
     .prepare = prepare_attention,
     .kernel = attention_grad_kernel},
};

}  // namespace

void register_attention_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
