// ONNX backend conformance runner: runs onnx's node test cases through graft.
//
//   run_conformance DATA_DIR [--write-lists OUT_DIR] [--no-fork] [--no-specialize] [--verbose]
//                   [--timeout SECONDS] [OP ...]
//
// DATA_DIR is what tests/conformance/generate.py wrote (it holds node/test_*/), or the node/
// folder itself. OPs select which ops' cases run (default: every op graft implements).
//
// A case is in scope when (a) its name belongs to one of the selected ops (test_gemm_*,
// test_sce_* for SoftmaxCrossEntropyLoss, test_tril*/test_triu* for Trilu, ...) and (b) every
// node in its model is an ONNX-domain op graft implements. Each in-scope case is run in a forked
// child (a crash or hang in a kernel is reported as a failure, never takes the runner down) and
// classified:
//   passed       every output matches output_N.pb (ONNX backend tolerances: rtol 1e-3, atol 1e-7,
//                numpy.testing.assert_allclose semantics; NaN == NaN; bool/int exact; dtype and
//                shape must match exactly)
//   unsupported  graft threw graft::Error of kind Unsupported (a dtype, attribute or opset graft
//                does not implement), or the expected output depends on a random Dropout mask
//                that no implementation can reproduce bit-for-bit (then graft's output must still
//                pass the structural checks y = mask * x / (1 - ratio))
//   failed       anything else
// Prints one line per non-passing case, then `conformance: N passed, M unsupported, K failed`.
// Exits 1 iff K > 0 (2 on a usage error).
#include <onnx/onnx_pb.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "graft/exec.h"
#include "graft/ir.h"
#include "graft/ops.h"

namespace fs = std::filesystem;
using namespace graft;

namespace {

// The ONNX-domain ops graft implements.
// The ONNX ops graft implements: its own op table (ONNX's default domain), so a new op's backend
// cases run as soon as the op is in the table.
std::vector<std::string> supported_ops() {
  std::vector<std::string> r;
  for (const graft::OpDef* d : graft::all_ops())
    if (std::string(d->domain).empty()) r.push_back(d->name);
  return r;
}
const std::vector<std::string> kSupported = supported_ops();

constexpr double kRtol = 1e-3, kAtol = 1e-7;

// "LayerNormalization" -> "layer_normalization".
std::string snake(const std::string& op) {
  std::string s;
  for (size_t i = 0; i < op.size(); ++i) {
    char ch = op[i];
    if (std::isupper(static_cast<unsigned char>(ch))) {
      if (i > 0) s += '_';
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    } else {
      s += ch;
    }
  }
  return s;
}

// The case-name stems onnx uses for an op's tests.
std::vector<std::string> name_stems(const std::string& op) {
  std::vector<std::string> v{snake(op)};
  std::string lower;
  for (char ch : op) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (lower != v[0]) v.push_back(lower);  // matmul, logsoftmax
  if (op == "SoftmaxCrossEntropyLoss") v.push_back("sce");
  if (op == "Trilu") v = {"tril", "triu"};
  if (op == "Dropout") v.push_back("training_dropout");
  if (op == "Pad") v = {"constant_pad", "edge_pad", "reflect_pad"};
  return v;
}

bool name_matches(const std::string& case_name, const std::string& stem) {
  const std::string p = "test_" + stem;
  return case_name == p || case_name.rfind(p + "_", 0) == 0;
}

struct Result {
  enum Status { Passed, Unsupported, Failed } status = Failed;
  std::string reason;
};

const char* status_name(Result::Status s) {
  switch (s) {
    case Result::Passed:
      return "passed";
    case Result::Unsupported:
      return "unsupported";
    case Result::Failed:
      return "failed";
  }
  return "?";
}

std::string one_line(std::string s) {
  for (char& ch : s)
    if (ch == '\n' || ch == '\r' || ch == '\t') ch = ' ';
  return s;
}

std::string fmt(double v) {
  std::ostringstream o;
  o.precision(9);
  o << v;
  return o.str();
}

// Compares one output; returns "" when it matches, else why not.
std::string compare(const Tensor& got, const Tensor& want, const std::string& name) {
  if (got.dtype() != want.dtype())
    return "output '" + name + "' has dtype " + dtype_name(got.dtype()) + ", expected " +
           dtype_name(want.dtype());
  if (got.shape() != want.shape())
    return "output '" + name + "' has shape " + shape_str(got.shape()) + ", expected " +
           shape_str(want.shape());
  const bool exact = !is_float(want.dtype());
  int64_t bad = 0, first = -1;
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double a = got.at(i), b = want.at(i);
    bool ok;
    if (exact) {
      ok = a == b;
    } else if (std::isnan(a) || std::isnan(b)) {
      ok = std::isnan(a) && std::isnan(b);
    } else if (std::isinf(a) || std::isinf(b)) {
      ok = a == b;
    } else {
      const double err = std::fabs(a - b), tol = kAtol + kRtol * std::fabs(b);
      ok = err <= tol;
      if (!ok && err - tol > worst) {
        worst = err - tol;
        worst_i = i;
      }
    }
    if (!ok) {
      ++bad;
      if (first < 0) first = i;
    }
  }
  if (bad == 0) return "";
  const int64_t i = worst_i >= 0 ? worst_i : first;
  return "output '" + name + "': " + std::to_string(bad) + " of " + std::to_string(want.numel()) +
         " elements differ (e.g. flat index " + std::to_string(i) + ": got " + fmt(got.at(i)) +
         ", expected " + fmt(want.at(i)) + ")";
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Why the case's expected outputs are random, or "" if they are not: a Dropout node in training
// mode with a ratio above 0 draws its mask from numpy's RNG.
std::string random_dropout(const Graph& g, const std::map<std::string, Tensor>& inputs, int& node,
                           double& ratio) {
  auto value_of = [&](const Node& n, size_t i) -> const Tensor* {
    if (i >= n.inputs.size() || n.inputs[i] < 0) return nullptr;
    const Value& v = g.values[n.inputs[i]];
    if (v.kind == ValueKind::Input) {
      auto it = inputs.find(v.name);
      return it == inputs.end() ? nullptr : &it->second;
    }
    return v.data.defined() ? &v.data : nullptr;
  };
  for (size_t k = 0; k < g.nodes.size(); ++k) {
    const Node& n = g.nodes[k];
    if (n.op != "Dropout" || !n.domain.empty()) continue;
    const Tensor* r = value_of(n, 1);
    const Tensor* t = value_of(n, 2);
    const double p = r && r->numel() ? r->at(0) : 0.5;
    const bool training = t && t->numel() && t->at(0) != 0;
    if (training && p > 0) {
      node = static_cast<int>(k);
      ratio = p;
      return "Dropout in training mode with ratio " + fmt(p);
    }
  }
  return "";
}

// For a random-mask Dropout case: checks what can be checked (dtype, shape, y = mask * x * scale,
// mask consistent with y). Returns "" when it holds.
std::string check_dropout_structure(const Tensor& x, double ratio, const std::vector<Tensor>& got,
                                    const std::vector<Tensor>& want) {
  for (size_t j = 0; j < got.size() && j < want.size(); ++j) {
    if (got[j].dtype() != want[j].dtype() || got[j].shape() != want[j].shape())
      return "output " + std::to_string(j) + " has dtype/shape " + dtype_name(got[j].dtype()) +
             shape_str(got[j].shape()) + ", expected " + dtype_name(want[j].dtype()) +
             shape_str(want[j].shape());
  }
  if (got.empty()) return "no outputs";
  const Tensor& y = got[0];
  if (y.numel() != x.numel()) return "output 0 and x differ in size";
  const double scale = 1.0 / (1.0 - ratio);
  int64_t kept = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    const double yi = y.at(i), want_kept = x.at(i) * scale;
    const bool is_kept = std::fabs(yi - want_kept) <= kAtol + kRtol * std::fabs(want_kept);
    const bool is_dropped = yi == 0;
    if (!is_kept && !is_dropped)
      return "y[" + std::to_string(i) + "] = " + fmt(yi) +
             " is neither 0 nor x / (1 - ratio) = " + fmt(want_kept);
    if (got.size() > 1) {
      const bool m = got[1].at(i) != 0;
      if (m ? !is_kept : !is_dropped)
        return "mask[" + std::to_string(i) + "] = " + std::to_string(m) + " disagrees with y";
      kept += m;
    }
  }
  if (got.size() > 1 && y.numel() >= 20 && (kept == 0 || kept == y.numel()))
    return "mask keeps " + std::to_string(kept) + " of " + std::to_string(y.numel()) +
           " elements at ratio " + fmt(ratio);
  return "";
}

// Operands whose values determine an op's output shape ("shape tensors"). graft plans static
// shapes, so like any ahead-of-time planner (TensorRT's shape-tensor inputs, XLA) it needs them at
// plan time. onnx's test cases pass them as graph inputs; when a graph input feeds only such
// operands, the runner binds its value from input_N.pb as a constant before planning (the value
// still reaches the kernel unchanged). --no-specialize turns this off.
const std::map<std::string, std::set<int>> kShapeOperands = {
    {"Reshape", {1}},
    {"Squeeze", {1}},
    {"Unsqueeze", {1}},
    {"Split", {1}},
    {"Slice", {1, 2, 3, 4}},
    {"Expand", {1}},
    {"ReduceSum", {1}},
    {"ReduceMean", {1}},
    {"Tile", {1}},
    {"ConstantOfShape", {0}},
    {"Range", {0, 1, 2}},
    {"CumSum", {1}},
    {"TopK", {1}},  // K
    {"Pad", {1}},
    {"Resize", {1, 2, 3}},  // roi (tf_crop_and_resize), scales, sizes
};
bool g_specialize = true;

// Turns graph inputs that feed only shape operands into constants holding the given values.
void specialize_shape_inputs(Graph& g, std::map<std::string, Tensor>& inputs) {
  auto cons = g.consumers();
  std::vector<int> keep_inputs;
  for (int v : g.inputs) {
    Value& val = g.values[v];
    auto it = inputs.find(val.name);
    bool shape_only = it != inputs.end() && !cons[v].empty();
    for (int ni : cons[v]) {
      const Node& n = g.nodes[ni];
      auto ops = kShapeOperands.find(n.op);
      for (size_t k = 0; k < n.inputs.size(); ++k)
        if (n.inputs[k] == v)
          shape_only = shape_only && n.domain.empty() && ops != kShapeOperands.end() &&
                       ops->second.count(static_cast<int>(k));
    }
    for (int o : g.outputs) shape_only = shape_only && o != v;
    if (!shape_only || it->second.dtype() != val.dtype) {
      keep_inputs.push_back(v);
      continue;
    }
    val.kind = ValueKind::Constant;
    val.data = it->second;
    val.shape = it->second.shape();
    val.shape_known = true;
    val.dim_params.clear();
    inputs.erase(it);
  }
  g.inputs = keep_inputs;
}

// Runs one case (in the forked child, or in-process with --no-fork).
Result run_case(const fs::path& dir, const onnx::ModelProto& mp) {
  Result res;
  try {
    Graph g = load_onnx((dir / "model.onnx").string());
    const fs::path ds = dir / "test_data_set_0";
    // Inputs: input_N.pb is the N-th graph input (initializers are not graph inputs).
    std::set<std::string> inits;
    for (const auto& t : mp.graph().initializer()) inits.insert(t.name());
    std::map<std::string, Tensor> inputs;
    int n = 0;
    for (const auto& vi : mp.graph().input()) {
      if (inits.count(vi.name())) continue;
      const fs::path f = ds / ("input_" + std::to_string(n++) + ".pb");
      if (!fs::exists(f)) fail(ErrorKind::InvalidArgument, "missing " + f.string());
      inputs[vi.name()] = load_tensor_pb(f.string());
    }
    int drop_node = -1;
    double ratio = 0;
    const std::string random = random_dropout(g, inputs, drop_node, ratio);
    Tensor drop_x;
    if (!random.empty()) {
      const Value& xv = g.values[g.nodes[drop_node].inputs[0]];
      auto it = inputs.find(xv.name);
      if (it != inputs.end()) drop_x = it->second;
    }

    if (g_specialize) specialize_shape_inputs(g, inputs);
    Allocator alloc;
    std::vector<Tensor> got = run_inference(g, inputs, alloc);
    // Expected outputs are read after the run, so an unsupported dtype is reported by graft.
    std::vector<Tensor> want;
    for (int j = 0; j < mp.graph().output_size(); ++j) {
      const fs::path f = ds / ("output_" + std::to_string(j) + ".pb");
      if (!fs::exists(f)) fail(ErrorKind::InvalidArgument, "missing " + f.string());
      want.push_back(load_tensor_pb(f.string()));
    }
    if (got.size() != want.size()) {
      res.reason = "graft returned " + std::to_string(got.size()) + " outputs, expected " +
                   std::to_string(want.size());
      return res;
    }
    if (!random.empty()) {
      if (!drop_x.defined() || g.nodes.size() != 1) {
        res.reason = random + " inside a larger graph: random mask, cannot check";
        res.status = Result::Unsupported;
        return res;
      }
      std::string why = check_dropout_structure(drop_x, ratio, got, want);
      if (!why.empty()) {
        res.reason = "random Dropout mask, and graft's output is not a valid dropout: " + why;
        return res;
      }
      res.status = Result::Unsupported;
      res.reason = "randomness: " + random +
                   " draws its mask from numpy's RNG, which cannot be reproduced bit-for-bit "
                   "(graft's output passed the structural checks y = mask * x / (1 - ratio))";
      return res;
    }
    for (size_t j = 0; j < want.size(); ++j) {
      std::string why = compare(got[j], want[j], mp.graph().output(static_cast<int>(j)).name());
      if (!why.empty()) {
        res.reason = why;
        return res;
      }
    }
    res.status = Result::Passed;
  } catch (const Error& e) {
    res.status = e.kind() == ErrorKind::Unsupported ? Result::Unsupported : Result::Failed;
    res.reason = e.what();
  } catch (const std::exception& e) {
    res.reason = std::string("exception: ") + e.what();
  } catch (...) {
    res.reason = "unknown exception";
  }
  return res;
}

// Runs a case in a child process so that a crash or hang is a failure, not the end of the run.
Result run_isolated(const fs::path& dir, const onnx::ModelProto& mp, int timeout_s) {
  int fds[2];
  if (pipe(fds) != 0) return run_case(dir, mp);
  std::cout.flush();
  std::cerr.flush();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return run_case(dir, mp);
  }
  if (pid == 0) {
    close(fds[0]);
    alarm(static_cast<unsigned>(timeout_s));
    Result r = run_case(dir, mp);
    std::string msg = std::to_string(static_cast<int>(r.status)) + "\n" + r.reason;
    size_t off = 0;
    while (off < msg.size()) {
      ssize_t w = write(fds[1], msg.data() + off, msg.size() - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string msg;
  char buf[4096];
  ssize_t got;
  while ((got = read(fds[0], buf, sizeof buf)) > 0) msg.append(buf, static_cast<size_t>(got));
  close(fds[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  Result r;
  if (WIFSIGNALED(st)) {
    int sig = WTERMSIG(st);
    r.reason = sig == SIGALRM ? "timed out after " + std::to_string(timeout_s) + " s"
                              : std::string("crashed: ") + strsignal(sig);
    return r;
  }
  size_t nl = msg.find('\n');
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || nl == std::string::npos) {
    r.reason = "the case's process exited without a result";
    return r;
  }
  r.status = static_cast<Result::Status>(std::stoi(msg.substr(0, nl)));
  r.reason = msg.substr(nl + 1);
  return r;
}

int usage() {
  std::cerr
      << "usage: run_conformance DATA_DIR [--write-lists OUT_DIR] [--no-fork] [--no-specialize] "
         "[--verbose] [--timeout SECONDS] [OP ...]\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  GOOGLE_PROTOBUF_VERIFY_VERSION;
  std::string data, lists;
  bool fork_cases = true, verbose = false;
  int timeout_s = 60;
  std::vector<std::string> ops;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--write-lists" && i + 1 < argc)
      lists = argv[++i];
    else if (a == "--no-fork")
      fork_cases = false;
    else if (a == "--no-specialize")
      g_specialize = false;
    else if (a == "--verbose" || a == "-v")
      verbose = true;
    else if (a == "--timeout" && i + 1 < argc)
      timeout_s = std::max(1, std::atoi(argv[++i]));
    else if (a == "--help" || a == "-h")
      return usage();
    else if (a.rfind("--", 0) == 0)
      return usage();
    else if (data.empty())
      data = a;
    else
      ops.push_back(a);
  }
  if (data.empty()) return usage();
  const std::set<std::string> supported(kSupported.begin(), kSupported.end());
  if (ops.empty()) ops = kSupported;
  for (const auto& op : ops)
    if (!supported.count(op)) {
      std::cerr << "run_conformance: '" << op << "' is not an op graft implements\n";
      return 2;
    }
  fs::path root(data);
  if (fs::is_directory(root / "node")) root /= "node";
  if (!fs::is_directory(root)) {
    std::cerr << "run_conformance: no test data in " << data
              << " (run tests/conformance/generate.py DIR first)\n";
    return 2;
  }
  std::vector<std::string> stems;
  for (const auto& op : ops)
    for (const auto& s : name_stems(op)) stems.push_back(s);

  std::vector<fs::path> cases;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && e.path().filename().string().rfind("test_", 0) == 0)
      cases.push_back(e.path());
  std::sort(cases.begin(), cases.end());

  int passed = 0, unsupported = 0, failed = 0, skipped = 0;
  std::vector<std::pair<std::string, std::string>> unsup_list, fail_list;
  for (const auto& dir : cases) {
    const std::string name = dir.filename().string();
    bool named = false;
    for (const auto& s : stems) named = named || name_matches(name, s);
    if (!named) {
      ++skipped;
      continue;
    }
    onnx::ModelProto mp;
    Result r;
    if (!mp.ParseFromString(read_file(dir / "model.onnx"))) {
      r.reason = "model.onnx is not a valid ONNX model";
    } else {
      bool in_scope = true;
      for (const auto& n : mp.graph().node())
        in_scope = in_scope && (n.domain().empty() || n.domain() == "ai.onnx") &&
                   supported.count(n.op_type());
      if (!in_scope) {
        ++skipped;
        if (verbose) std::cout << "skipped " << name << ": uses ops graft does not implement\n";
        continue;
      }
      r = fork_cases ? run_isolated(dir, mp, timeout_s) : run_case(dir, mp);
    }
    // Paths in messages are those of this run's data folder: drop them so the lists are stable.
    for (const std::string& p : {dir.string() + "/", root.string() + "/"})
      for (size_t at; (at = r.reason.find(p)) != std::string::npos;) r.reason.erase(at, p.size());
    r.reason = one_line(r.reason);
    switch (r.status) {
      case Result::Passed:
        ++passed;
        if (verbose) std::cout << "passed " << name << "\n";
        break;
      case Result::Unsupported:
        ++unsupported;
        unsup_list.emplace_back(name, r.reason);
        break;
      case Result::Failed:
        ++failed;
        fail_list.emplace_back(name, r.reason);
        break;
    }
    if (r.status != Result::Passed)
      std::cout << status_name(r.status) << " " << name << ": " << r.reason << std::endl;
  }
  if (!lists.empty()) {
    fs::create_directories(lists);
    auto write = [&](const std::string& file, const std::string& what,
                     const std::vector<std::pair<std::string, std::string>>& v) {
      std::ofstream f(fs::path(lists) / file);
      f << "# ONNX backend node cases " << what << " (written by run_conformance --write-lists)\n";
      for (const auto& [n, why] : v) f << n << ": " << why << "\n";
    };
    write("known_failures.txt", "that graft fails", fail_list);
    write("unsupported.txt", "that use features graft does not implement", unsup_list);
  }
  if (verbose) std::cout << skipped << " cases out of scope\n";
  std::cout << "conformance: " << passed << " passed, " << unsupported << " unsupported, " << failed
            << " failed" << std::endl;
  return failed > 0 ? 1 : 0;
}
