// Inputs the fuzzers (tools/fuzz) once crashed on. Each must now end in a typed graft::Error or
// succeed, through the same path as its fuzz target:
//   tests/fuzz_regressions/*.onnx        fuzz_import: import -> shape inference -> plan
//   tests/fuzz_regressions/files/*.bin   fuzz_files: the .pb tensor loader / checkpoint reader
//                                        (first byte picks which, see fuzz/files_target.h)
// Inputs that still crash wait in tests/fuzz_regressions/pending/, which is not replayed.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "../../fuzz/files_target.h"
#include "graft/ops.h"
#include "graft/plan.h"
#include "test_util.h"

using namespace graft;
using graft_test::TempDir;
namespace fs = std::filesystem;

namespace {
const fs::path kDir = fs::path(GRAFT_SOURCE_DIR) / "tests" / "fuzz_regressions";

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void replay_files_input(const std::string& bytes, const std::string& dir) {
  try {
    graft_fuzz::run_files_input(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), dir);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).size(), 0u);
  }
}
}  // namespace

TEST(FuzzRegressions, EveryFindingIsHandled) {
  int n = 0;
  for (const auto& f : fs::directory_iterator(kDir)) {
    if (!f.is_regular_file() || f.path().extension() != ".onnx") continue;
    SCOPED_TRACE(f.path().string());
    Allocator alloc;
    alloc.set_limit(int64_t(256) << 20);
    ImportOptions io;
    io.alloc = &alloc;
    try {
      Graph g = load_onnx_bytes(read_all(f.path()), "", io);
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

TEST(FuzzRegressions, EveryFileReaderFindingIsHandled) {
  // A fresh folder laid out as fuzz_files lays out its own (with the external-data file).
  TempDir tmp("graft-fuzz-regress-");
  const std::string dir = tmp.path.string();
  graft_fuzz::write_external_data(dir);
  // Edge inputs of the harness itself: empty, a lone mode byte for each reader, a mode-2 frame
  // too short to repair, and a repaired frame whose header size points past the file.
  for (std::string b :
       {std::string(), std::string(1, '\0'), std::string(1, '\1'), std::string(1, '\2'),
        std::string("\2GRAFTCKP", 9),
        std::string("\2GRAFTCKP\1\0\0\0\0\0\0\0\377\377\377\377\377\377\377\377", 25) +
            std::string(40, 'x')})
    replay_files_input(b, dir);
  const fs::path files = kDir / "files";
  if (!fs::is_directory(files)) return;
  for (const auto& f : fs::directory_iterator(files)) {
    if (!f.is_regular_file() || f.path().extension() != ".bin") continue;
    SCOPED_TRACE(f.path().string());
    replay_files_input(read_all(f.path()), dir);
  }
}
