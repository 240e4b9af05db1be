// Durable file I/O for checkpoints (internal to src/train): opening regular files without ever
// blocking, exact reads and writes, atomic replacement of a file (temporary + fsync + rename +
// fsync of the folder). CRC-32 is public: graft::crc32 in graft/checkpoint.h, defined in
// durable_io.cpp.
//
// Every failure is a graft::Error of kind Io, "checkpoint 'PATH': WHAT".
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace graft::durable {

// strerror(errno).
std::string errno_str();
// Throws Io: "checkpoint 'PATH': WHAT".
[[noreturn]] void io_error(const std::string& path, const std::string& what);

// An open file descriptor, closed on destruction.
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
};

// "a directory", "a FIFO", ... for a st_mode that is not a regular file.
const char* file_kind(mode_t m);

// Opens `path` for reading without ever blocking: O_NONBLOCK (a FIFO would otherwise wait for a
// writer forever), then refuses anything but a regular file before the first read.
void open_regular(Fd& f, const std::string& path);
// The size of an open file (fstat).
int64_t file_size(const Fd& f, const std::string& path);

// Reads exactly n bytes (the file ending first is an error: it shrank while being read).
void read_exact(int fd, void* buf, size_t n, const std::string& path);
// Writes exactly n bytes.
void write_exact(int fd, const void* buf, size_t n, const std::string& path);

// Writes a file atomically: `fill` writes the contents into a temporary file in the same folder
// (".NAME.tmp-PID"), which is fsynced, closed and renamed over `path`; then the folder is fsynced.
// On any error the temporary is removed and `path` is untouched.
void write_atomically(const std::string& path, const std::function<void(int fd)>& fill);

}  // namespace graft::durable
