// What the C++ tests share: a temporary folder that is always removed, and the set-up every test
// session starts from.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

#include "graft/train.h"

namespace graft_test {

// A fresh, empty folder under the system's temporary directory, named by mkdtemp (unique, so
// parallel runs and the instances of a parameterized test never share one) and removed with all
// it holds when the object goes out of scope, however the test ends.
struct TempDir {
  std::filesystem::path path;

  explicit TempDir(const std::string& prefix = "graft_test_") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw std::system_error(errno, std::generic_category(), "mkdtemp " + tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;  // never throws: a folder the test already removed is fine
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // A path in the folder: dir / "a.graft".
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// The options a test session starts from: the graph output "loss" is the loss, memory comes from
// `alloc`, gradients leave in `mode`. A test sets what else it varies on the result.
inline graft::SessionOptions session_options(graft::Allocator& alloc,
                                             graft::GradMode mode = graft::GradMode::Accumulate) {
  graft::SessionOptions o;
  o.loss = "loss";
  o.alloc = &alloc;
  o.mode = mode;
  return o;
}

// The [b, h] input the linear-stack tests train on: small fixed values, (i * 37 % 19 - 9) / 7.
inline graft::Tensor ramp_input(graft::Allocator& alloc, int64_t b, int64_t h,
                                graft::DType dtype = graft::DType::F32) {
  graft::Tensor x = graft::Tensor::empty({b, h}, dtype, alloc, graft::Category::Workspace);
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (dtype == graft::DType::F64)
      x.data<double>()[i] = static_cast<double>((i * 37 % 19) - 9) / 7.0;
    else
      x.data<float>()[i] = static_cast<float>((i * 37 % 19) - 9) / 7.0f;
  }
  return x;
}

// x rounded to the nearest bfloat16 (ties to even), as a float: operands a bf16 product sees
// unchanged.
inline float round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &b, 4);
  return x;
}

}  // namespace graft_test
