// AdamW's state in a file (Note [optimizer state on disk], src/train/state_file.cpp): updates
// bit-identical to AdamW in RAM, in step mode and out of order; the read-ahead and write-behind
// counted; no page of the file left in the page cache; a disk that cannot hold the state, and a
// write that fails, are errors naming the path; a checkpoint streams the state one parameter at a
// time, both ways (Note [checkpoints of a state file]).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "graft/checkpoint.h"
#include "graft/models.h"
#include "graft/train.h"
#include "test_util.h"

using namespace graft;
using namespace graft_test;

namespace {
constexpr int64_t B = 4, H = 48, L = 3;

std::string temp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/graft_state_" + std::to_string(::getpid()) +
         "_" + name;
}

struct Trained {
  std::vector<std::vector<float>> weights;
  StateFileStats stats;
};

// A step-mode session over the seed's linear stack (float32), its input set.
std::unique_ptr<TrainSession> step_session(Allocator& alloc) {
  auto s = std::make_unique<TrainSession>(linear_stack(B, H, L, DType::F32, alloc, 7),
                                          session_options(alloc, GradMode::Step));
  s->set_input("x", ramp_input(alloc, B, H, DType::F32));
  return s;
}
AdamWOptions adamw_options() {
  AdamWOptions ao;
  ao.lr = 0.01;
  return ao;
}

// The session's weights (float32), for exact comparison.
std::vector<std::vector<float>> weights_of(TrainSession& s) {
  std::vector<std::vector<float>> w;
  for (const Parameter& p : s.parameters())
    w.emplace_back(p.data.data<float>(), p.data.data<float>() + p.data.numel());
  return w;
}

// `steps` AdamW steps in step mode on the seed's linear stack (float32), the state in RAM
// (path empty) or in a file with the given window.
Trained train(int steps, const std::string& path, int64_t window = 0, bool direct = true) {
  Allocator alloc;
  auto sp = step_session(alloc);
  TrainSession& s = *sp;
  AdamW opt(s.trainable(), adamw_options(), &alloc);
  if (!path.empty()) opt.set_state_file({path, window, direct});
  s.set_step_optimizer(&opt);
  for (int k = 0; k < steps; ++k) s.step();
  Trained r;
  r.weights = weights_of(s);
  r.stats = opt.state_file_stats();
  return r;
}

int64_t state_bytes() { return 2 * 4 * L * (H * H + H); }  // exp_avg + exp_avg_sq, float32

// Pages of `path` in the page cache (mincore over a mapping of it).
int64_t resident_pages(const std::string& path, int64_t* total) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return -1;
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  const long page = ::sysconf(_SC_PAGESIZE);
  *total = (size + page - 1) / page;
  void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fileno(f), 0);
  std::fclose(f);
  if (m == MAP_FAILED) return -1;
  std::vector<unsigned char> v(static_cast<size_t>(*total));
  ::mincore(m, static_cast<size_t>(size), v.data());
  ::munmap(m, static_cast<size_t>(size));
  int64_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}
}  // namespace

TEST(StateFile, AdamWStepModeIsBitIdenticalToRam) {
  const Trained ram = train(5, "");
  EXPECT_TRUE(ram.stats.path.empty());
  for (int64_t window : {int64_t{1}, int64_t{0}}) {  // one parameter's state at a time; default
    SCOPED_TRACE(window);
    const std::string path = temp_path("exact");
    const Trained disk = train(5, path, window);
    EXPECT_EQ(disk.weights, ram.weights);
    EXPECT_EQ(disk.stats.path, path);
    // Every step writes the whole state; every step but the first reads it (the first starts
    // from zeros and reads nothing).
    EXPECT_EQ(disk.stats.bytes_written, 5 * state_bytes());
    // (and the last step reads ahead for a next step that never comes: at most one more)
    EXPECT_GE(disk.stats.bytes_read, 4 * state_bytes());
    EXPECT_LE(disk.stats.bytes_read, 5 * state_bytes());
    EXPECT_GE(disk.stats.file_bytes, state_bytes());
    ::unlink(path.c_str());
  }
}

TEST(StateFile, ReadAheadFindsStatesInTheLastStepsOrder) {
  const std::string path = temp_path("ahead");
  const Trained disk = train(6, path, 0);
  // 2L parameters updated per step; from step 2 on, all but possibly the first of each step are
  // read ahead (the read of the first overlaps the backward before its gradient completes).
  EXPECT_GE(disk.stats.prefetch_hits, 5 * (2 * L - 1)) << "prefetch hits";
  ::unlink(path.c_str());
}

TEST(StateFile, UpdatesOutOfOrderAreStillExact) {
  // AdamW driven by hand: each step updates the parameters in a fresh random order, so the
  // read-ahead's prediction (the last step's order) is wrong every time.
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct);
    Allocator alloc;
    std::vector<Parameter> pa(5), pb(5);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<Tensor> grads;
    for (int i = 0; i < 5; ++i) {
      const int64_t n = 100 + 700 * i;
      for (auto* ps : {&pa, &pb}) {
        (*ps)[i].name = "p" + std::to_string(i);
        (*ps)[i].data = Tensor::zeros({n}, DType::F32, alloc, Category::Parameter);
      }
      Tensor g = Tensor::empty({n}, DType::F32, alloc, Category::Gradient);
      for (int64_t k = 0; k < n; ++k) g.data<float>()[k] = u(rng);
      grads.push_back(g);
    }
    std::vector<Parameter*> va, vb;
    for (int i = 0; i < 5; ++i) va.push_back(&pa[i]), vb.push_back(&pb[i]);
    AdamW ram(va, {}, &alloc), disk(vb, {}, &alloc);
    const std::string path = temp_path("order");
    disk.set_state_file({path, 1, direct});
    std::vector<size_t> order{0, 1, 2, 3, 4};
    for (int step = 0; step < 6; ++step) {
      std::shuffle(order.begin(), order.end(), rng);
      ram.begin_step();
      disk.begin_step();
      for (size_t i : order) {
        if (step % 2 && i == order[0]) continue;  // and a parameter skips a step now and then
        ram.update(i, grads[i]);
        disk.update(i, grads[i]);
      }
    }
    for (int i = 0; i < 5; ++i)
      EXPECT_EQ(0, std::memcmp(pa[i].data.raw(), pb[i].data.raw(), pa[i].data.nbytes())) << i;
    const OptimizerState a = ram.state(), b = disk.state();
    EXPECT_EQ(a.counters, b.counters);
    for (int i = 0; i < 5; ++i)
      for (const char* t : {"exp_avg", "exp_avg_sq"})
        EXPECT_EQ(0, std::memcmp(a.tensors[i].at(t).raw(), b.tensors[i].at(t).raw(),
                                 a.tensors[i].at(t).nbytes()))
            << i << " " << t;
    ::unlink(path.c_str());
  }
}

TEST(StateFile, TheStateSurvivesACheckpointRoundTrip) {
  // 3 steps, the state saved (state()) and loaded into a fresh file-backed AdamW, 3 more: the
  // same as 6 steps in RAM.
  const Trained ram = train(6, "");
  Allocator alloc;
  auto sp = step_session(alloc);
  TrainSession& s = *sp;
  const AdamWOptions ao = adamw_options();
  const std::string p1 = temp_path("ck1"), p2 = temp_path("ck2");
  OptimizerState saved;
  {
    AdamW opt(s.trainable(), ao, &alloc);
    opt.set_state_file({p1});
    s.set_step_optimizer(&opt);
    for (int k = 0; k < 3; ++k) s.step();
    saved = opt.state();
  }
  AdamW opt(s.trainable(), ao, &alloc);
  opt.set_state_file({p2});
  opt.load_state(saved);
  for (const auto& t : opt.exp_avg()) EXPECT_FALSE(t.defined());  // the state is in the file
  s.set_step_optimizer(&opt);
  for (int k = 0; k < 3; ++k) s.step();
  EXPECT_EQ(weights_of(s), ram.weights);
  ::unlink(p1.c_str());
  ::unlink(p2.c_str());
}

TEST(StateFile, ThePageCacheKeepsNoneOfIt) {
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct);
    const std::string path = temp_path("cache");
    const Trained disk = train(4, path, 0, direct);
    int64_t total = 0;
    const int64_t resident = resident_pages(path, &total);
    ASSERT_GE(resident, 0);
    EXPECT_GT(total, 0);
    EXPECT_EQ(resident, 0) << "of " << total << " pages (direct I/O " << disk.stats.direct_io
                           << ")";
    ::unlink(path.c_str());
  }
}

TEST(StateFile, ADiskThatCannotHoldItIsAnErrorBeforeTheFirstStep) {
  Allocator alloc;
  Parameter p;
  p.name = "w";
  p.data = Tensor::zeros({1 << 16}, DType::F32, alloc, Category::Parameter);
  AdamW opt({&p}, {}, &alloc);
  try {
    opt.set_state_file({"/nonexistent-graft-dir/state.bin"});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-graft-dir/state.bin"), std::string::npos)
        << e.what();
  }
  // A file size limit below the state's 512 KiB stands in for a full disk.
  struct rlimit old {};
  ::getrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string path = temp_path("full");
  std::string msg;
  try {
    opt.set_state_file({path});
  } catch (const Error& e) {
    msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::Io);
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("524288 bytes"), std::string::npos) << msg;
  ::unlink(path.c_str());
}

TEST(StateFile, AFailedWriteIsRaisedNamingThePath) {
  Allocator alloc;
  std::vector<Parameter> ps(2);
  for (int i = 0; i < 2; ++i) {
    ps[i].name = "w" + std::to_string(i);
    ps[i].data = Tensor::zeros({1 << 15}, DType::F32, alloc, Category::Parameter);
  }
  Tensor g = Tensor::zeros({1 << 15}, DType::F32, alloc, Category::Gradient);
  AdamW opt({&ps[0], &ps[1]}, {}, &alloc);
  const std::string path = temp_path("failwrite");
  opt.set_state_file({path});
  // The second parameter's region lies past 256 KiB: a limit there fails its write.
  struct rlimit old {};
  ::getrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 256 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg;
  try {
    opt.begin_step();
    opt.update(0, g);
    opt.update(1, g);
    opt.begin_step();
    opt.update(0, g);
    opt.update(1, g);
  } catch (const Error& e) {
    msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::Io);
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  ::unlink(path.c_str());
}

namespace {
std::string file_bytes(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  std::string out;
  if (!f) return out;
  char buf[1 << 16];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  std::fclose(f);
  return out;
}
}  // namespace

TEST(StateFile, ACheckpointStreamsTheStateOneParameterAtATime) {
  // 3 steps with the state in a file; save_checkpoint; load it into a fresh session whose AdamW
  // has its own state file; 3 more steps. The same weights as 6 steps in RAM, the same checkpoint
  // bytes as AdamW in RAM saves after 3, and neither saving nor loading holds more than two of
  // the largest parameter's state in RAM at once (the old way held all of it, and staged a copy
  // of every weight to load).
  const Trained ram6 = train(6, "");
  const std::string ck_ram = temp_path("ck_ram.graft"), ck_file = temp_path("ck_file.graft");
  {
    Allocator alloc;
    auto sp = step_session(alloc);
    AdamW opt(sp->trainable(), adamw_options(), &alloc);
    sp->set_step_optimizer(&opt);
    for (int k = 0; k < 3; ++k) sp->step();
    save_checkpoint(ck_ram, *sp, &opt, 3);
  }
  const int64_t largest_state = 2 * 4 * H * H;  // exp_avg + exp_avg_sq of one H x H weight
  const std::string p1 = temp_path("sf1"), p2 = temp_path("sf2");
  {
    Allocator alloc;
    auto sp = step_session(alloc);
    AdamW opt(sp->trainable(), adamw_options(), &alloc);
    opt.set_state_file({p1});
    sp->set_step_optimizer(&opt);
    for (int k = 0; k < 3; ++k) sp->step();
    opt.state_file_stats();  // the writes behind the last step done
    alloc.reset_peak();
    const int64_t before = alloc.current();
    save_checkpoint(ck_file, *sp, &opt, 3);
    EXPECT_LE(alloc.peak() - before, 2 * largest_state + 8192);
    EXPECT_GT(alloc.peak() - before, 0);  // (it did read the state through the allocator)
  }
  EXPECT_EQ(file_bytes(ck_file), file_bytes(ck_ram));
  EXPECT_FALSE(file_bytes(ck_file).empty());
  Allocator alloc;
  auto sp = step_session(alloc);
  TrainSession& s = *sp;
  for (Parameter& p : s.parameters()) std::memset(p.data.raw(), 0, p.data.nbytes());
  AdamW opt(s.trainable(), adamw_options(), &alloc);
  opt.set_state_file({p2});
  // A state the file held before the load and the checkpoint does not replace must not survive:
  // one update of the first parameter writes it, out of any step.
  opt.begin_step();
  opt.update(0,
             Tensor::zeros(s.trainable()[0]->data.shape(), DType::F32, alloc, Category::Gradient));
  alloc.reset_peak();
  const int64_t before = alloc.current();
  EXPECT_EQ(load_checkpoint(ck_file, s, &opt), 3);
  EXPECT_LE(alloc.peak() - before, 2 * largest_state + 8192);
  for (const auto& t : opt.exp_avg()) EXPECT_FALSE(t.defined());  // the state is in the file
  EXPECT_EQ(opt.steps(), 3);
  s.set_step_optimizer(&opt);
  for (int k = 0; k < 3; ++k) s.step();
  EXPECT_EQ(weights_of(s), ram6.weights);
  for (const std::string& p : {ck_ram, ck_file, p1, p2}) ::unlink(p.c_str());
}

TEST(StateFile, LoadingACheckpointWithoutStateForgetsTheFilesOld) {
  // A checkpoint saved before the first step has no optimizer state: loaded into an AdamW whose
  // file already holds some, training from it is training from zeros, as in RAM.
  const Trained ram3 = train(3, "");
  const std::string ck = temp_path("ck0.graft"), p1 = temp_path("sf0");
  Allocator alloc;
  auto sp = step_session(alloc);
  TrainSession& s = *sp;
  AdamW opt(s.trainable(), adamw_options(), &alloc);
  opt.set_state_file({p1});
  save_checkpoint(ck, s, &opt, 0);
  s.set_step_optimizer(&opt);
  s.step();
  s.step();
  EXPECT_EQ(load_checkpoint(ck, s, &opt), 0);
  EXPECT_EQ(opt.steps(), 0);
  for (int k = 0; k < 3; ++k) s.step();
  EXPECT_EQ(weights_of(s), ram3.weights);
  ::unlink(ck.c_str());
  ::unlink(p1.c_str());
}

TEST(StateFile, AParameterLargerThanTheWindowStreamsThroughItInUnits) {
  // One weight of 1.25 units (40 MiB of each moment, 80 MiB of state) and a small one, AdamW with
  // a window of one unit: bit-identical to AdamW in RAM over 3 steps, the optimizer's RAM under
  // the weight's state, and state() (a checkpoint's read) reassembles each moment from its units.
  const int64_t big = kStateFileUnitBytes / 4 + kStateFileUnitBytes / 16, little = 1000;
  Allocator ram_alloc, file_alloc;
  std::vector<Parameter> a(2), b(2);
  for (auto* ps : {&a, &b})
    for (int i = 0; i < 2; ++i) {
      Allocator& al = ps == &a ? ram_alloc : file_alloc;
      (*ps)[i].name = "w" + std::to_string(i);
      (*ps)[i].data = Tensor::zeros({i == 0 ? big : little}, DType::F32, al, Category::Parameter);
      float* w = (*ps)[i].data.data<float>();
      for (int64_t k = 0; k < (*ps)[i].data.numel(); ++k)
        w[k] = 0.001f * static_cast<float>(k % 997);
    }
  AdamW in_ram({&a[0], &a[1]}, adamw_options(), &ram_alloc);
  AdamW in_file({&b[0], &b[1]}, adamw_options(), &file_alloc);
  const std::string path = temp_path("units");
  const int64_t unit = 2 * kStateFileUnitBytes;  // one unit's buffer: both moments
  in_file.set_state_file({path, unit});
  EXPECT_EQ(in_file.state_file_stats().window_bytes, unit);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  file_alloc.reset_peak();
  const int64_t before = file_alloc.current();
  for (int step = 0; step < 3; ++step) {
    in_ram.begin_step();
    in_file.begin_step();
    for (size_t i : {size_t{1}, size_t{0}}) {
      Tensor g = Tensor::empty(a[i].data.shape(), DType::F32, ram_alloc, Category::Gradient);
      for (int64_t k = 0; k < g.numel(); ++k) g.data<float>()[k] = nd(rng);
      in_ram.update(i, g);
      in_file.update(i, g);
    }
  }
  in_file.state_file_stats();  // every write behind done
  // The window, plus the unit an update reads for itself while the last one is still being
  // written (it does not wait for the write).
  EXPECT_LE(file_alloc.peak() - before, 2 * (unit + 4096));
  EXPECT_LT(file_alloc.peak() - before, 2 * 2 * big * 4);  // under the parameter's whole state
  for (int i = 0; i < 2; ++i)
    EXPECT_EQ(0, std::memcmp(a[i].data.raw(), b[i].data.raw(), a[i].data.nbytes())) << i;
  const OptimizerState sa = in_ram.state(), sb = in_file.state();
  for (int i = 0; i < 2; ++i)
    for (const char* t : {"exp_avg", "exp_avg_sq"})
      EXPECT_EQ(0, std::memcmp(sa.tensors[i].at(t).raw(), sb.tensors[i].at(t).raw(),
                               sa.tensors[i].at(t).nbytes()))
          << i << " " << t;
  ::unlink(path.c_str());
}

TEST(StateFile, ReadingAheadStopsAtTheMemoryLimitInsteadOfFailing) {
  // AdamW's allocator limited to a little more than one unit beyond the weights, a window of
  // many: reading ahead cannot take a second buffer while one is in use, so it stops (it is
  // optional) and each update reads its own unit. Bit-identical to RAM. (Before: the refusal
  // was thrown from the read-ahead, out of the update, or on the I/O thread, ending the process.)
  const int64_t n = kStateFileUnitBytes / 8;  // 4 MiB per moment: a 8 MiB unit per parameter
  Allocator ram_alloc, file_alloc;
  std::vector<Parameter> a(3), b(3);
  for (auto* ps : {&a, &b})
    for (int i = 0; i < 3; ++i) {
      Allocator& al = ps == &a ? ram_alloc : file_alloc;
      (*ps)[i].name = "w" + std::to_string(i);
      (*ps)[i].data = Tensor::zeros({n}, DType::F32, al, Category::Parameter);
    }
  AdamW in_ram({&a[0], &a[1], &a[2]}, adamw_options(), &ram_alloc);
  AdamW in_file({&b[0], &b[1], &b[2]}, adamw_options(), &file_alloc);
  const std::string path = temp_path("limit");
  in_file.set_state_file({path, 64 << 20});
  file_alloc.set_limit(file_alloc.current() + 2 * n * 4 + (1 << 20));  // one unit, and 1 MiB
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int step = 0; step < 3; ++step) {
    in_ram.begin_step();
    in_file.begin_step();
    for (size_t i = 0; i < 3; ++i) {
      Tensor g = Tensor::empty({n}, DType::F32, ram_alloc, Category::Gradient);
      for (int64_t k = 0; k < n; ++k) g.data<float>()[k] = nd(rng);
      in_ram.update(i, g);
      ASSERT_NO_THROW(in_file.update(i, g)) << "step " << step << " parameter " << i;
    }
  }
  in_file.state_file_stats();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(0, std::memcmp(a[i].data.raw(), b[i].data.raw(), a[i].data.nbytes())) << i;
  ::unlink(path.c_str());
}

// Note [AdamW's vector update] (optim.cpp): the float32 update runs an ISA clone whose vector
// square roots and divisions must give the scalar formula's bits. The reference here is that
// formula, element by element in float (PyTorch 1.13's single-tensor AdamW), over a length with a
// ragged tail and values spanning many binades, for three steps.
TEST(AdamW, VectorUpdateGivesTheScalarFormulasBits) {
  Allocator alloc;
  const int64_t n = 4099;  // not a multiple of any vector width
  Parameter p;
  p.name = "w";
  p.data = Tensor::zeros({n}, DType::F32, alloc, Category::Parameter);
  Tensor g = Tensor::zeros({n}, DType::F32, alloc, Category::Gradient);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(-1.f, 1.f), expo(-20.f, 8.f);
  std::vector<float> w(n), m(n, 0.f), v(n, 0.f);
  for (int64_t k = 0; k < n; ++k) w[k] = p.data.data<float>()[k] = unit(rng) * std::exp2(expo(rng));
  AdamWOptions o;
  o.lr = 0.01;
  o.weight_decay = 0.1;
  AdamW opt({&p}, o, &alloc);
  for (int step = 1; step <= 3; ++step) {
    for (int64_t k = 0; k < n; ++k) g.data<float>()[k] = unit(rng) * std::exp2(expo(rng));
    opt.begin_step();
    opt.update(0, g);
    const double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
    const float decay = static_cast<float>(1 - o.lr * o.weight_decay);
    const float b1 = static_cast<float>(o.beta1), b2 = static_cast<float>(o.beta2);
    const float c1 = static_cast<float>(1 - o.beta1), c2 = static_cast<float>(1 - o.beta2);
    const float step_size = static_cast<float>(o.lr / bc1);
    const float sqrt_bc2 = static_cast<float>(std::sqrt(bc2)), eps = static_cast<float>(o.eps);
    int64_t differ = 0, first = -1;
    for (int64_t k = 0; k < n; ++k) {
      const float gk = g.data<float>()[k];
      w[k] = w[k] * decay;
      const float mg = gk * c1, mm = m[k] * b1;
      m[k] = mm + mg;
      const float gg = gk * gk, g2 = gg * c2, vv = v[k] * b2;
      v[k] = vv + g2;
      const float root = std::sqrt(v[k]), scaled = root / sqrt_bc2, denom = scaled + eps;
      const float ratio = m[k] / denom, delta = step_size * ratio;
      w[k] = w[k] - delta;
      if (std::memcmp(&w[k], p.data.data<float>() + k, sizeof(float)) != 0 && differ++ == 0)
        first = k;
    }
    EXPECT_EQ(differ, 0) << "step " << step << ": first at " << first << ": "
                         << p.data.data<float>()[first] << " != " << w[first];
  }
}
