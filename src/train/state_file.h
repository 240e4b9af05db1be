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

// Bytes every state file of the process has read and written so far (StepProgress).
struct StateFileTraffic {
  int64_t read = 0, written = 0;
};
StateFileTraffic state_file_traffic();

class StateFile {
 public:
  // `moment_bytes[p]`: the bytes of each of parameter p's `moments` state tensors (AdamW: 2,
  // exp_avg and exp_avg_sq). Creates (or truncates) the file and reserves its whole size first:
  // an error of kind Io names the path and the bytes needed when the disk cannot hold it.
  StateFile(const StateFileOptions& o, std::vector<int64_t> moment_bytes, int moments,
            Allocator& alloc);
  ~StateFile();
  StateFile(const StateFile&) = delete;
  StateFile& operator=(const StateFile&) = delete;

  // A parameter's state is streamed in units: byte range [unit_begin(u), unit_begin(u) +
  // unit_bytes(u)) of each of its state tensors, at most kUnitBytes of each. Parameter p's units
  // are first_unit(p) .. first_unit(p) + num_units(p) - 1, in element order.
  static constexpr int64_t kUnitBytes = kStateFileUnitBytes;
  size_t first_unit(size_t p) const { return pfirst_[p]; }
  size_t num_units(size_t p) const { return pfirst_[p + 1] - pfirst_[p]; }
  int64_t unit_begin(size_t u) const { return ubegin_[u]; }
  int64_t unit_bytes(size_t u) const { return ulen_[u]; }
  // Unit u's bytes in RAM until release(u): read from the file (already, when it was prefetched
  // in the last step's order), or zeros if it was never written. State tensor j's range starts
  // at acquire(u) + j * unit_stride(u).
  char* acquire(size_t u);
  int64_t unit_stride(size_t u) const { return ustride_[u]; }
  // Its bytes go back to the file behind the caller; the buffer is freed once they are written.
  void release(size_t u);
  // A step begins (its backward is about to deliver gradients): the order of the last step's
  // acquires becomes the prediction, and reading ahead in it starts now.
  void begin_step();
  // Every write done and on disk (fdatasync). Rethrows a failed read or write.
  void flush();
  // Synchronous copies of parameter p's whole state (its state tensors back to back, unpadded),
  // unit by unit, after the jobs in flight; no fdatasync (flush() makes the file durable).
  void read(size_t p, void* dst);
  void write(size_t p, const void* src);
  // Parameter p has no state again: its next acquire or read gives zeros without reading.
  void forget(size_t p);

  const std::string& path() const { return path_; }
  // Where parameter p's state tensor j starts in the file: offset(p) + j * moment_stride(p).
  int64_t offset(size_t p) const { return poff_[p]; }
  int64_t moment_stride(size_t p) const { return pstride_[p]; }
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
    size_t u;
    bool write;
  };
  Buf aligned(size_t u, Category c, const char* what);  // a 4096-aligned buffer for unit u
  void io_loop();
  void prefetch_locked();                               // mu_ held
  void begin_step_locked();                             // mu_ held
  void take_buffer_locked(size_t u);                    // mu_ held
  void check_locked();                                  // mu_ held: throws the I/O thread's error
  void drop_read_ahead_locked(size_t u);                // mu_ held, drained: u's copy is stale
  void drain_locked(std::unique_lock<std::mutex>& lk);  // every job done; then check_locked
  void transfer(size_t u, char* buf, bool write);       // pread / pwrite of the unit's ranges
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  Allocator& alloc_;
  int moments_ = 0;
  std::vector<int64_t> poff_, pstride_, pbytes_;         // per parameter
  std::vector<size_t> pfirst_;                           // per parameter, and one past the last
  std::vector<size_t> uparam_;                           // per unit: its parameter
  std::vector<int64_t> ubegin_, ulen_, ustride_, ubuf_;  // per unit; ubuf_: its buffer's bytes
  int64_t total_ = 0, window_ = 0, held_ = 0;
  std::vector<Slot> slot_;
  std::vector<Buf> buf_;
  std::vector<char> written_, seen_;        // seen_: acquired since the step began
  std::vector<size_t> order_, next_order_;  // the last step's acquires; this step's so far
  size_t pos_ = 0, ahead_ = 0;  // order_[pos_]: the next acquire expected; ahead_ read past it
  std::deque<Job> jobs_;
  std::string error_;
  int64_t read_ = 0, wrote_ = 0, hits_ = 0;
  bool primed_ = false;   // reading ahead for the next step began at the end of the last
  bool starved_ = false;  // an acquire waits for memory the writes behind will give back
  bool stop_ = false, busy_ = false;  // busy_: the I/O thread is inside a transfer
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::thread io_;
};

}  // namespace graft
