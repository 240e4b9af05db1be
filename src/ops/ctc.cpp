// graft's CTCLoss and CTCLossGrad: connectionist temporal classification (speech, OCR), as
// PyTorch's _ctc_loss computes it.
//
// CTCLoss(log_probs [T, N, C], targets [N, S] (padded) or [sum of target lengths] (concatenated),
//         input_lengths [N], target_lengths [N]; blank, zero_infinity) -> nll [N]
// Per sequence n, over the extended label l' = (blank, l1, blank, l2, ..., blank) of length
// L = 2 * target_length + 1, the forward variables in log space
//   alpha_0(0) = lp[0, blank], alpha_0(1) = lp[0, l1],
//   alpha_t(s) = lp[t, l'(s)] + logsumexp(alpha_{t-1}(s), alpha_{t-1}(s-1),
//                                         alpha_{t-1}(s-2) where l'(s) != blank, l'(s) != l'(s-2)),
// and nll = -logsumexp(alpha_{T_n-1}(L-1), alpha_{T_n-1}(L-2)). zero_infinity: an impossible
// alignment (nll = inf) gives 0 and a zero gradient.
// CTCLossGrad(dnll [N], log_probs, targets, input_lengths, target_lengths) -> dlog_probs: with
// the backward variables beta (emission included, as PyTorch's), for t < T_n
//   d lp[t, n, c] = dnll[n] * (exp(lp[t, n, c]) - exp(lcab(t, c) + nll - lp[t, n, c])),
// lcab(t, c) = logsumexp over s with l'(s) = c of alpha_t(s) + beta_t(s); 0 for t >= T_n. This is
// PyTorch's gradient, which takes log_probs to be a log_softmax's output (the exp(lp) term).
// The recursions run in double, per sequence, parallel over the batch; backward recomputes alpha
// instead of keeping it from the forward (O(T * L) per sequence, no saved [T, N, L] tensor).
#include <cmath>
#include <limits>

#include "util.h"

namespace graft {
namespace {
using namespace opsutil;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double lse(double a, double b) {
  if (a == kNegInf) return b;
  if (b == kNegInf) return a;
  const double m = std::max(a, b);
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

struct CtcSeq {
  int64_t T = 0;  // input length
  int64_t blank = 0;
  std::vector<int64_t> labels;  // the target (without blanks)
  int64_t L() const { return 2 * static_cast<int64_t>(labels.size()) + 1; }
  int64_t ext(int64_t i) const { return i % 2 == 0 ? blank : labels[i / 2]; }  // l'(i)
};

struct CtcAttrs {
  int64_t blank = 0;           // the blank class (checked against C by ctc_seqs)
  bool zero_infinity = false;  // an infinite loss (an impossible target) counts as 0
};
CtcAttrs ctc_attrs(const Node& n) {
  return {n.attrs.get_int("blank", 0, n.label()),
          n.attrs.get_int("zero_infinity", 0, n.label()) != 0};
}
std::shared_ptr<const void> prepare_ctc(const Node& n) { return prepared(ctc_attrs(n)); }

// Each sequence's input length and target, checked (an error names the node and the value), from
// the node's inputs first .. first + 3: log_probs, targets, input_lengths, target_lengths.
std::vector<CtcSeq> ctc_seqs(const KernelCtx& c, int first) {
  const Tensor &lp = c.in(first), &tg = c.in(first + 1), &il = c.in(first + 2),
               &tl = c.in(first + 3);
  const int64_t Tmax = lp.dim(0), N = lp.dim(1), C = lp.dim(2);
  const int64_t blank = c.attrs<CtcAttrs>().blank;
  if (blank < 0 || blank >= C) c.error(ErrorKind::InvalidArgument, "blank is outside [0, C)");
  const bool padded = tg.rank() == 2;
  std::vector<CtcSeq> seqs(N);
  int64_t offset = 0;
  for (int64_t n = 0; n < N; ++n) {
    CtcSeq& s = seqs[n];
    s.T = il.data<int64_t>()[n];
    s.blank = blank;
    const int64_t len = tl.data<int64_t>()[n];
    if (s.T < 0 || s.T > Tmax)
      c.error(ErrorKind::InvalidArgument, "input_lengths[" + std::to_string(n) +
                                              "] = " + std::to_string(s.T) + " is outside [0, " +
                                              std::to_string(Tmax) + "]");
    if (len < 0 || (padded && len > tg.dim(1)) || (!padded && offset + len > tg.dim(0)))
      c.error(ErrorKind::InvalidArgument,
              "target_lengths[" + std::to_string(n) + "] = " + std::to_string(len) +
                  " does not fit the targets of shape " + shape_str(tg.shape()));
    const int64_t* t = tg.data<int64_t>() + (padded ? n * tg.dim(1) : offset);
    offset += padded ? 0 : len;
    for (int64_t i = 0; i < len; ++i) {
      if (t[i] < 0 || t[i] >= C || t[i] == blank)
        c.error(ErrorKind::InvalidArgument,
                "target label " + std::to_string(t[i]) + " of sequence " + std::to_string(n) +
                    " is the blank or outside [0, " + std::to_string(C) + ")");
      s.labels.push_back(t[i]);
    }
  }
  return seqs;
}

// log alpha [T][L] (T = s.T) of one sequence; returns the nll.
template <class T>
double ctc_alpha(const T* lp, int64_t N, int64_t C, int64_t n, const CtcSeq& s,
                 std::vector<double>& alpha) {
  const int64_t L = s.L(), blank = s.blank;
  auto lab = [&](int64_t i) { return s.ext(i); };
  auto at = [&](int64_t t, int64_t cl) { return static_cast<double>(lp[(t * N + n) * C + cl]); };
  alpha.assign(static_cast<size_t>(std::max<int64_t>(s.T, 1) * L), kNegInf);
  if (s.T == 0) return L <= 1 ? 0.0 : std::numeric_limits<double>::infinity();
  alpha[0] = at(0, blank);
  if (L > 1) alpha[1] = at(0, lab(1));
  for (int64_t t = 1; t < s.T; ++t)
    for (int64_t i = 0; i < L; ++i) {
      const double* prev = &alpha[(t - 1) * L];
      double v = prev[i];
      if (i >= 1) v = lse(v, prev[i - 1]);
      if (i >= 2 && lab(i) != blank && lab(i) != lab(i - 2)) v = lse(v, prev[i - 2]);
      alpha[t * L + i] = v == kNegInf ? kNegInf : v + at(t, lab(i));
    }
  const double* last = &alpha[(s.T - 1) * L];
  return -(L > 1 ? lse(last[L - 1], last[L - 2]) : last[0]);
}

void infer_ctc(InferCtx& c) {
  require_float(c, 0);
  const Shape& lp = c.shape(0);
  c.check(lp.size() == 3, "log_probs must be [T, N, C]");
  c.check(c.dtype(1) == DType::I64 && c.dtype(2) == DType::I64 && c.dtype(3) == DType::I64,
          "targets and lengths must be int64");
  c.check(c.shape(1).size() == 1 || (c.shape(1).size() == 2 && c.shape(1)[0] == lp[1]),
          "targets must be [N, S] or concatenated [sum of target lengths]");
  c.check(c.shape(2) == Shape{lp[1]} && c.shape(3) == Shape{lp[1]},
          "input_lengths and target_lengths must be [N]");
  c.set_out(0, c.dtype(0), {lp[1]});
}
void ctc_kernel(KernelCtx& c) {
  dispatch_float(c.in(0).dtype(), c, [&]<class T>() {
    const Tensor& lp = c.in(0);
    const int64_t N = lp.dim(1), C = lp.dim(2);
    const bool zero_inf = c.attrs<CtcAttrs>().zero_infinity;
    const std::vector<CtcSeq> seqs = ctc_seqs(c, 0);
    T* out = c.out(0).data<T>();
    parallel_for(N, lp.dim(0) * 8, [&](int, int64_t n0, int64_t n1) {
      std::vector<double> alpha;
      for (int64_t n = n0; n < n1; ++n) {
        const double nll = ctc_alpha(lp.data<T>(), N, C, n, seqs[n], alpha);
        out[n] = static_cast<T>(zero_inf && std::isinf(nll) ? 0.0 : nll);
      }
    });
  });
}

void infer_ctc_grad(InferCtx& c) { c.set_out(0, c.dtype(1), c.shape(1)); }
void ctc_grad_kernel(KernelCtx& c) {
  dispatch_float(c.in(1).dtype(), c, [&]<class T>() {
    const Tensor &dl = c.in(0), &lpt = c.in(1);
    const int64_t Tmax = lpt.dim(0), N = lpt.dim(1), C = lpt.dim(2);
    const bool zero_inf = c.attrs<CtcAttrs>().zero_infinity;
    const std::vector<CtcSeq> seqs = ctc_seqs(c, 1);  // dnll comes first
    const T* lp = lpt.data<T>();
    T* dx = c.out(0).data<T>();
    parallel_for(N, Tmax * C * 8, [&](int, int64_t n0, int64_t n1) {
      std::vector<double> alpha, beta, lcab;
      for (int64_t n = n0; n < n1; ++n) {
        const CtcSeq& s = seqs[n];
        const double nll = ctc_alpha(lp, N, C, n, s, alpha);
        const double g = static_cast<double>(dl.data<T>()[n]);
        const int64_t L = s.L(), blank = s.blank;
        auto lab = [&](int64_t i) { return s.ext(i); };
        auto at = [&](int64_t t, int64_t cl) {
          return static_cast<double>(lp[(t * N + n) * C + cl]);
        };
        // zero_infinity: an impossible alignment contributes nothing. Without it the formula
        // runs on (inf - inf: NaN, as PyTorch's).
        const bool dead = std::isinf(nll) && zero_inf;
        for (int64_t t = 0; t < Tmax; ++t)
          for (int64_t cl = 0; cl < C; ++cl)
            dx[(t * N + n) * C + cl] =
                t < s.T && !dead ? static_cast<T>(g * std::exp(at(t, cl))) : T(0);
        if (dead || s.T == 0) continue;
        beta.assign(static_cast<size_t>(s.T * L), kNegInf);
        beta[(s.T - 1) * L + L - 1] = at(s.T - 1, blank);
        if (L > 1) beta[(s.T - 1) * L + L - 2] = at(s.T - 1, lab(L - 2));
        for (int64_t t = s.T - 2; t >= 0; --t)
          for (int64_t i = 0; i < L; ++i) {
            const double* next = &beta[(t + 1) * L];
            double v = next[i];
            if (i + 1 < L) v = lse(v, next[i + 1]);
            if (i + 2 < L && lab(i) != blank && lab(i) != lab(i + 2)) v = lse(v, next[i + 2]);
            beta[t * L + i] = v == kNegInf ? kNegInf : v + at(t, lab(i));
          }
        lcab.assign(static_cast<size_t>(C), kNegInf);
        for (int64_t t = 0; t < s.T; ++t) {
          std::fill(lcab.begin(), lcab.end(), kNegInf);
          for (int64_t i = 0; i < L; ++i)
            lcab[lab(i)] = lse(lcab[lab(i)], alpha[t * L + i] + beta[t * L + i]);
          for (int64_t cl = 0; cl < C; ++cl)
            if (lcab[cl] != kNegInf)
              dx[(t * N + n) * C + cl] =
                  static_cast<T>(g * (std::exp(at(t, cl)) - std::exp(lcab[cl] + nll - at(t, cl))));
        }
      }
    });
  });
}

// dlog_probs = CTCLossGrad(dnll, log_probs, targets, lengths): no gradient to the integers.
void grad_ctc(GradBuilder& g) {
  Attrs a;
  const CtcAttrs ca = ctc_attrs(g.node());
  a.set_int("blank", ca.blank);
  a.set_int("zero_infinity", ca.zero_infinity);
  g.set_dx(0, g.emit1("CTCLossGrad", {g.dy(0), g.x(0), g.x(1), g.x(2), g.x(3)}, a, "graft"));
}

const OpDef kOps[] = {
    {.name = "CTCLoss",
     .domain = "graft",
     .min_in = 4,
     .max_in = 4,
     .infer = infer_ctc,
     .prepare = prepare_ctc,
     .kernel = ctc_kernel,
     .grad = grad_ctc,
     .nondiff_inputs = {1, 2, 3}},
    {.name = "CTCLossGrad",
     .domain = "graft",
     .min_in = 5,
     .max_in = 5,
     .infer = infer_ctc_grad,
     .prepare = prepare_ctc,
     .kernel = ctc_grad_kernel},
};

}  // namespace

void register_ctc_ops(std::vector<const OpDef*>& t) {
  for (const OpDef& d : kOps) t.push_back(&d);
}

}  // namespace graft
