// libFuzzer target: ONNX bytes -> import -> shape inference (with folding) -> plan.
// Any graft::Error is an accepted outcome; a crash, hang, leak or sanitizer report is a bug.
#include <cstdint>
#include <map>
#include <string>

#include "graft/ops.h"
#include "graft/plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    graft::Allocator alloc;
    graft::ImportOptions io;
    io.alloc = &alloc;
    alloc.set_limit(int64_t(256) << 20);  // a fuzzed model never gets more than 256 MiB
    graft::Graph g =
        graft::load_onnx_bytes(std::string(reinterpret_cast<const char*>(data), size), "", io);
    std::map<std::string, graft::Shape> shapes;
    for (int v : g.inputs) {  // bind symbolic dims to 2
      graft::Shape s = g.values[v].shape;
      for (auto& d : s)
        if (d < 0) d = 2;
      shapes[g.values[v].name] = s;
    }
    graft::infer_shapes(g, shapes, &alloc);
    graft::PlanOptions po;
    po.keep = g.outputs;
    graft::make_plan(g, po);
  } catch (const graft::Error&) {
  }
  return 0;
}
