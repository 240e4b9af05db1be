// Note [oneDNN convolutions]
// Dense float32 convolutions (and, under a Bf16MatmulScope, their bf16 form) run oneDNN's JIT
// convolution primitives, the library PyTorch's CPU eager uses for the same layers: direct
// AVX-512 / AMX kernels on blocked layouts (nChw16c and friends), which run far closer to the
// sgemm ceiling than im2col + a skinny sgemm (docs/conv-performance.md, "Measured", "History").
//   * Layouts: graft's tensors are plain NC[D]HW; each primitive is created with format `any`, and
//     when the layout (or, for bf16, the data type) it picks differs from the plain one, the
//     operand is reordered into the scratch (and the result reordered back). The reorder to bf16
//     rounds to nearest even, as the GEMM path does.
//   * Memory: the scratch (reordered operands plus oneDNN's own scratchpad, scratchpad_mode::user)
//     is allocated by the caller from graft's allocator as a Workspace, so every byte is counted
//     and freed at the end of the kernel.
//   * Cost: primitive creation (JIT code generation) takes milliseconds; a primitive, its reorders
//     and its scratch layout are created once per (geometry, pass, precision, bias) and cached for
//     the process.
//   * Determinism: oneDNN's CPU primitives are run-to-run deterministic for a given thread count
//     (no atomics); dW sums over the batch in a thread-count-dependent order, like a GEMM's K
//     split.
// float64 never comes here (im2col + GEMM in conv.cpp), nor do depthwise convolutions, whose direct
// kernels in conv.cpp are faster than oneDNN 2.6's backward for them.
#include "conv_dnnl.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <tuple>
#include <unordered_map>

#include "graft/core.h"
#include "lru.h"
#include "util.h"

namespace graft::opsutil {
namespace {
using dnnl::memory;
using dt = memory::data_type;

memory::format_tag plain_tag(size_t rank) {
  using t = memory::format_tag;
  switch (rank) {
    case 1:
      return t::a;
    case 3:
      return t::abc;
    case 4:
      return t::abcd;
    case 5:
      return t::abcde;
    case 6:
      return t::abcdef;
    default:
      return t::undef;
  }
}

// The channel-blocked layout of an activation of this rank (Note [channel-blocked values]).
memory::format_tag blocked_tag(size_t rank) {
  using t = memory::format_tag;
  return rank == 3 ? t::aBc16b : rank == 4 ? t::aBcd16b : rank == 5 ? t::aBcde16b : t::undef;
}

// graft's descriptors of x (or dx), w (or dw) and y (or dy): plain, or x and y channel-blocked.
struct Plain {
  memory::desc x, w, y, b;
};
Plain plain(const ConvShape& s) {
  memory::dims x{s.N, s.C}, y{s.N, s.M}, w;
  x.insert(x.end(), s.in.begin(), s.in.end());
  y.insert(y.end(), s.out.begin(), s.out.end());
  if (s.g > 1) w.push_back(s.g);
  w.push_back(s.M / s.g);
  w.push_back(s.C / s.g);
  w.insert(w.end(), s.k.begin(), s.k.end());
  auto tag = [](bool blocked, size_t rank) {
    return blocked ? blocked_tag(rank) : plain_tag(rank);
  };
  return {memory::desc(x, s.x_bf16 ? dt::bf16 : dt::f32, tag(s.x_blocked, x.size())),
          memory::desc(w, dt::f32, plain_tag(w.size())),
          memory::desc(y, s.y_bf16 ? dt::bf16 : dt::f32, tag(s.y_blocked, y.size())),
          memory::desc({s.M}, dt::f32, memory::format_tag::a)};
}

// One operand of a primitive: when the primitive's layout/type differs from the plain float32
// one, it is reordered into (or, for an output, out of) scratch at `offset`.
struct Operand {
  memory::desc user, want;  // graft's plain float32 layout, the primitive's
  bool reorder = false;
  dnnl::reorder to, from;  // plain -> want (inputs), want -> plain (outputs)
  size_t offset = 0;
};
}  // namespace

struct DnnlConv {
  dnnl::primitive prim;
  Operand a, b, c;  // forward: x, w, y; data: dy, w, dx; weights: x, dy, dw
  int arg_a = 0, arg_b = 0, arg_c = 0, arg_bias = 0;  // their DNNL_ARG_*, and the bias's
  memory::desc bias;                                  // [M], plain
  memory::desc pad;  // oneDNN's scratchpad, at pad_offset in the scratch
  size_t pad_offset = 0, bytes = 0;
};

namespace {

size_t align64(size_t n) { return (n + 63) / 64 * 64; }

void prepare(Operand& o, const memory::desc& user, bool input, size_t& bytes) {
  o.user = user;
  o.reorder = o.want != user;
  if (!o.reorder) return;
  if (input)
    o.to = dnnl::reorder(dnnl::reorder::primitive_desc(dnnl_engine(), user, dnnl_engine(), o.want));
  else
    o.from =
        dnnl::reorder(dnnl::reorder::primitive_desc(dnnl_engine(), o.want, dnnl_engine(), user));
  o.offset = bytes;
  bytes += align64(o.want.get_size());
}

using Key = std::tuple<std::vector<int64_t>, int, bool, bool>;  // (geometry and layouts, ...)

Key key_of(const ConvShape& s, ConvPass pass, bool bf16, bool bias) {
  std::vector<int64_t> k{
      s.N,         s.C,         s.M,      s.g,     static_cast<int64_t>(s.in.size()),
      s.x_blocked, s.y_blocked, s.x_bf16, s.y_bf16};
  for (const auto* v : {&s.in, &s.out, &s.k, &s.stride, &s.dil, &s.pad_begin, &s.pad_end})
    k.insert(k.end(), v->begin(), v->end());
  return {k, static_cast<int>(pass), bf16, bias};
}

// Creates the entry; throws dnnl::error when oneDNN has no implementation.
DnnlConv create(const ConvShape& s, ConvPass pass, bool bf16, bool bias) {
  const Plain p = plain(s);
  const dt lo = bf16 ? dt::bf16 : dt::f32;  // the products' operand type
  auto any = [](const memory::desc& d, dt t) {
    return memory::desc(d.dims(), t, memory::format_tag::any);
  };
  memory::dims stride(s.stride.begin(), s.stride.end()), dil,
      pl(s.pad_begin.begin(), s.pad_begin.end());
  memory::dims pr;
  for (size_t i = 0; i < s.in.size(); ++i) {
    dil.push_back(s.dil[i] - 1);  // oneDNN counts dilation from 0
    // oneDNN wants the end padding that makes its output size formula exact.
    const int64_t ek = s.dil[i] * (s.k[i] - 1) + 1;
    pr.push_back((s.out[i] - 1) * s.stride[i] + ek - s.in[i] - s.pad_begin[i]);
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto alg = dnnl::algorithm::convolution_direct;
  using fwd = dnnl::convolution_forward;
  const memory::desc xa = any(p.x, lo), wa = any(p.w, lo),
                     ya = any(p.y, pass != ConvPass::Forward ? lo
                                   : s.y_bf16                ? dt::bf16
                                                             : dt::f32);
  // The forward description is the hint the backward passes are created from.
  fwd::desc fd =
      bias && pass == ConvPass::Forward
          ? fwd::desc(dnnl::prop_kind::forward_training, alg, xa, wa, p.b, ya, stride, dil, pl, pr)
          : fwd::desc(dnnl::prop_kind::forward_training, alg, xa, wa, ya, stride, dil, pl, pr);
  DnnlConv e;
  e.bias = p.b;
  size_t bytes = 0;
  if (pass == ConvPass::Forward) {
    e.arg_a = DNNL_ARG_SRC, e.arg_b = DNNL_ARG_WEIGHTS, e.arg_c = DNNL_ARG_DST;
    e.arg_bias = DNNL_ARG_BIAS;
    fwd::primitive_desc pd(fd, attr, dnnl_engine());
    e.a.want = pd.src_desc(), e.b.want = pd.weights_desc(), e.c.want = pd.dst_desc();
    prepare(e.a, p.x, true, bytes), prepare(e.b, p.w, true, bytes), prepare(e.c, p.y, false, bytes);
    e.pad = pd.scratchpad_desc();
    e.prim = fwd(pd);
  } else if (pass == ConvPass::BackwardData) {
    e.arg_a = DNNL_ARG_DIFF_DST, e.arg_b = DNNL_ARG_WEIGHTS, e.arg_c = DNNL_ARG_DIFF_SRC;
    fwd::primitive_desc hint(fd, dnnl_engine());
    using bwd = dnnl::convolution_backward_data;
    bwd::primitive_desc pd(bwd::desc(alg, any(p.x, dt::f32), wa, any(p.y, lo), stride, dil, pl, pr),
                           attr, dnnl_engine(), hint);
    e.a.want = pd.diff_dst_desc(), e.b.want = pd.weights_desc(), e.c.want = pd.diff_src_desc();
    prepare(e.a, p.y, true, bytes), prepare(e.b, p.w, true, bytes), prepare(e.c, p.x, false, bytes);
    e.pad = pd.scratchpad_desc();
    e.prim = bwd(pd);
  } else {
    e.arg_a = DNNL_ARG_SRC, e.arg_b = DNNL_ARG_DIFF_DST, e.arg_c = DNNL_ARG_DIFF_WEIGHTS;
    e.arg_bias = DNNL_ARG_DIFF_BIAS;
    fwd::primitive_desc hint(fd, dnnl_engine());
    using bwd = dnnl::convolution_backward_weights;
    const memory::desc dwa = any(p.w, dt::f32), dya = any(p.y, lo);
    bwd::primitive_desc pd(bias ? bwd::desc(alg, xa, dwa, p.b, dya, stride, dil, pl, pr)
                                : bwd::desc(alg, xa, dwa, dya, stride, dil, pl, pr),
                           attr, dnnl_engine(), hint);
    e.a.want = pd.src_desc(), e.b.want = pd.diff_dst_desc(), e.c.want = pd.diff_weights_desc();
    prepare(e.a, p.x, true, bytes), prepare(e.b, p.y, true, bytes), prepare(e.c, p.w, false, bytes);
    if (bias && pd.diff_bias_desc() != p.b)
      throw dnnl::error(dnnl_unimplemented, "the bias gradient's layout is not plain");
    e.pad = pd.scratchpad_desc();
    e.prim = bwd(pd);
  }
  e.pad_offset = bytes;
  e.bytes = bytes + align64(e.pad.get_size());
  return e;
}

// The cached pass, or null when oneDNN cannot run this convolution (Note [primitive caches],
// lru.h).
std::shared_ptr<const DnnlConv> cached(const ConvShape& s, ConvPass pass, bool bf16, bool bias) {
  static LruCache<Key, const DnnlConv> cache(kPrimitiveCacheCapacity);
  return cache.get(key_of(s, pass, bf16, bias), [&]() -> std::shared_ptr<const DnnlConv> {
    const size_t rank = s.in.size() + 2;
    if (rank < 3 || rank > 5) return nullptr;
    try {
      return std::make_shared<const DnnlConv>(create(s, pass, bf16, bias));
    } catch (const dnnl::error&) {
      return nullptr;  // no implementation (e.g. bf16 on a CPU without AVX-512): the im2col path
    }
  });
}

// Runs e: a and b are inputs, c the output, `bias` the bias (forward) or its gradient (weights),
// in graft's layouts and types (plain(s)).
void run(const DnnlConv& e, const void* a, const void* b, void* c, const float* bias,
         void* scratch) {
  dnnl::stream st(dnnl_engine());
  char* base = static_cast<char*>(scratch);
  auto input = [&](const Operand& o, const void* ptr) {
    memory mu(o.user, dnnl_engine(), const_cast<void*>(ptr));
    if (!o.reorder) return mu;
    memory mw(o.want, dnnl_engine(), base + o.offset);
    o.to.execute(st, mu, mw);
    return mw;
  };
  memory ma = input(e.a, a), mb = input(e.b, b);
  memory mu_c(e.c.user, dnnl_engine(), c);
  memory mc = e.c.reorder ? memory(e.c.want, dnnl_engine(), base + e.c.offset) : mu_c;
  std::unordered_map<int, memory> args{{e.arg_a, ma}, {e.arg_b, mb}, {e.arg_c, mc}};
  if (e.pad.get_size() > 0)
    args.emplace(DNNL_ARG_SCRATCHPAD, memory(e.pad, dnnl_engine(), base + e.pad_offset));
  if (bias) args.emplace(e.arg_bias, memory(e.bias, dnnl_engine(), const_cast<float*>(bias)));
  e.prim.execute(st, args);
  if (e.c.reorder) e.c.from.execute(st, mc, mu_c);
  st.wait();
}
}  // namespace

bool dnnl_conv_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("GRAFT_CONV");
    return !(v && std::string(v) == "im2col");
  }();
  return on;
}

bool dnnl_conv_blocked_ok() {
  static const bool ok = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    const auto core = static_cast<unsigned>(dnnl::cpu_isa::avx512_core);
    return (isa & core) == core;  // the ISA values nest: each includes the bits of those below
  }();
  return dnnl_conv_enabled() && ok;
}

std::shared_ptr<const DnnlConv> dnnl_conv(const ConvShape& s, ConvPass pass, bool bf16, bool bias) {
  return dnnl_conv_enabled() ? cached(s, pass, bf16, bias) : nullptr;
}

int64_t dnnl_conv_scratch(const DnnlConv& c) { return static_cast<int64_t>(c.bytes); }

void dnnl_conv_forward(const DnnlConv& c, const void* x, const float* w, const float* b, void* y,
                       void* scratch) {
  run(c, x, w, y, b, scratch);
}

void dnnl_conv_backward_data(const DnnlConv& c, const void* dy, const float* w, float* dx,
                             void* scratch) {
  run(c, dy, w, dx, nullptr, scratch);
}

void dnnl_conv_backward_weights(const DnnlConv& c, const void* dy, const void* x, float* dw,
                                float* db, void* scratch) {
  run(c, x, dy, dw, db, scratch);
}

}  // namespace graft::opsutil
