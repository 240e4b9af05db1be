// Note [optimizer state on disk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// AdamW keeps two float32 moments per weight: 8 of the 12 bytes per parameter that step mode
// needs. But in step mode the optimizer touches each parameter's moments exactly once per step, at
// the moment its gradient is complete, and in the same order every step (the plan fixes the order
// in which backward completes gradients). So the moments need not live in RAM: they live in one
// file, each parameter's exp_avg and then exp_avg_sq, each 4 KiB-aligned, and RAM holds only a
// window of them. They move in units: a range of at most 32 MiB of each moment of one parameter
// (AdamW's update is elementwise, so it runs a unit at a time), so that no parameter, however
// large, needs all of its state in RAM at once:
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
#include <atomic>
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

StateFile::StateFile(const StateFileOptions& o, std::vector<int64_t> moment_bytes, int moments,
                     Allocator& alloc)
    : path_(o.path), alloc_(alloc), moments_(moments), pbytes_(std::move(moment_bytes)) {
  GRAFT_CHECK(!path_.empty(), ErrorKind::InvalidArgument, "the optimizer state file needs a path");
  const size_t n = pbytes_.size();
  poff_.resize(n);
  pstride_.resize(n);
  int64_t largest = 0;
  for (size_t p = 0; p < n; ++p) {
    pstride_[p] = round_up(pbytes_[p]);  // each state tensor 4096-aligned (O_DIRECT)
    poff_[p] = total_;
    total_ += moments_ * pstride_[p];
    pfirst_.push_back(uparam_.size());
    for (int64_t a = 0; a < pbytes_[p]; a += kUnitBytes) {
      uparam_.push_back(p);
      ubegin_.push_back(a);
      ulen_.push_back(std::min(kUnitBytes, pbytes_[p] - a));
      ustride_.push_back(round_up(ulen_.back()));
      ubuf_.push_back(moments_ * ustride_.back());
      largest = std::max(largest, ubuf_.back());
    }
  }
  pfirst_.push_back(uparam_.size());
  // The window holds at least one unit and, by default, 512 MiB more (or the whole state, when
  // smaller): the next units are read while one is updated and another written. Units bound it:
  // a parameter larger than the window (a 4B Llama's embedding has 1 GiB of AdamW state) streams
  // through it unit by unit instead of needing all of its state in RAM at once. (An update that
  // finds its unit not read ahead reads it at once, without waiting for the writes in flight:
  // RAM may briefly hold the window plus that unit.)
  constexpr int64_t kReadAhead = int64_t{512} << 20;
  window_ = std::max(o.window_bytes > 0 ? o.window_bytes : largest + std::min(total_, kReadAhead),
                     largest);
  const size_t units = uparam_.size();
  slot_.assign(units, Slot::Idle);
  buf_.resize(units);
  written_.assign(units, 0);
  seen_.assign(units, 0);

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

StateFile::Buf StateFile::aligned(size_t u, Category c, const char* what) {
  Buf b;
  b.mem = alloc_.allocate(static_cast<size_t>(ubuf_[u] + kAlign), c, what);
  const auto addr = reinterpret_cast<uintptr_t>(b.mem->data);
  b.data = reinterpret_cast<char*>((addr + kAlign - 1) / kAlign * kAlign);
  return b;
}

void StateFile::take_buffer_locked(size_t u) {
  buf_[u] = aligned(u, Category::OptimizerState, "optimizer state in flight");
  held_ += ubuf_[u];
}

void StateFile::prefetch_locked() {
  if (!error_.empty() || starved_) return;
  const size_t n = order_.size();
  while (pos_ + ahead_ < n) {
    const size_t j = order_[pos_ + ahead_];
    if (slot_[j] == Slot::Reading || slot_[j] == Slot::Ready) {  // already on its way
      ++ahead_;
      continue;
    }
    if (slot_[j] != Slot::Idle) break;  // still being written: read it once that is done
    if (held_ > 0 && held_ + ubuf_[j] > window_) break;
    // Reading ahead is optional: a buffer refused (the process at its memory limit) stops it
    // here, on whichever thread; the update that needs the unit then reads it itself, and a
    // refusal there is the caller's error. (Thrown on the I/O thread, it ended the process.)
    try {
      take_buffer_locked(j);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::OutOfMemory) throw;
      break;
    }
    if (written_[j]) {
      slot_[j] = Slot::Reading;
      jobs_.push_back({j, false});
    } else {
      std::memset(buf_[j].data, 0, static_cast<size_t>(ubuf_[j]));
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
              "optimizer state file: unit " + std::to_string(i) + " acquired twice");
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
    for (;;) {  // at the memory limit, wait for the writes behind to give their buffers back
      try {
        take_buffer_locked(i);
        break;
      } catch (const Error& e) {
        auto writing = [&] { return std::count(slot_.begin(), slot_.end(), Slot::Writing) > 0; };
        if (e.kind() != ErrorKind::OutOfMemory || !writing()) throw;
        const int64_t held = held_;
        starved_ = true;  // no reading ahead takes what the writes give back
        cv_.wait(lk, [&] { return !error_.empty() || held_ < held || !writing(); });
        starved_ = false;
        check_locked();
      }
    }
    if (written_[i]) {
      slot_[i] = Slot::Reading;
      jobs_.push_front({i, false});
      cv_.notify_all();
    } else {
      std::memset(buf_[i].data, 0, static_cast<size_t>(ubuf_[i]));
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
              "optimizer state file: unit " + std::to_string(i) + " released unacquired");
  slot_[i] = Slot::Writing;
  written_[i] = 1;
  jobs_.push_back({i, true});
  cv_.notify_all();
}

namespace {
std::atomic<int64_t> g_read{0}, g_written{0};  // every state file's, for StepProgress
}  // namespace

StateFileTraffic state_file_traffic() { return {g_read.load(), g_written.load()}; }

void StateFile::transfer(size_t u, char* buf, bool write) {
  const size_t p = uparam_[u];
  const int64_t len = ustride_[u];  // (the last unit's padding lies inside the tensor's padding)
  for (int j = 0; j < moments_; ++j) {
    const int64_t at = poff_[p] + j * pstride_[p] + ubegin_[u];
    char* b = buf + j * ustride_[u];
    int64_t done = 0;
    while (done < len) {
      const ssize_t r = write ? ::pwrite(fd_, b + done, static_cast<size_t>(len - done),
                                         static_cast<off_t>(at + done))
                              : ::pread(fd_, b + done, static_cast<size_t>(len - done),
                                        static_cast<off_t>(at + done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0)
        throw Error(ErrorKind::Io, std::string(write ? "write" : "read") + " of " +
                                       std::to_string(len) + " bytes at offset " +
                                       std::to_string(at) + " failed: " + durable::errno_str());
      if (r == 0)
        throw Error(ErrorKind::Io, "the file ended at offset " + std::to_string(at + done) +
                                       " (it was truncated while in use)");
      done += r;
      (write ? g_written : g_read) += r;
    }
    if (!direct_) {  // keep no page of it cached
      if (write)
        ::sync_file_range(
            fd_, at, len,
            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      ::posix_fadvise(fd_, at, len, POSIX_FADV_DONTNEED);
    }
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
    char* data = buf_[job.u].data;
    lk.unlock();
    std::string err;
    try {
      transfer(job.u, data, job.write);
    } catch (const Error& e) {
      err = e.what();
    }
    lk.lock();
    busy_ = false;
    if (!err.empty() && error_.empty()) error_ = err;
    if (job.write) {
      held_ -= ubuf_[job.u];
      buf_[job.u] = Buf{};
      slot_[job.u] = Slot::Idle;
      if (err.empty()) wrote_ += moments_ * ulen_[job.u];
    } else {
      slot_[job.u] = Slot::Ready;
      if (err.empty()) read_ += moments_ * ulen_[job.u];
    }
    try {  // nothing may escape this thread: an error is the next acquire's or flush's to raise
      prefetch_locked();
    } catch (const std::exception& e) {
      if (error_.empty()) error_ = e.what();
    }
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

void StateFile::read(size_t p, void* dst) {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  char* out = static_cast<char*>(dst);
  for (size_t u = pfirst_[p]; u < pfirst_[p + 1]; ++u) {
    Buf tmp;
    const char* from = nullptr;                    // null: never written, zeros
    if (slot_[u] == Slot::Ready && written_[u]) {  // read ahead: the same bytes
      from = buf_[u].data;
    } else if (written_[u]) {
      tmp = aligned(u, Category::Workspace, "optimizer state copy");
      transfer(u, tmp.data, false);
      from = tmp.data;
    }
    for (int j = 0; j < moments_; ++j) {
      char* to = out + j * pbytes_[p] + ubegin_[u];
      if (from)
        std::memcpy(to, from + j * ustride_[u], static_cast<size_t>(ulen_[u]));
      else
        std::memset(to, 0, static_cast<size_t>(ulen_[u]));
    }
  }
}

void StateFile::drop_read_ahead_locked(size_t u) {
  GRAFT_CHECK(slot_[u] == Slot::Idle || slot_[u] == Slot::Ready, ErrorKind::Internal,
              "optimizer state file: unit " + std::to_string(u) + " replaced while in use");
  if (slot_[u] == Slot::Ready) {  // a read-ahead copy would now be stale
    held_ -= ubuf_[u];
    buf_[u] = Buf{};
    slot_[u] = Slot::Idle;
    order_.clear();
    pos_ = ahead_ = 0;
  }
}

void StateFile::forget(size_t p) {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  for (size_t u = pfirst_[p]; u < pfirst_[p + 1]; ++u) {
    drop_read_ahead_locked(u);
    written_[u] = 0;
  }
}

void StateFile::write(size_t p, const void* src) {
  std::unique_lock<std::mutex> lk(mu_);
  drain_locked(lk);
  const char* in = static_cast<const char*>(src);
  for (size_t u = pfirst_[p]; u < pfirst_[p + 1]; ++u) {
    drop_read_ahead_locked(u);
    const Buf tmp = aligned(u, Category::Workspace, "optimizer state copy");
    std::memset(tmp.data, 0, static_cast<size_t>(ubuf_[u]));
    for (int j = 0; j < moments_; ++j)
      std::memcpy(tmp.data + j * ustride_[u], in + j * pbytes_[p] + ubegin_[u],
                  static_cast<size_t>(ulen_[u]));
    transfer(u, tmp.data, true);
    written_[u] = 1;
  }
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
