// libFuzzer target over graft's file readers: the TensorProto .pb loader (graft::load_tensor_pb)
// and the checkpoint reader (graft::verify_checkpoint). The input's first byte picks which, see
// fuzz/files_target.h. Each process writes its files into its own temporary folder
// (graft-fuzz-files-XXXXXX under $TMPDIR, else /dev/shm, else /tmp), removed at exit.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "files_target.h"

namespace {
std::string g_dir;

void remove_dir() {
  if (!g_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(g_dir, ec);
  }
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // $TMPDIR if set, else /dev/shm when usable (every input is written to a file: on a disk-backed
  // /tmp this target runs ~10x slower), else /tmp.
  const char* tmp = std::getenv("TMPDIR");
  std::string base = tmp && *tmp                              ? tmp
                     : ::access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm"
                                                              : "/tmp";
  std::string tmpl = base + "/graft-fuzz-files-XXXXXX";
  if (!::mkdtemp(tmpl.data())) {
    std::perror("fuzz_files: mkdtemp");
    std::abort();
  }
  g_dir = tmpl;
  std::atexit(remove_dir);
  graft_fuzz::write_external_data(g_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    graft_fuzz::run_files_input(data, size, g_dir);
  } catch (const graft::Error&) {
  }
  return 0;
}
