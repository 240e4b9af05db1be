// What the subcommands share: checked command-line values and file-system preconditions (sizes
// with binary suffixes, thread counts, input files read with a bound, output folders proven
// writable before any work starts; docs/faults.md), input shapes and tensors, printing sizes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "commands.h"

namespace graft::cli {
namespace fs = std::filesystem;

int64_t vm_rss() { return proc_kb_field("/proc/self/status", "VmRSS"); }
int64_t vm_hwm() { return proc_kb_field("/proc/self/status", "VmHWM"); }

int64_t anon_bytes() {
  std::ifstream f("/proc/self/statm");
  long long size = 0, resident = 0, shared = 0;
  if (!(f >> size >> resident >> shared)) return -1;
  return static_cast<int64_t>(resident - shared) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

double monotonic_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int64_t parse_size(const std::string& flag, const std::string& text) {
  auto bad = [&](const std::string& why) -> int64_t {
    fail(ErrorKind::InvalidArgument,
         flag + " '" + text + "': " + why +
             " (give bytes, or a number with K, M, G or T: 1024-based, e.g. 512M, 8GiB, 1.5G)");
  };
  if (text.empty()) return bad("empty value");
  size_t i = 0;
  unsigned __int128 whole = 0;
  size_t int_digits = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    whole = whole * 10 + static_cast<unsigned>(text[i] - '0');
    if (whole > static_cast<unsigned __int128>(INT64_MAX))
      return bad("too large (the limit is 2^63-1 bytes)");
    ++i;
    ++int_digits;
  }
  unsigned __int128 frac = 0, frac_den = 1;
  size_t frac_digits = 0;
  if (i < text.size() && text[i] == '.') {
    ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
      if (frac_digits < 18) {  // further digits cannot change a whole number of bytes below 2^63
        frac = frac * 10 + static_cast<unsigned>(text[i] - '0');
        frac_den *= 10;
      }
      ++i;
      ++frac_digits;
    }
    if (frac_digits == 0) return bad("not a number");
  }
  if (int_digits == 0) return bad(text[0] == '-' ? "must not be negative" : "not a number");
  std::string suffix = text.substr(i);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = -1;
  if (suffix.empty() || suffix == "B") shift = 0;
  const char* units = "KMGT";
  for (int k = 0; k < 4 && shift < 0; ++k) {
    const std::string u(1, units[k]);
    if (suffix == u || suffix == u + "B" || suffix == u + "IB") shift = 10 * (k + 1);
  }
  if (shift < 0) return bad("unknown unit '" + text.substr(i) + "'");
  const unsigned __int128 mult = static_cast<unsigned __int128>(1) << shift;
  if (frac_digits && shift == 0 && frac != 0) return bad("not a whole number of bytes");
  const unsigned __int128 bytes =
      whole * mult + frac * mult / frac_den;  // rounded down to whole bytes
  if (bytes > static_cast<unsigned __int128>(INT64_MAX))
    return bad("too large (the limit is 2^63-1 bytes)");
  return static_cast<int64_t>(bytes);
}

void check_threads(const std::string& flag, int threads) {
  GRAFT_CHECK(
      threads >= 0, ErrorKind::InvalidArgument,
      flag + " " + std::to_string(threads) + ": must be >= 0 (0: the BLAS library's default)");
  GRAFT_CHECK(
      threads <= 4096, ErrorKind::InvalidArgument,
      flag + " " + std::to_string(threads) + ": more than 4096 threads is not a sane setting");
}

namespace {
std::string file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

}  // namespace

int64_t input_file_limit() {
  // A TensorProto is one protobuf message, which protobuf refuses past 2 GiB; nothing larger can
  // be a valid input file. Reading it takes its size in memory (twice, briefly: the bytes and the
  // tensor), so it must also fit in what the machine has available.
  int64_t limit = (int64_t{2} << 30) - 1;
  int64_t avail = available_memory_bytes();
  if (avail > 0) limit = std::min(limit, avail);
  return limit;
}

void check_input_files(const std::vector<std::string>& files) {
  std::map<std::pair<dev_t, ino_t>, std::string> first;
  const int64_t limit = input_file_limit();
  for (const std::string& f : files) {
    struct stat st {};
    // stat, not open: opening a FIFO would block and a device would read without end.
    if (::stat(f.c_str(), &st) != 0)
      fail(ErrorKind::Io, "--inputs '" + f + "': cannot open: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      fail(ErrorKind::InvalidArgument,
           "--inputs '" + f + "' is not a regular file (" + file_kind(st.st_mode) + ")");
    if (st.st_size > limit)
      fail(ErrorKind::InvalidArgument,
           "--inputs '" + f + "' is " + std::to_string(st.st_size) + " bytes, over the limit of " +
               std::to_string(limit) +
               " bytes (2 GiB, the protobuf message limit, or the available memory)");
    auto key = std::make_pair(st.st_dev, st.st_ino);
    auto [it, fresh] = first.emplace(key, f);
    if (!fresh)
      fail(ErrorKind::InvalidArgument,
           "--inputs '" + f + "' is given twice" +
               (it->second == f ? std::string() : " (also as '" + it->second + "')"));
  }
}

void prepare_output_dir(const std::string& flag, const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Io, flag + " '" + dir + "': cannot create the folder: " + ec.message());
  if (!fs::is_directory(dir, ec)) fail(ErrorKind::Io, flag + " '" + dir + "': not a folder");
  // Prove it writable now, not after hours of training: create and remove a probe file.
  const std::string probe =
      (fs::path(dir) / (".graft-probe-" + std::to_string(::getpid()))).string();
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW,
                  0644);
  if (fd < 0 && errno == EEXIST) {  // a leftover of a killed run with our pid: replace it
    ::unlink(probe.c_str());
    fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW,
                0644);
  }
  if (fd < 0)
    fail(ErrorKind::Io,
         flag + " '" + dir + "': the folder is not writable: " + std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

std::map<std::string, Shape> parse_shapes(const std::vector<std::string>& specs) {
  std::map<std::string, Shape> out;
  for (const auto& s : specs) {
    auto eq = s.rfind('=');
    GRAFT_CHECK(eq != std::string::npos && eq > 0, ErrorKind::InvalidArgument,
                "--input '" + s + "' should look like name=2x3x4");
    Shape shape;
    std::string dims = s.substr(eq + 1);
    size_t pos = 0;
    while (pos <= dims.size() && !dims.empty()) {
      size_t x = dims.find('x', pos);
      std::string d = dims.substr(pos, x == std::string::npos ? std::string::npos : x - pos);
      GRAFT_CHECK(
          !d.empty() && d.find_first_not_of("0123456789") == std::string::npos && d.size() < 18,
          ErrorKind::InvalidArgument, "--input '" + s + "': '" + d + "' is not a dimension");
      shape.push_back(std::stoll(d));
      if (x == std::string::npos) break;
      pos = x + 1;
    }
    out[s.substr(0, eq)] = shape;
  }
  return out;
}

std::string human_bytes(int64_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  const char* u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::abs(v) >= 1024 && i < 4) {
    v /= 1024;
    ++i;
  }
  std::snprintf(buf, sizeof buf, i ? "%.2f %s" : "%.0f %s", v, u[i]);
  return buf;
}

std::map<std::string, Tensor> make_inputs(const Graph& g,
                                          const std::map<std::string, Shape>& shapes,
                                          const std::vector<std::string>& files, Allocator& alloc) {
  std::map<std::string, Tensor> inputs;
  std::map<std::string, std::string> from_file;  // input name -> the file that gave it
  check_input_files(files);
  size_t next_slot = 0;
  for (const auto& f : files) {
    std::string name;
    Tensor t = load_tensor_pb(f, &name);
    if (name.empty() || g.find(name) < 0 || g.values[g.find(name)].kind != ValueKind::Input) {
      while (next_slot < g.inputs.size() && inputs.count(g.values[g.inputs[next_slot]].name))
        ++next_slot;
      GRAFT_CHECK(next_slot < g.inputs.size(), ErrorKind::InvalidArgument,
                  "more --inputs files than the model has inputs");
      name = g.values[g.inputs[next_slot]].name;
    }
    GRAFT_CHECK(!from_file.count(name), ErrorKind::InvalidArgument,
                "input '" + name + "' is given twice: by --inputs '" + from_file[name] + "' and '" +
                    f + "'");
    auto sh = shapes.find(name);
    GRAFT_CHECK(sh == shapes.end(), ErrorKind::InvalidArgument,
                "input '" + name + "' is given both by --inputs '" + f + "' and by --input " +
                    name + " (shape " +
                    (sh == shapes.end() ? std::string() : shape_str(sh->second)) +
                    "): a conflict; give one or the other");
    from_file[name] = f;
    inputs[name] = t.clone(alloc, Category::Workspace);
  }
  for (const auto& [name, s] : shapes) {
    int v = g.find(name);
    GRAFT_CHECK(v >= 0 && g.values[v].kind == ValueKind::Input, ErrorKind::InvalidArgument,
                "--input " + name + ": the model has no input of that name");
  }
  std::mt19937_64 rng(0);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int v : g.inputs) {
    const Value& val = g.values[v];
    if (inputs.count(val.name)) continue;
    Shape s = val.shape;
    auto it = shapes.find(val.name);
    if (it != shapes.end()) s = it->second;
    for (int64_t d : s)
      GRAFT_CHECK(d >= 0, ErrorKind::InvalidArgument,
                  "input '" + val.name + "' has a symbolic shape; give it with --input " +
                      val.name + "=...");
    numel(s, "input '" + val.name + "'");
    Tensor t = Tensor::zeros(s, val.dtype, alloc, Category::Workspace, val.name);
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (val.dtype == DType::F32)
        t.data<float>()[i] = static_cast<float>(nd(rng));
      else if (val.dtype == DType::F64)
        t.data<double>()[i] = nd(rng);
    }
    inputs[val.name] = t;
  }
  return inputs;
}

void save_tensor(const std::string& dir, const std::string& file, const Tensor& t,
                 const std::string& name) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  GRAFT_CHECK(!ec, ErrorKind::Io, "cannot create folder '" + dir + "': " + ec.message());
  save_tensor_pb(dir + "/" + file, t, name);
}

bool parse_precision(const std::string& p) {
  GRAFT_CHECK(p == "fp32" || p == "bf16", ErrorKind::InvalidArgument,
              "unknown --precision '" + p + "' (use fp32 or bf16)");
  return p == "bf16";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace graft::cli
