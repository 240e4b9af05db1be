// A progress line on stderr while a long training step runs (internal to src/train; Note [step
// progress] in progress.cpp).
#pragma once

#include <chrono>
#include <cstdint>

namespace graft {

class StepProgress {
 public:
  // `tokens`: elements of the step's first integer input (token ids), 0 when it has none.
  void begin(int64_t tokens);
  // The executor's callback: plan step `done` of `total` ran; `backward`: past the barrier.
  void at(int done, int total, bool backward);
  void end();  // the step is over: the line is cleared, the step's rate kept for the next
  // Whether lines are drawn at all: GRAFT_PROGRESS=1 always, =0 never, unset when stderr is a
  // terminal (read once per process).
  static bool enabled();

 private:
  using clock = std::chrono::steady_clock;
  clock::time_point start_{}, last_{};
  int64_t tokens_ = 0, steps_ = 0;
  double last_rate_ = 0;  // tokens/s of the last step
  bool drawn_ = false, active_ = false, drawn_backward_ = false;
};

}  // namespace graft
