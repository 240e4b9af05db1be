// The body of the fuzz_files target (fuzz/fuzz_files.cpp), shared with the regression test
// (tests/cpp/test_fuzz_regressions.cpp) so that a saved finding replays through the same path.
//
// Input layout: the first byte picks what the remaining bytes are, written to a file and read
// back through the public file readers:
//   b % 3 == 0  a TensorProto .pb file      -> graft::load_tensor_pb
//   b % 3 == 1  a checkpoint file, as is    -> graft::verify_checkpoint
//   b % 3 == 2  a checkpoint whose frame the harness repairs before writing it: the preamble's
//               data size is set to what follows the header, and the CRC-32 trailer and end
//               marker are recomputed. Mutations then get past the checksum and reach the header
//               (JSON) validation, which random bytes almost never would.
// Any graft::Error is an accepted outcome; a crash, hang, leak or sanitizer report is a bug.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "graft/checkpoint.h"
#include "graft/ir.h"

namespace graft_fuzz {

// Writes `bytes` to `path` (truncating).
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Repairs a checkpoint frame (mode 2): 32-byte preamble (magic, u32 version, u32 flags, u64 header
// bytes, u64 data bytes), header, data, then u32 CRC-32 of everything before it and "GEND".
inline void fix_checkpoint_frame(std::string& b) {
  constexpr size_t kPreamble = 32, kTrailer = 8;
  if (b.size() < kPreamble + kTrailer) return;
  const uint64_t room = b.size() - kPreamble - kTrailer;
  uint64_t header_bytes;
  std::memcpy(&header_bytes, b.data() + 16, 8);
  if (header_bytes <= room) {
    const uint64_t data_bytes = room - header_bytes;
    std::memcpy(b.data() + 24, &data_bytes, 8);
  }
  const uint32_t crc = graft::crc32(b.data(), b.size() - kTrailer);
  std::memcpy(b.data() + b.size() - kTrailer, &crc, 4);
  std::memcpy(b.data() + b.size() - 4, "GEND", 4);
}

// Runs one input; files are written inside `dir` (which may hold other files a tensor's external
// data can name). Throws only graft::Error.
inline void run_files_input(const uint8_t* data, size_t size, const std::string& dir) {
  if (size == 0) return;
  const int mode = data[0] % 3;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (mode == 0) {
    const std::string path = dir + "/tensor.pb";
    write_file(path, bytes);
    std::string name;
    graft::Tensor t = graft::load_tensor_pb(path, &name);
    (void)t;
  } else {
    if (mode == 2) fix_checkpoint_frame(bytes);
    const std::string path = dir + "/ckpt-00000001.graft";
    write_file(path, bytes);
    graft::CheckpointInfo info = graft::verify_checkpoint(path);
    (void)info;
  }
}

// The file a seed / test tensor may name as external data ("location": "data.bin"): 4 KiB of a
// byte pattern, next to the fuzzed file.
inline void write_external_data(const std::string& dir) {
  std::string b(4096, '\0');
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i * 7 + 3);
  write_file(dir + "/data.bin", b);
}

}  // namespace graft_fuzz
