// An optimizer's per-parameter state in a file on local disk, streamed (internal to src/train;
// the public switch is Optimizer::set_state_file in graft/train.h). Note [optimizer state on disk]
// in state_file.cpp.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "graft/train.h"

namespace graft {

class StateFile {
 public:
  // `sizes[i]`: the bytes of parameter i's state (its state tensors back to back). Creates (or
  // truncates) the file and reserves its whole size first: an error of kind Io names the path and
  // the bytes needed when the disk cannot hold it.
  StateFile(const StateFileOptions& o, std::vector<int64_t> sizes, Allocator& alloc);
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // Parameter i's state in RAM until release(i): read from the file (already, when it was
  // prefetched in the last step's order), or zeros if it was never written.
  char* acquire(size_t i);
  // Its bytes go back to the file behind the caller; the buffer is freed once they are written.
  void release(size_t i);
  // A step begins (its backward is about to deliver gradients): the order of the last step's
  // acquires becomes the prediction, and reading ahead in it starts now.
  void begin_step();
  // Every write done and on disk (fdatasync). Rethrows a failed read or write.
  void flush();
  // Synchronous whole-state copies (state() / load_state()), after the jobs in flight; no
  // fdatasync (flush() makes the file durable).
  void read(size_t i, void* dst);
  void write(size_t i, const void* src);

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  int64_t window() const { return window_; }
  int64_t file_bytes() const { return total_; }
  int64_t bytes_read() const;
  int64_t bytes_written() const;
  int64_t prefetch_hits() const;  // acquires that found their state already read

 private:
  enum class Slot : uint8_t { Idle, Reading, Ready, InUse, Writing };
  struct Buf {
    std::shared_ptr<Storage> mem;
    char* data = nullptr;  // 4096-aligned inside mem
  };
  struct Job {
    size_t i;
    bool write;
  };
  Buf aligned(size_t i, Category c, const char* what);  // a 4096-aligned block of i's region
  void io_loop();
  void prefetch_locked();                               // mu_ held
  void begin_step_locked();                             // mu_ held
  void take_buffer_locked(size_t i);                    // mu_ held
  void check_locked();                                  // mu_ held: throws the I/O thread's error
  void drain_locked(std::unique_lock<std::mutex>& lk);  // every job done; then check_locked
  void transfer(size_t i, char* buf, bool write);       // pread / pwrite of the padded region
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  Allocator& alloc_;
  std::vector<int64_t> size_, padded_, offset_;
  int64_t total_ = 0, window_ = 0, held_ = 0;
  std::vector<Slot> slot_;
  std::vector<Buf> buf_;
  std::vector<char> written_, seen_;        // seen_: acquired since the step began
  std::vector<size_t> order_, next_order_;  // the last step's acquires; this step's so far
  size_t pos_ = 0, ahead_ = 0;  // order_[pos_]: the next acquire expected; ahead_ read past it
  std::deque<Job> jobs_;
  std::string error_;
  int64_t read_ = 0, wrote_ = 0, hits_ = 0;
  bool primed_ = false;  // reading ahead for the next step began at the end of the last
  bool stop_ = false, busy_ = false;  // busy_: the I/O thread is inside a transfer
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::thread io_;
};

}  // namespace graft
