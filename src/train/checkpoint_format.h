// The checkpoint file format (internal to src/train; docs/checkpoints.md): the parsed and
// validated header of one file, for the folder policy (checkpoint_dir.cpp) to verify files and
// load the one it picks.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "graft/checkpoint.h"

namespace graft::ckpt {

struct Blob {
  int64_t offset = 0, bytes = 0;  // within the data section
};
struct ParamEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  bool trainable = true;
  Blob data;
  bool has_grad = false;
  Blob grad;
};
struct SlotEntry {
  std::string name;  // momentum_buffer, exp_avg, exp_avg_sq
  Blob blob;
};
struct StateEntry {
  std::string param;
  int64_t step = 0;  // the per-parameter counter (AdamW's step)
  std::vector<SlotEntry> slots;
};
struct Header {
  std::string path;
  int64_t file_size = 0;
  uint64_t header_bytes = 0, data_bytes = 0;
  uint32_t crc = 0;
  int64_t step = 0;
  uint64_t rng = 0;
  std::vector<ParamEntry> params;
  bool has_opt = false;
  std::string kind;  // the optimizer's kind (find_optimizer_kind)
  int64_t opt_steps = 0;
  std::map<std::string, double> hyper;  // validated against the kind
  std::vector<StateEntry> state;
};

// Throws InvalidModel: "checkpoint 'PATH' is corrupt: WHAT".
[[noreturn]] void corrupt(const std::string& path, const std::string& what);

// Pass 1: opens the file (never blocking, regular files only), checks its size, magic, version,
// flags, end marker and CRC-32 over the whole file, then parses and validates the header.
Header read_and_verify(const std::string& path);

// Checks that a verified header fits `s` and `opt`, reads the data again into staging tensors
// (re-checking the CRC), and only then commits to the session, the optimizer and the RNG state.
// Returns the checkpoint's step. On any error nothing is modified.
int64_t load_verified(const Header& h, TrainSession& s, Optimizer* opt);

}  // namespace graft::ckpt
