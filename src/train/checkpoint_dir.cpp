// A folder of checkpoints: file names, listing, saving with rotation (keep the newest N), resuming
// from the newest file that verifies (falling back past corrupt ones), and the one-run-per-folder
// lock. One file's format lives in checkpoint_format.cpp, durable writes in durable_io.cpp.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "checkpoint_format.h"
#include "durable_io.h"

namespace graft {
namespace fs = std::filesystem;

namespace {
// "ckpt-<digits>.graft" -> its step.
bool parse_step(const std::string& name, int64_t& step) {
  constexpr std::string_view pre = "ckpt-", suf = ".graft";
  if (name.size() <= pre.size() + suf.size() || !name.starts_with(pre) || !name.ends_with(suf))
    return false;
  const char* b = name.data() + pre.size();
  const char* e = name.data() + name.size() - suf.size();
  if (!std::all_of(b, e, [](char c) { return c >= '0' && c <= '9'; })) return false;
  auto r = std::from_chars(b, e, step);
  return r.ec == std::errc() && r.ptr == e;
}
}  // namespace

std::string checkpoint_file_name(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "ckpt-%08lld.graft", static_cast<long long>(step));
  return buf;
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  fs::directory_iterator it(dir, ec), end;
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot list: " + ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot list: " + ec.message());
    int64_t step;
    if (!parse_step(it->path().filename().string(), step)) continue;
    std::error_code
        sec;  // stat, never open: a FIFO or device named like a checkpoint is no checkpoint
    if (!it->is_regular_file(sec)) continue;
    out.push_back({step, it->path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second > b.second;
  });
  return out;
}

std::string save_checkpoint_in_dir(const std::string& dir, const TrainSession& s,
                                   const Optimizer* opt, int64_t step, int keep) {
  GRAFT_CHECK(keep >= 2, ErrorKind::InvalidArgument,
              "checkpoints to keep must be >= 2 (the previous good one stays)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot create: " + ec.message());
  const std::string name = checkpoint_file_name(step);
  const std::string path = (fs::path(dir) / name).string();
  save_checkpoint(path, s, opt, step);
  const std::string latest = (fs::path(dir) / "latest").string();
  durable::write_atomically(latest, [&](int fd) {
    std::string line = name + "\n";
    durable::write_exact(fd, line.data(), line.size(), latest);
  });
  // The new file is durable; drop older ones beyond the newest `keep`.
  int kept = 1;
  for (const auto& [st, p] : list_checkpoints(dir)) {
    if (st >= step) continue;
    if (kept < keep) {
      ++kept;
      continue;
    }
    fs::remove(p, ec);  // best effort: a leftover old checkpoint is harmless
  }
  return path;
}

ResumeResult resume_from_dir(const std::string& dir, TrainSession& s, Optimizer* opt) {
  ResumeResult r;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    // Temporaries of an interrupted save (".NAME.tmp-PID") are never complete checkpoints.
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (n.starts_with(".") && n.find(".tmp-") != std::string::npos) {
        std::error_code ec2;
        fs::remove(it->path(), ec2);
      }
    }
  }
  if (fs::is_directory(dir, ec)) {
    // Entries named like checkpoints that are not regular files (a FIFO, a folder, a device, a
    // dangling link) are reported and left alone; list_checkpoints never lists them, so nothing
    // opens them and resume cannot block on them.
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      int64_t st;
      if (!parse_step(it->path().filename().string(), st)) continue;
      struct stat sb {};
      const bool exists = ::stat(it->path().c_str(), &sb) == 0;
      if (exists && S_ISREG(sb.st_mode)) continue;
      r.skipped.push_back("checkpoint '" + it->path().string() + "' is not a regular file (" +
                          (exists ? durable::file_kind(sb.st_mode) : "a dangling link") +
                          "); ignored");
    }
  }
  auto files = list_checkpoints(dir);
  std::vector<std::string> refused;
  for (const auto& [st, path] : files) {
    ckpt::Header h;
    try {
      h = ckpt::read_and_verify(path);
      if (h.step != st)
        ckpt::corrupt(path, "its name says step " + std::to_string(st) + ", its header step " +
                                std::to_string(h.step));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::InvalidModel) throw;
      r.skipped.push_back(e.what());
      refused.push_back(path);
      continue;
    }
    r.step =
        ckpt::load_verified(h, s, opt);  // a checkpoint of another run stops here with its error
    r.found = true;
    r.path = path;
    // Training continues from here and rewrites the newer steps; keep the refused files aside for
    // inspection, out of the way of later resumes.
    for (const std::string& p : refused) fs::rename(p, p + ".corrupt", ec);
    return r;
  }
  if (!files.empty()) {
    std::string all;
    for (const std::string& m : r.skipped) all += (all.empty() ? " " : "; ") + m;
    fail(ErrorKind::InvalidModel, "no checkpoint in '" + dir + "' verifies (" +
                                      std::to_string(files.size()) + " refused):" + all);
  }
  return r;
}

// --- the folder lock -------------------------------------------------------------------------
CheckpointDirLock::CheckpointDirLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot create: " + ec.message());
  path_ = (fs::path(dir) / ".lock").string();
  for (int attempt = 0;; ++attempt) {
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    if (fd < 0)
      fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot open its lock file '" + path_ +
                              "': " + durable::errno_str());
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(ErrorKind::Io,
           "checkpoint folder '" + dir + "': its lock file '" + path_ + "' is not a regular file");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[32] = {};
      ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      ::close(fd);
      if (err != EWOULDBLOCK && err != EINTR)
        fail(ErrorKind::Io,
             "checkpoint folder '" + dir + "': cannot lock '" + path_ + "': " + std::strerror(err));
      long long pid = n > 0 ? std::atoll(buf) : 0;
      fail(ErrorKind::InvalidArgument,
           "checkpoint folder '" + dir + "' is in use by another graft run (" +
               (pid > 0 ? "pid " + std::to_string(pid) : std::string("pid unknown")) +
               ", holding '" + path_ + "'); wait for it to finish or use another folder");
    }
    // The holder before us may have removed the file after we opened it (it unlinks on exit); a
    // lock on a removed file guards nothing, so make sure the name still refers to our file.
    struct stat now {};
    if (::stat(path_.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      fd_ = fd;
      break;
    }
    ::close(fd);
    if (attempt > 100)
      fail(ErrorKind::Io, "checkpoint folder '" + dir + "': its lock file keeps being replaced");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // The lock holds regardless; only the pid shown to a refused run is missing.
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // still locked: a waiter that opened it re-checks the name and retries
  ::close(fd_);
}

}  // namespace graft
