// Checkpoints through the C++ API (graft/checkpoint.h): a save / load round trip continues
// bit-identically to an uninterrupted run (SGD with momentum, AdamW, mid-accumulation); corrupt,
// truncated, bit-flipped and wrong-model files are refused with typed errors and leave the session
// untouched; resume_from_dir falls back to the previous good checkpoint.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "graft/checkpoint.h"
#include "graft/models.h"
#include "graft/ops.h"
#include "test_util.h"

using namespace graft;
using namespace graft_test;
namespace fs = std::filesystem;

namespace {
constexpr int64_t B = 4, H = 16, L = 3;

// A session over linear_stack with a fixed input, plus its optimizer.
struct Trainer {
  Allocator alloc;
  std::unique_ptr<TrainSession> s;
  std::unique_ptr<Optimizer> opt;
  explicit Trainer(const std::string& optimizer, int64_t hidden = H, int64_t layers = L) {
    s = std::make_unique<TrainSession>(linear_stack(B, hidden, layers, DType::F32, alloc, 3),
                                       session_options(alloc));
    s->set_input("x", ramp_input(alloc, B, hidden));
    if (optimizer == "sgd")
      opt = std::make_unique<SGD>(
          s->trainable(), SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3}, &alloc);
    else
      opt = std::make_unique<AdamW>(s->trainable(), AdamWOptions{.lr = 0.01, .weight_decay = 0.01},
                                    &alloc);
  }
  // One optimizer step over `micro` accumulated micro-batches.
  void train(int steps, int micro = 1) {
    for (int k = 0; k < steps; ++k) {
      s->zero_grad(false);
      for (int m = 0; m < micro; ++m) s->step();
      opt->step();
    }
  }
  std::vector<std::vector<char>> bytes() const {
    std::vector<std::vector<char>> r;
    for (const Parameter& p : s->parameters()) {
      const char* d = static_cast<const char*>(p.data.raw());
      r.emplace_back(d, d + p.data.nbytes());
      if (p.grad.defined()) {
        const char* g = static_cast<const char*>(p.grad.raw());
        r.emplace_back(g, g + p.grad.nbytes());
      }
    }
    return r;
  }
};

std::vector<char> read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_all(const std::string& p, const std::vector<char>& d) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(d.data(), static_cast<std::streamsize>(d.size()));
}

// Expects `f` to throw a graft::Error of `kind` whose message contains every needle.
void expect_error(const std::function<void()>& f, ErrorKind kind,
                  std::vector<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const auto& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << n << " not in: " << e.what();
  }
}
}  // namespace

TEST(Checkpoint, Crc32MatchesZlib) {
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
  // Continuation over pieces equals one pass (slicing-by-8 vs. the byte tail).
  std::string s(1001, 'x');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 131 + 7);
  EXPECT_EQ(crc32(s.data() + 13, s.size() - 13, crc32(s.data(), 13)), crc32(s.data(), s.size()));
}

class RoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(RoundTrip, ResumedRunIsBitIdentical) {
  set_num_threads(1);
  TempDir d("graft_ckpt_test_");
  Trainer full(GetParam());
  full.train(7);

  Trainer first(GetParam());
  first.train(3);
  save_checkpoint(d / "a.graft", *first.s, first.opt.get(), 3);
  CheckpointInfo info = verify_checkpoint(d / "a.graft");
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(info.optimizer, GetParam());
  EXPECT_EQ(info.parameters.size(), static_cast<size_t>(2 * L));

  Trainer resumed(GetParam());  // fresh weights: everything must come from the file
  ASSERT_NE(resumed.bytes(), first.bytes());
  EXPECT_EQ(load_checkpoint(d / "a.graft", *resumed.s, resumed.opt.get()), 3);
  EXPECT_EQ(resumed.bytes(), first.bytes());
  EXPECT_EQ(resumed.opt->steps(), 3);
  resumed.train(4);
  EXPECT_EQ(resumed.bytes(), full.bytes());
  EXPECT_EQ(resumed.opt->steps(), 7);
}

// A checkpoint taken between micro-batches keeps the accumulated gradients.
TEST_P(RoundTrip, MidAccumulationKeepsGradients) {
  set_num_threads(1);
  TempDir d("graft_ckpt_test_");
  Trainer full(GetParam());
  full.train(2, /*micro=*/3);

  Trainer first(GetParam());
  first.train(1, 3);
  first.s->zero_grad(false);
  first.s->step();
  first.s->step();  // two of three micro-batches accumulated
  save_checkpoint(d / "a.graft", *first.s, first.opt.get(), 1);

  Trainer resumed(GetParam());
  load_checkpoint(d / "a.graft", *resumed.s, resumed.opt.get());
  resumed.s->step();
  resumed.opt->step();
  EXPECT_EQ(resumed.bytes(), full.bytes());
}

TEST_P(RoundTrip, ParametersOnlyWithoutOptimizer) {
  TempDir d("graft_ckpt_test_");
  Trainer first(GetParam());
  first.train(2);
  first.s->zero_grad(true);
  save_checkpoint(d / "p.graft", *first.s, nullptr, 2);
  EXPECT_EQ(verify_checkpoint(d / "p.graft").optimizer, "");
  Trainer other(GetParam());
  EXPECT_EQ(load_checkpoint(d / "p.graft", *other.s, nullptr), 2);
  EXPECT_EQ(other.bytes(), first.bytes());
  // An optimizer cannot be restored from a file without optimizer state.
  expect_error([&] { load_checkpoint(d / "p.graft", *other.s, other.opt.get()); },
               ErrorKind::InvalidArgument, {"p.graft", "no optimizer state"});
}

INSTANTIATE_TEST_SUITE_P(Optimizers, RoundTrip, ::testing::Values("sgd", "adamw"));

TEST(Checkpoint, RngStateIsSavedAndRestored) {
  TempDir d("graft_ckpt_test_");
  Trainer r("sgd");
  r.s->set_rng_state(12345);
  save_checkpoint(d / "a.graft", *r.s, r.opt.get(), 0);
  r.s->set_rng_state(7);
  load_checkpoint(d / "a.graft", *r.s, r.opt.get());
  EXPECT_EQ(r.s->rng_state(), 12345u);
  // The counter is the session's: another session's steps do not advance it.
  Trainer other("sgd");
  other.train(2);
  EXPECT_EQ(r.s->rng_state(), 12345u);
}

// Every truncation and a bit flip in every region (preamble, header, data, trailer) is refused as
// InvalidModel, naming the file; the session and optimizer are untouched.
TEST(Checkpoint, CorruptFilesAreRefusedAndChangeNothing) {
  TempDir d("graft_ckpt_test_");
  Trainer src("adamw");
  src.train(2);
  save_checkpoint(d / "good.graft", *src.s, src.opt.get(), 2);
  const std::vector<char> good = read_all(d / "good.graft");
  Trainer dst("adamw");
  dst.train(1);
  const auto before = dst.bytes();
  const std::string bad = d / "bad.graft";

  auto refused = [&](const std::vector<char>& data, const std::string& needle) {
    write_all(bad, data);
    expect_error([&] { verify_checkpoint(bad); }, ErrorKind::InvalidModel, {"bad.graft", needle});
    expect_error([&] { load_checkpoint(bad, *dst.s, dst.opt.get()); }, ErrorKind::InvalidModel,
                 {"bad.graft", needle});
  };
  for (size_t n = 0; n < good.size(); n += (n < 64 ? 1 : 199))
    refused(std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)),
            "truncated");
  for (size_t i = 0; i < good.size(); i += (i < 64 || i + 16 > good.size() ? 1 : 151)) {
    for (int bit : {0, 5}) {
      std::vector<char> f = good;
      f[i] = static_cast<char>(f[i] ^ (1 << bit));
      refused(f, "");
    }
  }
  std::vector<char> longer = good;
  longer.push_back('x');
  refused(longer, "trailing garbage");
  std::vector<char> magic = good;
  magic[0] = 'X';
  refused(magic, "bad magic");
  std::vector<char> flipped = good;
  flipped[good.size() / 2] ^= 1;
  refused(flipped, "checksum mismatch");
  std::vector<char> ver = good;
  ver[8] = 9;
  refused(ver, "version 9 is not supported");

  EXPECT_EQ(dst.bytes(), before);
  EXPECT_EQ(dst.opt->steps(), 1);
  expect_error([&] { verify_checkpoint(d / "missing.graft"); }, ErrorKind::Io,
               {"missing.graft", "cannot open"});
}

TEST(Checkpoint, WrongModelOrOptimizerIsRefusedAndChangesNothing) {
  TempDir d("graft_ckpt_test_");
  Trainer src("sgd");
  src.train(2);
  save_checkpoint(d / "a.graft", *src.s, src.opt.get(), 2);

  Trainer wider("sgd", H * 2);
  auto before = wider.bytes();
  expect_error([&] { load_checkpoint(d / "a.graft", *wider.s, wider.opt.get()); },
               ErrorKind::ShapeMismatch,
               {"a.graft", "does not fit this model", "layers.0.weight", "[16,16]", "[32,32]"});
  EXPECT_EQ(wider.bytes(), before);

  Trainer deeper("sgd", H, L + 1);
  before = deeper.bytes();
  expect_error([&] { load_checkpoint(d / "a.graft", *deeper.s, deeper.opt.get()); },
               ErrorKind::InvalidArgument, {"a.graft", "lacks parameter(s) layers.3.weight"});
  EXPECT_EQ(deeper.bytes(), before);

  Trainer shallower("sgd", H, L - 1);
  expect_error([&] { load_checkpoint(d / "a.graft", *shallower.s, shallower.opt.get()); },
               ErrorKind::InvalidArgument, {"holds parameter(s) the model lacks: layers.2.weight"});

  Trainer adam("adamw");
  before = adam.bytes();
  expect_error([&] { load_checkpoint(d / "a.graft", *adam.s, adam.opt.get()); },
               ErrorKind::InvalidArgument, {"a.graft", "holds sgd state, the run uses adamw"});
  EXPECT_EQ(adam.bytes(), before);
}

TEST(CheckpointDir, KeepsNewestAndPointsLatest) {
  TempDir d("graft_ckpt_test_");
  Trainer r("adamw");
  for (int step = 1; step <= 5; ++step) {
    r.train(1);
    save_checkpoint_in_dir(d.path.string(), *r.s, r.opt.get(), step, 3);
  }
  auto files = list_checkpoints(d.path.string());
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0].first, 5);
  EXPECT_EQ(files[2].first, 3);
  std::ifstream latest(d / "latest");
  std::string line;
  std::getline(latest, line);
  EXPECT_EQ(line, "ckpt-00000005.graft");
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

TEST(CheckpointDir, ResumeFallsBackToThePreviousGoodCheckpoint) {
  set_num_threads(1);
  TempDir d("graft_ckpt_test_");
  const std::string dir = d.path.string();
  Trainer full("adamw");
  full.train(5);
  Trainer r("adamw");
  for (int step = 1; step <= 4; ++step) {
    r.train(1);
    save_checkpoint_in_dir(dir, *r.s, r.opt.get(), step);
  }
  // A stale temporary from an interrupted save, and a corrupt newest checkpoint.
  write_all(d / ".ckpt-00000005.graft.tmp-999", {'G', 'R'});
  std::vector<char> newest = read_all(d / checkpoint_file_name(4));
  newest[newest.size() / 3] ^= 0x10;
  write_all(d / checkpoint_file_name(4), newest);

  Trainer resumed("adamw");
  ResumeResult res = resume_from_dir(dir, *resumed.s, resumed.opt.get());
  ASSERT_TRUE(res.found);
  EXPECT_EQ(res.step, 3);
  EXPECT_EQ(res.path, d / checkpoint_file_name(3));
  ASSERT_EQ(res.skipped.size(), 1u);
  EXPECT_NE(res.skipped[0].find("ckpt-00000004.graft"), std::string::npos);
  EXPECT_NE(res.skipped[0].find("checksum mismatch"), std::string::npos);
  EXPECT_TRUE(fs::exists(d / "ckpt-00000004.graft.corrupt"));
  EXPECT_FALSE(fs::exists(d / ".ckpt-00000005.graft.tmp-999"));
  resumed.train(2);
  EXPECT_EQ(resumed.bytes(), full.bytes());
}

TEST(CheckpointDir, NoValidCheckpointIsAnErrorAndEmptyIsAFreshStart) {
  TempDir d("graft_ckpt_test_");
  const std::string dir = d.path.string();
  Trainer r("sgd");
  ResumeResult none = resume_from_dir(dir, *r.s, r.opt.get());
  EXPECT_FALSE(none.found);
  EXPECT_FALSE(resume_from_dir((d.path / "absent").string(), *r.s, r.opt.get()).found);

  r.train(1);
  save_checkpoint_in_dir(dir, *r.s, r.opt.get(), 1);
  r.train(1);
  save_checkpoint_in_dir(dir, *r.s, r.opt.get(), 2);
  for (int step : {1, 2}) {
    std::vector<char> f = read_all(d / checkpoint_file_name(step));
    f.resize(f.size() / 2);
    write_all(d / checkpoint_file_name(step), f);
  }
  Trainer other("sgd");
  const auto before = other.bytes();
  expect_error(
      [&] { resume_from_dir(dir, *other.s, other.opt.get()); }, ErrorKind::InvalidModel,
      {"no checkpoint in", "verifies", "ckpt-00000002.graft", "ckpt-00000001.graft", "truncated"});
  EXPECT_EQ(other.bytes(), before);
  // Nothing was renamed aside: a later resume sees the same files and refuses again.
  EXPECT_EQ(list_checkpoints(dir).size(), 2u);
}

TEST(CheckpointDir, CheckpointOfAnotherModelStopsTheResume) {
  TempDir d("graft_ckpt_test_");
  const std::string dir = d.path.string();
  Trainer r("sgd");
  r.train(1);
  save_checkpoint_in_dir(dir, *r.s, r.opt.get(), 1);
  Trainer wider("sgd", H * 2);
  expect_error([&] { resume_from_dir(dir, *wider.s, wider.opt.get()); }, ErrorKind::ShapeMismatch,
               {"ckpt-00000001.graft", "does not fit this model"});
  EXPECT_EQ(list_checkpoints(dir).size(), 1u);
}

TEST(Checkpoint, SaveFailureIsIoAndKeepsTheOldFile) {
  TempDir d("graft_ckpt_test_");
  Trainer r("sgd");
  r.train(1);
  save_checkpoint(d / "a.graft", *r.s, r.opt.get(), 1);
  const auto old = read_all(d / "a.graft");
  expect_error([&] { save_checkpoint(d / "no/such/dir/a.graft", *r.s, r.opt.get(), 2); },
               ErrorKind::Io, {"no/such/dir/a.graft", "cannot create temporary file"});
  // A folder in the way of the rename: the temporary is removed, the target untouched.
  fs::create_directories(d.path / "dir.graft" / "x");
  expect_error([&] { save_checkpoint(d / "dir.graft", *r.s, r.opt.get(), 2); }, ErrorKind::Io,
               {"dir.graft", "rename"});
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  EXPECT_EQ(read_all(d / "a.graft"), old);
}

// Optimizers serialize themselves (graft/train.h): kind(), state(), check_state(), load_state();
// the checkpoint code knows no optimizer class.
TEST_P(RoundTrip, OptimizerStateThroughTheInterface) {
  Trainer a(GetParam());
  a.train(2);
  const OptimizerKind* kind = find_optimizer_kind(a.opt->kind());
  ASSERT_NE(kind, nullptr);
  EXPECT_EQ(kind->name, GetParam());
  OptimizerState st = a.opt->state();
  std::set<std::string> names;
  for (const auto& [n, flag] : kind->hyper) names.insert(n);
  std::set<std::string> keys;
  for (const auto& [n, v] : st.hyper) keys.insert(n);
  EXPECT_EQ(keys, names);
  EXPECT_EQ(st.steps, 2);
  ASSERT_EQ(st.tensors.size(), a.opt->params().size());
  ASSERT_EQ(st.counters.size(), a.opt->params().size());
  for (size_t i = 0; i < st.tensors.size(); ++i) {
    EXPECT_EQ(st.tensors[i].size(), kind->tensors.size());  // every parameter has stepped
    EXPECT_EQ(st.counters[i], GetParam() == "adamw" ? 2 : 0);
  }

  Trainer b(GetParam());
  st.hyper["lr"] = 0.125;
  b.opt->load_state(st);
  OptimizerState got = b.opt->state();
  EXPECT_EQ(got.hyper, st.hyper);
  EXPECT_EQ(got.steps, 2);
  EXPECT_EQ(got.counters, st.counters);
  EXPECT_EQ(b.opt->steps(), 2);

  // Refused states change nothing.
  Trainer c(GetParam());
  c.train(1);
  const OptimizerState before = c.opt->state();
  auto refused = [&](OptimizerState bad, ErrorKind k, const std::string& needle) {
    expect_error([&] { c.opt->load_state(bad); }, k, {needle});
    OptimizerState now = c.opt->state();
    EXPECT_EQ(now.hyper, before.hyper);
    EXPECT_EQ(now.steps, before.steps);
    EXPECT_EQ(now.counters, before.counters);
  };
  OptimizerState bad = st;
  bad.hyper["lr"] = -1;
  refused(bad, ErrorKind::InvalidArgument, "hyperparameters out of range");
  bad = st;
  bad.hyper.erase("weight_decay");
  refused(bad, ErrorKind::InvalidArgument, "'weight_decay' is missing");
  bad = st;
  bad.tensors.pop_back();
  refused(bad, ErrorKind::InvalidArgument, "parameters");
  bad = st;
  bad.tensors[0]["velocity"] = st.tensors[0].begin()->second;
  refused(bad, ErrorKind::InvalidArgument, "unknown tensor 'velocity'");
  bad = st;
  bad.tensors[0].begin()->second = st.tensors[1].begin()->second;  // a bias's state for a weight
  refused(bad, ErrorKind::ShapeMismatch, "layers.0.weight");
  if (GetParam() == "adamw") {
    bad = st;
    bad.tensors[0].erase("exp_avg_sq");
    refused(bad, ErrorKind::InvalidArgument, "exp_avg and exp_avg_sq exactly when its step is > 0");
  }
}

TEST(Checkpoint, UnknownOptimizerKind) {
  EXPECT_EQ(find_optimizer_kind("lion"), nullptr);
  ASSERT_NE(find_optimizer_kind("sgd"), nullptr);
  EXPECT_EQ(find_optimizer_kind("sgd")->tensors, std::vector<std::string>{"momentum_buffer"});
  EXPECT_EQ(find_optimizer_kind("adamw")->tensors,
            (std::vector<std::string>{"exp_avg", "exp_avg_sq"}));
}
