// Durable file I/O for checkpoints (durable_io.h) and CRC-32 (graft/checkpoint.h).
#include "durable_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "graft/checkpoint.h"

namespace graft {
namespace fs = std::filesystem;

// --- CRC-32 (reflected, polynomial 0xEDB88320, as zlib), slicing by 8 ----------------------------
namespace {
struct CrcTables {
  uint32_t t[8][256];
  constexpr CrcTables() : t{} {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};
constexpr CrcTables kCrc;
}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& t = kCrc.t;
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  while (n >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;
    crc = t[7][a & 0xff] ^ t[6][(a >> 8) & 0xff] ^ t[5][(a >> 16) & 0xff] ^ t[4][a >> 24] ^
          t[3][b & 0xff] ^ t[2][(b >> 8) & 0xff] ^ t[1][(b >> 16) & 0xff] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

namespace durable {

std::string errno_str() { return std::strerror(errno); }

void io_error(const std::string& path, const std::string& what) {
  fail(ErrorKind::Io, "checkpoint '" + path + "': " + what);
}

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

void open_regular(Fd& f, const std::string& path) {
  f.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f.fd < 0) io_error(path, "cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_error(path, "cannot stat: " + errno_str());
  if (!S_ISREG(st.st_mode))
    io_error(path, std::string("not a regular file (") + file_kind(st.st_mode) + ")");
  int fl = ::fcntl(f.fd, F_GETFL);  // regular files never block; clear the flag all the same
  if (fl >= 0) ::fcntl(f.fd, F_SETFL, fl & ~O_NONBLOCK);
}

int64_t file_size(const Fd& f, const std::string& path) {
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_error(path, "cannot stat: " + errno_str());
  return st.st_size;
}

void read_exact(int fd, void* buf, size_t n, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_error(path, "read failed: " + errno_str());
    if (r == 0) io_error(path, "the file shrank while being read");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void write_exact(int fd, const void* buf, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) io_error(path, "write failed: " + errno_str());
    p += w;
    n -= static_cast<size_t>(w);
  }
}

namespace {
void fsync_dir(const fs::path& dir, const std::string& path) {
  Fd d;
  d.fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0)
    io_error(path, "cannot open folder '" + dir.string() + "' to sync it: " + errno_str());
  if (::fsync(d.fd) != 0 && errno != EINVAL)
    io_error(path, "fsync of folder '" + dir.string() + "' failed: " + errno_str());
}
}  // namespace

void write_atomically(const std::string& path, const std::function<void(int fd)>& fill) {
  fs::path target(path);
  fs::path dir = target.parent_path();
  fs::path tmp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  Fd f;
  f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd < 0)
    io_error(path, "cannot create temporary file '" + tmp.string() + "': " + errno_str());
  try {
    fill(f.fd);
    if (::fsync(f.fd) != 0) io_error(path, "fsync failed: " + errno_str());
    int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) io_error(path, "close failed: " + errno_str());
    // Test hook (tests/python/test_checkpoint.py): widens the window between a complete temporary
    // and the rename, so that kills land inside a save.
    if (const char* d = std::getenv("GRAFT_CHECKPOINT_TEST_DELAY_US"))
      ::usleep(static_cast<useconds_t>(std::atoll(d)));
    if (::rename(tmp.c_str(), target.c_str()) != 0)
      io_error(path, "rename from '" + tmp.string() + "' failed: " + errno_str());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir, path);
}

}  // namespace durable
}  // namespace graft
