// Note [optimizer state on disk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// AdamW keeps two float32 moments per weight: 8 of the 12 bytes per parameter that step mode
// needs. But in step mode the optimizer touches each parameter's moments exactly once per step, at
// the moment its gradient is complete, and in the same order every step (the plan fixes the order
// in which backward completes gradients). So the moments need not live in RAM: they live in one
// file, each parameter's state (exp_avg then exp_avg_sq) in its own 4 KiB-aligned region, and RAM
// holds only a window of them:
//
//   * read-ahead: an I/O thread reads the states of the parameters whose gradients come first,
//     in the last step's order, as far as the window allows, from the moment the last step's
//     final update is done (so the forward in between hides those reads; after a step out of
//     order, from the start of the next backward, Optimizer::begin_step); the update finds them
//     in RAM (a prefetch hit);
//   * write-behind: after the update the state goes back to the file on the same thread, and its
//     buffer is freed once written, making room to read further ahead;
//   * a parameter never written (its first step) reads nothing: its state starts as zeros;
//   * an update that comes out of the predicted order still works (a synchronous read): the
//     prediction only decides what is read early, never what is read. Exactness does not depend
//     on it: the update's arithmetic is AdamW's in RAM, on the same bytes.
//
// The page cache would otherwise keep every byte read or written (the file is as large as two
// copies of the weights): the file is opened with O_DIRECT, so reads and writes go to the disk
// and the kernel keeps nothing. Where the filesystem refuses O_DIRECT (tmpfs), buffered I/O with
// sync_file_range + posix_fadvise(DONTNEED) after each transfer drops the pages instead (and
// POSIX_FADV_RANDOM keeps the kernel from reading ahead past a region).
// tests/cpp/test_state_file.cpp measures the file's resident pages (mincore) in both.
//
// The whole file is reserved (posix_fallocate) before the first step: a disk too small is an
// error naming the path and the bytes needed, before any training. A failed read or write is
// raised by the next acquire or flush as an Io error naming the path.
#include "state_file.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "durable_io.h"

namespace graft {
namespace {
constexpr int64_t kAlign = 4096;
int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
std::string gib(int64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  return s;
}
std::string folder_of(const std::string& path) {
  const size_t s = path.rfind('/');
  return s == std::string::npos ? "." : s == 0 ? "/" : path.substr(0, s);
}
}  // namespace

void StateFile::fail(const std::string& what) const {
  throw Error(ErrorKind::Io, "optimizer state file '" + path_ + "': " + what);
}

StateFile::StateFile(const StateFileOptions& o, std::vector<int64_t> sizes, Allocator& alloc)
    : path_(o.path), alloc_(alloc), size_(std::move(sizes)) {
  GRAFT_CHECK(!path_.empty(), ErrorKind::InvalidArgument, "the optimizer state file needs a path");
  const size_t n = size_.size();
  padded_.resize(n);
  offset_.resize(n);
  int64_t largest = 0;
  for (size_t i = 0; i < n; ++i) {
    padded_[i] = round_up(size_[i]);
    offset_[i] = total_;
    total_ += padded_[i];
    largest = std::max(largest, padded_[i]);
  }
  // The window holds at least the largest state and, by default, four of them: room to read the
  // next ones while one is updated and another written.
  window_ = std::max(o.window_bytes > 0 ? o.window_bytes : 4 * largest, largest);
  slot_.assign(n, Slot::Idle);
  buf_.resize(n);
  written_.assign(n, 0);
  seen_.assign(n, 0);

  struct statvfs fs {};
  if (::statvfs(folder_of(path_).c_str(), &fs) == 0) {
    const auto free = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
    if (free < total_)
      fail("needs " + std::to_string(total_) + " bytes (" + gib(total_) +
           ") on its filesystem, which has " + std::to_string(free) + " bytes (" + gib(free) +
           ") free; free space there or give another path");
  }
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (o.direct_io) {
    fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0600);
    direct_ = fd_ >= 0;
  }
  if (fd_ < 0 && (!o.direct_io || errno == EINVAL)) fd_ = ::open(path_.c_str(), flags, 0600);
  if (fd_ < 0) fail("cannot create it: " + durable::errno_str());
  if (!direct_) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_RANDOM);  // no read-ahead past a region
  if (total_ > 0) {
    const int rc = ::posix_fallocate(fd_, 0, total_);
    if (rc != 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
      fail("cannot reserve " + std::to_string(total_) + " bytes (" + gib(total_) +
           "): " + std::strerror(rc));
    }
  }
  io_ = std::thread([this] { io_loop(); });
}

StateFile::~StateFile() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return jobs_.empty() && !busy_; });  // (an error is not raised here)
    stop_ = true;
  }
  cv_.notify_all();
  io_.join();
  if (!direct_) ::fdatasync(fd_);
  ::close(fd_);
}

void StateFile::check_locked() {
  if (!error_.empty()) fail(error_);
}

StateFile::Buf StateFile::aligned(size_t i, Category c, const char* what) {
  Buf b;
  b.mem = alloc_.allocate(static_cast<size_t>(padded_[i] + kAlign), c, what);
  const auto addr = reinterpret_cast<uintptr_t>(b.mem->data);
  b.data = reinterpret_cast<char*>((addr + kAlign - 1) / kAlign * kAlign);
  return b;
}

void StateFile::take_buffer_locked(size_t i) {
  buf_[i] = aligned(i, Category::OptimizerState, "optimizer state in flight");
  held_ += padded_[i];
}

void StateFile::prefetch_locked() {
  if (!error_.empty()) return;
  const size_t n = order_.size();
  while (pos_ + ahead_ < n) {
    const size_t j = order_[pos_ + ahead_];
    if (slot_[j] == Slot::Reading || slot_[j] == Slot::Ready) {  // already on its way
      ++ahead_;
      continue;
    }
    if (slot_[j] != Slot::Idle) break;  // still being written: read it once that is done
    if (held_ > 0 && held_ + padded_[j] > window_) break;
    take_buffer_locked(j);
    if (written_[j]) {
      slot_[j] = Slot::Reading;
      jobs_.push_back({j, false});
    } else {
      std::memset(buf_[j].data, 0, static_cast<size_t>(size_[j]));
      slot_[j] = Slot::Ready;
    }
    ++ahead_;
  }
  cv_.notify_all();
}

void StateFile::begin_step() {
  std::lock_guard<std::mutex> lk(mu_);
  begin_step_locked();
}

void StateFile::begin_step_locked() {
  std::fill(seen_.begin(), seen_.end(), 0);
  if (primed_) {  // the last step went as predicted: reading for this one began at its end
    primed_ = false;
    prefetch_locked();
    return;
  }
  if (!next_order_.empty()) order_.swap(next_order_);
  next_order_.clear();
  pos_ = ahead_ = 0;
  prefetch_locked();
}

char* StateFile::acquire(size_t i) {
  std::unique_lock<std::mutex> lk(mu_);
  check_locked();
  GRAFT_CHECK(i < slot_.size() && slot_[i] != Slot::InUse, ErrorKind::Internal,
              "optimizer state file: parameter " + std::to_string(i) + " acquired twice");
  // A parameter updated twice since the last step began: a new step began without begin_step
  // (an optimizer driven one update at a time, as graft.optim.AdamW in GraftModule's step mode).
  if (seen_[i]) begin_step_locked();
  seen_[i] = 1;
  next_order_.push_back(i);
  if (pos_ < order_.size() && order_[pos_] == i) {
    ++pos_;
    if (ahead_) --ahead_;
  } else if (!order_.empty()) {  // out of the predicted order: stop predicting this step
    order_.clear();
    pos_ = ahead_ = 0;
  }
  if (!order_.empty() && pos_ == order_.size()) {
    // The step's last update, all as predicted: start reading for the next step now, so that
    // its first states are in RAM by the time its backward needs them (the forward between
    // hides the reads).
    next_order_.clear();
    std::fill(seen_.begin(), seen_.end(), 0);
    pos_ = ahead_ = 0;
    primed_ = true;
  }
  if (slot_[i] == Slot::Ready || slot_[i] == Slot::Reading) ++hits_;
  cv_.wait(lk, [&] { return !error_.empty() || slot_[i] != Slot::Writing; });
  check_locked();
  if (slot_[i] == Slot::Idle) {  // not read ahead: read it now, before anything queued
    take_buffer_locked(i);
    if (written_[i]) {
      slot_[i] = Slot::Reading;
      jobs_.push_front({i, false});
      cv_.notify_all();
    } else {
      std::memset(buf_[i].data, 0, static_cast<size_t>(size_[i]));
      slot_[i] = Slot::Ready;
    }
  }
  cv_.wait(lk, [&] { return !error_.empty() || slot_[i] == Slot::Ready; });
  check_locked();
  slot_[i] = Slot::InUse;
  prefetch_locked();
  return buf_[i].data;
}

void StateFile::release(size_t i) {
  std::lock_guard<std::mutex> lk(mu_);
  GRAFT_CHECK(i < slot_.size() && slot_[i] == Slot::InUse, ErrorKind::Internal,
              "optimizer state file: parameter " + std::to_string(i) + " released unacquired");
  slot_[i] = Slot::Writing;
  written_[i] = 1;
  jobs_.push_back({i, true});
  cv_.notify_all();
}

void StateFile::transfer(size_t i, char* buf, bool write) {
  int64_t done = 0;
  const int64_t len = padded_[i];
  while (done < len) {
    const ssize_t r = write ? ::pwrite(fd_, buf + done, static_cast<size_t>(len - done),
                                       static_cast<off_t>(offset_[i] + done))
                            : ::pread(fd_, buf + done, static_cast<size_t>(len - done),
                                      static_cast<off_t>(offset_[i] + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      throw Error(ErrorKind::Io, std::string(write ? "write" : "read") + " of " +
                                     std::to_string(len) + " bytes at offset " +
                                     std::to_string(offset_[i]) +
                                     " failed: " + durable::errno_str());
    if (r == 0)
      throw Error(ErrorKind::Io, "the file ended at offset " + std::to_string(offset_[i] + done) +
                                     " (it was truncated while in use)");
    done += r;
  }
  if (!direct_) {  // keep no page of it cached
    if (write)
      ::sync_file_range(
          fd_, offset_[i], len,
          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    ::posix_fadvise(fd_, offset_[i], len, POSIX_FADV_DONTNEED);
  }
}

void StateFile::io_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stop_, and nothing left
    const Job job = jobs_.front();
    jobs_.pop_front();
    busy_ = true;
    char* data = buf_[job.i].data;
    lk.unlock();
    std::string err;
    try {
      transfer(job.i, data, job.write);
    } catch (const Error& e) {
      err = e.what();
    }
    lk.lock();
    busy_ = false;
    if (!err.empty() && error_.empty()) error_ = err;
    if (job.write) {
      held_ -= padded_[job.i];
      buf_[job.i] = Buf{};
      slot_[job.i] = Slot::Idle;
      if (err.empty()) wrote_ += size_[job.i];
    } else {
      slot_[job.i] = Slot::Ready;
      if (err.empty()) read_ += size_[job.i];
    }
    prefetch_locked();
    cv_.notify_all();
  }
}

void StateFile::drain_locked(std::unique_lock<std::mutex>& lk) {
  cv_.wait(lk, [&] { return jobs_.empty() && !busy_; });
  check_locked();
}

void StateFile::flush() {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  if (::fdatasync(fd_) != 0) fail("fdatasync failed: " + durable::errno_str());
}

void StateFile::read(size_t i, void* dst) {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  if (!written_[i]) {
    std::memset(dst, 0, static_cast<size_t>(size_[i]));
    return;
  }
  if (slot_[i] == Slot::Ready) {  // read ahead: the same bytes
    std::memcpy(dst, buf_[i].data, static_cast<size_t>(size_[i]));
    return;
  }
  const Buf tmp = aligned(i, Category::Workspace, "optimizer state copy");
  transfer(i, tmp.data, false);
  std::memcpy(dst, tmp.data, static_cast<size_t>(size_[i]));
}

void StateFile::write(size_t i, const void* src) {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  GRAFT_CHECK(slot_[i] == Slot::Idle || slot_[i] == Slot::Ready, ErrorKind::Internal,
              "optimizer state file: parameter " + std::to_string(i) + " written while in use");
  if (slot_[i] == Slot::Ready) {  // a read-ahead copy would now be stale
    held_ -= padded_[i];
    buf_[i] = Buf{};
    slot_[i] = Slot::Idle;
    order_.clear();
    pos_ = ahead_ = 0;
  }
  const Buf tmp = aligned(i, Category::Workspace, "optimizer state copy");
  std::memset(tmp.data, 0, static_cast<size_t>(padded_[i]));
  std::memcpy(tmp.data, src, static_cast<size_t>(size_[i]));
  transfer(i, tmp.data, true);
  written_[i] = 1;
}

int64_t StateFile::bytes_read() const {
  std::lock_guard<std::mutex> lk(mu_);
  return read_;
}
int64_t StateFile::bytes_written() const {
  std::lock_guard<std::mutex> lk(mu_);
  return wrote_;
}
int64_t StateFile::prefetch_hits() const {
  std::lock_guard<std::mutex> lk(mu_);
  return hits_;
}

}  // namespace graft
