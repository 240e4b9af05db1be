// Inputs the fuzzer (tools/fuzz) once crashed on. Each must now end in a typed graft::Error or
// succeed, through the same path as the fuzz target: import -> shape inference -> plan.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "graft/ops.h"
#include "graft/plan.h"

using namespace graft;

TEST(FuzzRegressions, EveryFindingIsHandled) {
  std::filesystem::path dir = std::filesystem::path(GRAFT_SOURCE_DIR) / "tests" / "fuzz_regressions";
  int n = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    SCOPED_TRACE(f.path().string());
    std::ifstream in(f.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    Allocator alloc;
    alloc.set_limit(int64_t(256) << 20);
    ImportOptions io;
    io.alloc = &alloc;
    try {
      Graph g = load_onnx_bytes(ss.str(), "", io);
      std::map<std::string, Shape> shapes;
      for (int v : g.inputs) {
        Shape s = g.values[v].shape;
        for (auto& d : s)
          if (d < 0) d = 2;
        shapes[g.values[v].name] = s;
      }
      infer_shapes(g, shapes, &alloc);
      PlanOptions po;
      po.keep = g.outputs;
      make_plan(g, po);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).size(), 0u);
    }
    ++n;
  }
  EXPECT_GT(n, 0);
}
