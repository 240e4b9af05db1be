// Note [step progress]
// ~~~~~~~~~~~~~~~~~~~~
// A step of a model near the machine's limit runs for minutes (a 4B Llama: about two, most of it
// streaming AdamW's moments), and a silent terminal cannot be told from a hung one. So while a
// step runs, and once it has run for 2 s, one line on stderr is redrawn (at most twice a second):
//
//   graft: step 3 backward 61% (540/886 ops) 14.2 s | state file 6.1 GB read, 5.9 GB written |
//          last step 98 tokens/s
//
// (and once more as backward begins), and cleared when the step ends. Only when stderr is a
// terminal (a log file gets no carriage returns), or GRAFT_PROGRESS=1 (draw from the first op,
// terminal or not: tests, logs that want it); GRAFT_PROGRESS=0 turns it off. "state file": the
// bytes every optimizer state file of the process has streamed so far (Note [optimizer state on
// disk]); "tokens": the elements of the step's first integer input, the token ids of a language
// model.
#include "progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "state_file.h"

namespace graft {
namespace {
int mode() {  // 0: off, 1: forced, 2: terminal
  static const int m = [] {
    const char* e = std::getenv("GRAFT_PROGRESS");
    if (e && *e) return std::strcmp(e, "0") == 0 ? 0 : 1;
    return ::isatty(2) ? 2 : 0;
  }();
  return m;
}
std::string gb(int64_t b) {  // "8.4 MB", "6.1 GB"
  char s[32];
  const double x = static_cast<double>(b);
  std::snprintf(s, sizeof s, x < 1e9 ? "%.1f MB" : "%.1f GB", x < 1e9 ? x / 1e6 : x / 1e9);
  return s;
}
}  // namespace

bool StepProgress::enabled() { return mode() != 0; }

void StepProgress::begin(int64_t tokens) {
  start_ = last_ = clock::now();
  tokens_ = tokens;
  active_ = true;
  drawn_ = false;
  ++steps_;
}

void StepProgress::at(int done, int total, bool backward) {
  if (!active_) return;
  const auto now = clock::now();
  const double secs = std::chrono::duration<double>(now - start_).count();
  const bool forced = mode() == 1;
  if (!forced && secs < 2) return;
  if (drawn_ && backward == drawn_backward_ &&
      std::chrono::duration<double>(now - last_).count() < 0.5)
    return;  // at most twice a second, and once as backward begins
  last_ = now;
  drawn_backward_ = backward;
  std::string line = "graft: step " + std::to_string(steps_) +
                     (backward ? " backward " : " forward ") +
                     std::to_string(total > 0 ? 100 * done / total : 100) + "% (" +
                     std::to_string(done) + "/" + std::to_string(total) + " ops) ";
  char s[32];
  std::snprintf(s, sizeof s, "%.1f s", secs);
  line += s;
  const StateFileTraffic t = state_file_traffic();
  if (t.read + t.written > 0)
    line += " | state file " + gb(t.read) + " read, " + gb(t.written) + " written";
  if (last_rate_ > 0) {
    std::snprintf(s, sizeof s, "%.0f", last_rate_);
    line += std::string(" | last step ") + s + " tokens/s";
  }
  // A terminal redraws one line; otherwise (GRAFT_PROGRESS=1 into a file or pipe) one per draw.
  std::fprintf(stderr, mode() == 2 ? "\r%s\x1b[K" : "%s\n", line.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void StepProgress::end() {
  if (!active_) return;
  active_ = false;
  const double secs = std::chrono::duration<double>(clock::now() - start_).count();
  last_rate_ = tokens_ > 0 && secs > 0 ? static_cast<double>(tokens_) / secs : 0;
  if (drawn_ && mode() == 2) {
    std::fputs("\r\x1b[K", stderr);
    std::fflush(stderr);
  }
}

}  // namespace graft
