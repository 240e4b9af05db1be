// Crash-safe training checkpoints (format and guarantees: docs/checkpoints.md).
//
// A checkpoint holds every parameter of a TrainSession (by name), the gradients it holds (so a
// checkpoint taken between micro-batches keeps the accumulation), the optimizer's kind,
// hyperparameters and state as it reports them (Optimizer::kind() and state(), graft/train.h: SGD
// momentum buffers; AdamW moments and per-parameter steps), the training step and the dropout RNG
// state. Files are written atomically (a temporary file in the same folder, fsync, rename, fsync
// of the folder) and carry a CRC-32 over everything, so a reader sees either a complete checkpoint
// or refuses the file with a typed error naming it.
//
//   graft::save_checkpoint_in_dir("ckpt", *session, &opt, step);   // ckpt/ckpt-00000012.graft
//   auto r = graft::resume_from_dir("ckpt", *session, &opt);         // newest one that verifies
//   int64_t start = r.found ? r.step : 0;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graft/train.h"

namespace graft {

constexpr uint32_t kCheckpointVersion = 1;

// What a verified checkpoint file holds (from its header).
struct CheckpointInfo {
  std::string path;
  int64_t step = 0;
  std::string optimizer;                // "sgd", "adamw", or "" when none was saved
  std::vector<std::string> parameters;  // names, in file order
  int64_t bytes = 0;                    // file size
};

// Writes a checkpoint of `s` (all parameters and held gradients), `opt` (may be null: parameters
// only) and the dropout RNG state, labelled with `step`, to `path`, atomically: a reader sees the
// old file or the new one, never a mix. Throws Io (naming the file) if writing fails; the
// temporary file is then removed and `path` is untouched.
void save_checkpoint(const std::string& path, const TrainSession& s, const Optimizer* opt,
                     int64_t step);

// Reads and verifies the whole file (size, magic, version, CRC-32, header consistency) without
// touching any session. Throws InvalidModel for a corrupt, truncated or malformed file and Io if it
// cannot be read; the message names the file and what is wrong.
CheckpointInfo verify_checkpoint(const std::string& path);

// Verifies the file, checks that it fits `s` and `opt` (the same parameter names, dtypes and
// shapes; the same optimizer kind over the same parameters), then restores parameters, gradients,
// optimizer hyperparameters and state and the dropout RNG state; returns the step. Errors:
// InvalidModel / Io as verify_checkpoint; InvalidArgument (names, optimizer kind) or ShapeMismatch
// (dtype, shape) when the checkpoint belongs to another model or optimizer; OutOfMemory. On any
// error nothing is modified. With `opt` null, optimizer state in the file is ignored.
int64_t load_checkpoint(const std::string& path, TrainSession& s, Optimizer* opt);

// --- a folder of checkpoints ---------------------------------------------------------------------
// DIR/ckpt-<step, 8+ digits>.graft, one per save, plus DIR/latest (one line: the newest file's
// name, written atomically; informational, resume does not depend on it).

// The file name used for `step` ("ckpt-00000012.graft").
std::string checkpoint_file_name(int64_t step);
// Checkpoint files in `dir` (full paths) with their steps, newest first. Temporaries, files
// renamed aside as corrupt and entries that are not regular files are not listed.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir);

// Saves DIR/ckpt-<step>.graft (creating DIR), updates DIR/latest, then deletes older checkpoints
// so that the newest `keep` (at least 2, so the previous good one survives) remain. Returns the
// file written.
std::string save_checkpoint_in_dir(const std::string& dir, const TrainSession& s,
                                   const Optimizer* opt, int64_t step, int keep = 2);

struct ResumeResult {
  bool found = false;  // false: DIR holds no checkpoint (start from scratch)
  std::string path;    // the file loaded
  int64_t step = 0;
  std::vector<std::string> skipped;  // "FILE: reason" for each newer file refused as corrupt, and
                                     // each entry ignored as not a regular file
};
// Loads the newest checkpoint in `dir` that verifies. A file that fails verification as corrupt
// (InvalidModel) is renamed to FILE.corrupt (kept for inspection, never tried again) and the next
// older one is tried. Entries named like checkpoints that are not regular files (a FIFO, a folder,
// a device) are never opened, so resume cannot block on them; each is reported in `skipped`. Throws
// InvalidModel naming every refused file if DIR holds checkpoints but none verifies; a checkpoint
// that verifies but does not fit the session or optimizer stops the search with load_checkpoint's
// error (it belongs to another run; falling back would mix runs). Stale temporaries from an
// interrupted save are removed.
ResumeResult resume_from_dir(const std::string& dir, TrainSession& s, Optimizer* opt);

// One run per folder: holds DIR/.lock (created with DIR if missing) locked with
// flock(LOCK_EX | LOCK_NB) for the object's lifetime; the file holds the holder's pid. A second
// holder is refused at once (InvalidArgument naming the holder's pid), never made to wait. The
// destructor removes the file; a killed holder's lock is released by the kernel and its stale file
// is taken over by the next run.
class CheckpointDirLock {
 public:
  explicit CheckpointDirLock(const std::string& dir);
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// CRC-32 (IEEE 802.3, as zlib's crc32), continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

}  // namespace graft
