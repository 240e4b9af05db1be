// The graft command line: run, inspect, train, bench. Errors print one line and exit non-zero.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <new>

#include "commands.h"

int main(int argc, char** argv) {
  using namespace graft::cli;
  CLI::App app{"graft: a C++ training runtime for ONNX graphs"};
  app.require_subcommand(1);

  RunArgs run;
  auto* r = app.add_subcommand("run", "Run a model on given or random inputs");
  r->add_option("model", run.model, "ONNX model file")->required();
  r->add_option("--input", run.input_shapes, "Input shape, name=2x3x4 (repeatable)");
  r->add_option("--inputs", run.input_files, "Input TensorProto .pb files (by name, else in order)");
  r->add_flag("--profile", run.profile, "Print time per op type");
  r->add_flag("--check-finite", run.check_finite, "Stop at the first op producing NaN/Inf");
  r->add_option("--save-outputs", run.save_outputs_dir, "Write outputs as output_N.pb into this folder");

  InspectArgs ins;
  auto* i = app.add_subcommand("inspect", "List inputs, outputs, parameters and ops of a model");
  i->add_option("model", ins.model, "ONNX model file")->required();
  i->add_flag("--json", ins.json, "Print JSON");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*r) return cmd_run(run);
    if (*i) return cmd_inspect(ins);
  } catch (const graft::Error& e) {
    std::fprintf(stderr, "graft: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "graft: out of memory\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "graft: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
