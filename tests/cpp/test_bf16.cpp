// Mixed precision (Note [bf16 GEMMs]): under RunOptions::bf16 the float32 GEMMs round both operands
// to bfloat16 and accumulate in float32; nothing else changes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "graft/models.h"
#include "graft/ops.h"
#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using graft_test::session_options;

namespace {

float round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &b, 4);
  return x;
}

// One Linear(H, H) + ReLU, loss = mean: gradients of every parameter after one step.
std::vector<std::vector<float>> grads(bool bf16, bool bf16_exact_operands, int64_t H = 256) {
  Allocator alloc;
  SessionOptions o = session_options(alloc);
  o.bf16 = bf16;
  const int64_t B = 64;  // d loss / d y = 1 / (B H), a power of two: a bf16 number
  TrainSession s(linear_stack(B, H, 1, DType::F32, alloc, 3), o);
  Tensor x = Tensor::empty({B, H}, DType::F32, alloc, Category::Activation);
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = std::sin(0.37f * i);
  if (bf16_exact_operands) {
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = round_bf16(x.data<float>()[i]);
    for (Parameter& p : s.parameters())
      for (int64_t i = 0; i < p.data.numel(); ++i)
        p.data.data<float>()[i] = round_bf16(p.data.data<float>()[i]);
  }
  s.set_input("x", x);
  s.step();
  std::vector<std::vector<float>> out;
  for (const Parameter& p : s.parameters())
    out.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  return out;
}

double max_rel(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double err = 0, scale = 0;
  for (size_t k = 0; k < a.size(); ++k)
    for (size_t i = 0; i < a[k].size(); ++i) {
      err = std::max(err, static_cast<double>(std::fabs(a[k][i] - b[k][i])));
      scale = std::max(scale, static_cast<double>(std::fabs(b[k][i])));
    }
  return err / scale;
}

}  // namespace

TEST(Bf16, GemmsRoundTheirOperandsAndAccumulateInFloat32) {
  if (!bf16_matmul_native()) GTEST_SKIP() << "this CPU has neither AVX512-BF16 nor AMX";
  // Operands already bfloat16-exact: rounding changes nothing, so bf16 equals fp32 up to the order
  // of float32 accumulation.
  EXPECT_LT(max_rel(grads(true, true), grads(false, true)), 1e-5);
  // Arbitrary float32 operands: the products see them rounded (8 bits of mantissa), so the
  // gradients move by about bf16's precision, no more; and the path is really taken.
  const double e = max_rel(grads(true, false), grads(false, false));
  EXPECT_GT(e, 1e-5);
  EXPECT_LT(e, 2e-2);
}

TEST(Bf16, SmallProductsRunTheSameArithmetic) {
  // 64 x 32 x 32: under the size where oneDNN is called; OpenBLAS on rounded operands instead.
  EXPECT_LT(max_rel(grads(true, true, 32), grads(false, true, 32)), 1e-5);
  const double e = max_rel(grads(true, false, 32), grads(false, false, 32));
  EXPECT_GT(e, 1e-5);
  EXPECT_LT(e, 2e-2);
}
