// graft CLI subcommands (one file each); main.cpp parses flags with CLI11 and dispatches.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "graft/core.h"

namespace graft::cli {

struct RunArgs {
  std::string model;
  std::vector<std::string> input_shapes;  // name=2x3
  std::vector<std::string> input_files;   // TensorProto .pb files
  bool profile = false;
  bool check_finite = false;
  std::string save_outputs_dir;
};
int cmd_run(const RunArgs& a);

struct InspectArgs {
  std::string model;
  bool json = false;
};
int cmd_inspect(const InspectArgs& a);

// Shared helpers.
std::map<std::string, Shape> parse_shapes(const std::vector<std::string>& specs);
std::string human_bytes(int64_t b);

}  // namespace graft::cli
