// Crash-safe checkpoints: a preamble, a JSON header, raw tensor bytes and a CRC-32 trailer,
// written to a temporary file and renamed into place (see docs/checkpoints.md).
//
// Reading is two passes: verify_checkpoint streams the whole file through the CRC and validates
// the header without allocating tensors; load_checkpoint then matches the header against the
// session, allocates staging tensors (sizes already validated), reads the data again (checking the
// CRC again, in case the file changed in between) and only then commits, so a failure at any
// point leaves the session and the optimizer as they were.
#include "graft/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "graft/ops.h"

static_assert(std::endian::native == std::endian::little, "graft checkpoints are little-endian");

namespace graft {
namespace fs = std::filesystem;
using json = nlohmann::json;

// --- CRC-32 (reflected, polynomial 0xEDB88320, as zlib), slicing by 8 ----------------------------
namespace {
struct CrcTables {
  uint32_t t[8][256];
  constexpr CrcTables() : t{} {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};
constexpr CrcTables kCrc;
}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& t = kCrc.t;
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  while (n >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;
    crc = t[7][a & 0xff] ^ t[6][(a >> 8) & 0xff] ^ t[5][(a >> 16) & 0xff] ^ t[4][a >> 24] ^
          t[3][b & 0xff] ^ t[2][(b >> 8) & 0xff] ^ t[1][(b >> 16) & 0xff] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

namespace {
// --- layout --------------------------------------------------------------------------------------
constexpr char kMagic[8] = {'G', 'R', 'A', 'F', 'T', 'C', 'K', 'P'};
constexpr char kEndMagic[4] = {'G', 'E', 'N', 'D'};
constexpr size_t kPreamble = 32;  // magic, u32 version, u32 flags, u64 header bytes, u64 data bytes
constexpr size_t kTrailer = 8;    // u32 CRC-32 of everything before it, "GEND"

std::string errno_str() { return std::strerror(errno); }

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  fail(ErrorKind::InvalidModel, "checkpoint '" + path + "' is corrupt: " + what);
}
[[noreturn]] void io_error(const std::string& path, const std::string& what) {
  fail(ErrorKind::Io, "checkpoint '" + path + "': " + what);
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a plain file";
}

// Opens a checkpoint for reading without ever blocking: O_NONBLOCK (a FIFO would otherwise wait
// for a writer forever), then refuses anything but a regular file before the first read.
void open_regular(Fd& f, const std::string& path) {
  f.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f.fd < 0) io_error(path, "cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_error(path, "cannot stat: " + errno_str());
  if (!S_ISREG(st.st_mode)) io_error(path, std::string("not a regular file (") + file_kind(st.st_mode) + ")");
  int fl = ::fcntl(f.fd, F_GETFL);  // regular files never block; clear the flag all the same
  if (fl >= 0) ::fcntl(f.fd, F_SETFL, fl & ~O_NONBLOCK);
}

void read_exact(int fd, void* buf, size_t n, const std::string& path) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) io_error(path, "read failed: " + errno_str());
    if (r == 0) io_error(path, "the file shrank while being read");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void write_exact(int fd, const void* buf, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) io_error(path, "write failed: " + errno_str());
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void fsync_dir(const fs::path& dir, const std::string& path) {
  Fd d;
  d.fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0) io_error(path, "cannot open folder '" + dir.string() + "' to sync it: " + errno_str());
  if (::fsync(d.fd) != 0 && errno != EINVAL) io_error(path, "fsync of folder '" + dir.string() + "' failed: " + errno_str());
}

// Writes a file atomically: `fill` writes the contents into a temporary file in the same folder,
// which is fsynced and renamed over `path`; then the folder is fsynced.
template <class Fill>
void write_atomically(const std::string& path, Fill&& fill) {
  fs::path target(path);
  fs::path dir = target.parent_path();
  fs::path tmp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()));
  Fd f;
  f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd < 0) io_error(path, "cannot create temporary file '" + tmp.string() + "': " + errno_str());
  try {
    fill(f.fd);
    if (::fsync(f.fd) != 0) io_error(path, "fsync failed: " + errno_str());
    int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) io_error(path, "close failed: " + errno_str());
    // Test hook (tests/python/test_checkpoint.py): widens the window between a complete temporary
    // and the rename, so that kills land inside a save.
    if (const char* d = std::getenv("GRAFT_CHECKPOINT_TEST_DELAY_US")) ::usleep(static_cast<useconds_t>(std::atoll(d)));
    if (::rename(tmp.c_str(), target.c_str()) != 0) io_error(path, "rename from '" + tmp.string() + "' failed: " + errno_str());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_dir(dir, path);
}

// --- the parsed header ---------------------------------------------------------------------------
struct Blob {
  int64_t offset = 0, bytes = 0;
};
struct ParamEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  bool trainable = true;
  Blob data;
  bool has_grad = false;
  Blob grad;
};
struct SlotEntry {
  std::string name;  // momentum_buffer, exp_avg, exp_avg_sq
  Blob blob;
};
struct StateEntry {
  std::string param;
  int64_t step = 0;  // AdamW's per-parameter step
  std::vector<SlotEntry> slots;
};
struct Header {
  std::string path;
  int64_t file_size = 0;
  uint64_t header_bytes = 0, data_bytes = 0;
  uint32_t crc = 0;
  int64_t step = 0;
  uint64_t rng = 0;
  std::vector<ParamEntry> params;
  bool has_opt = false;
  std::string kind;
  int64_t opt_steps = 0;
  SGDOptions sgd;
  AdamWOptions adamw;
  std::vector<StateEntry> state;
};

const json& req(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  if (!j.is_object() || !j.contains(key)) corrupt(path, ctx + ": missing '" + key + "'");
  return j.at(key);
}
int64_t req_int(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)))
    corrupt(path, ctx + ": '" + key + "' is not an integer");
  return v.get<int64_t>();
}
double req_num(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_number()) corrupt(path, ctx + ": '" + key + "' is not a number");
  return v.get<double>();
}
std::string req_str(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_string()) corrupt(path, ctx + ": '" + key + "' is not a string");
  return v.get<std::string>();
}
bool req_bool(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_boolean()) corrupt(path, ctx + ": '" + key + "' is not a boolean");
  return v.get<bool>();
}

DType parse_dtype(const std::string& s, const std::string& ctx, const std::string& path) {
  for (DType t : {DType::F32, DType::F64, DType::I64, DType::Bool})
    if (s == dtype_name(t)) return t;
  corrupt(path, ctx + ": unknown dtype '" + s + "'");
}

// Blobs lie back to back in header order; `cursor` is where the next one must start.
Blob parse_blob(const json& j, int64_t want_bytes, int64_t& cursor, const std::string& ctx, const std::string& path) {
  Blob b;
  b.offset = req_int(j, "offset", ctx, path);
  b.bytes = req_int(j, "bytes", ctx, path);
  if (b.bytes != want_bytes)
    corrupt(path, ctx + ": holds " + std::to_string(b.bytes) + " bytes, its dtype and shape need " + std::to_string(want_bytes));
  if (b.offset != cursor)
    corrupt(path, ctx + ": starts at data offset " + std::to_string(b.offset) + ", expected " + std::to_string(cursor));
  cursor += b.bytes;
  return b;
}

json blob_json(int64_t& cursor, int64_t bytes) {
  json j = {{"offset", cursor}, {"bytes", bytes}};
  cursor += bytes;
  return j;
}

// Parses and validates the header JSON against the data section size.
void parse_header(const std::string& text, Header& h) {
  const std::string& path = h.path;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    corrupt(path, std::string("the header is not valid JSON: ") + e.what());
  }
  try {
    if (req_str(j, "format", "header", path) != "graft-checkpoint") corrupt(path, "header: format is not 'graft-checkpoint'");
    h.step = req_int(j, "step", "header", path);
    if (h.step < 0) corrupt(path, "header: negative step");
    const json& rng = req(j, "rng", "header", path);
    const json& dc = req(rng, "dropout_counter", "rng", path);
    if (!dc.is_number_integer()) corrupt(path, "rng: 'dropout_counter' is not an integer");
    h.rng = dc.get<uint64_t>();

    int64_t cursor = 0;
    const json& ps = req(j, "parameters", "header", path);
    if (!ps.is_array()) corrupt(path, "header: 'parameters' is not an array");
    std::map<std::string, size_t> index;
    for (const json& pj : ps) {
      ParamEntry p;
      p.name = req_str(pj, "name", "parameter", path);
      std::string ctx = "parameter '" + p.name + "'";
      if (!index.emplace(p.name, h.params.size()).second) corrupt(path, ctx + " appears twice");
      p.dtype = parse_dtype(req_str(pj, "dtype", ctx, path), ctx, path);
      const json& sj = req(pj, "shape", ctx, path);
      if (!sj.is_array()) corrupt(path, ctx + ": 'shape' is not an array");
      for (const json& d : sj) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0) corrupt(path, ctx + ": bad dimension in 'shape'");
        p.shape.push_back(d.get<int64_t>());
      }
      int64_t n;
      try {
        n = numel(p.shape);
      } catch (const Error&) {
        corrupt(path, ctx + ": shape " + shape_str(p.shape) + " is too large");
      }
      const int64_t es = static_cast<int64_t>(dtype_size(p.dtype));
      if (n > INT64_MAX / es) corrupt(path, ctx + ": shape " + shape_str(p.shape) + " is too large");
      p.trainable = req_bool(pj, "trainable", ctx, path);
      p.data = parse_blob(req(pj, "data", ctx, path), n * es, cursor, ctx + " data", path);
      const json& g = req(pj, "grad", ctx, path);
      if (!g.is_null()) {
        p.has_grad = true;
        p.grad = parse_blob(g, n * es, cursor, ctx + " grad", path);
      }
      h.params.push_back(std::move(p));
    }

    const json& oj = req(j, "optimizer", "header", path);
    if (!oj.is_null()) {
      h.has_opt = true;
      h.kind = req_str(oj, "kind", "optimizer", path);
      h.opt_steps = req_int(oj, "steps", "optimizer", path);
      if (h.opt_steps < 0) corrupt(path, "optimizer: negative step count");
      const json& hp = req(oj, "hyperparameters", "optimizer", path);
      std::set<std::string> allowed;
      if (h.kind == "sgd") {
        h.sgd.lr = req_num(hp, "lr", "sgd", path);
        h.sgd.momentum = req_num(hp, "momentum", "sgd", path);
        h.sgd.dampening = req_num(hp, "dampening", "sgd", path);
        h.sgd.weight_decay = req_num(hp, "weight_decay", "sgd", path);
        h.sgd.nesterov = req_bool(hp, "nesterov", "sgd", path);
        const SGDOptions& o = h.sgd;
        if (!(o.lr >= 0 && o.momentum >= 0 && o.weight_decay >= 0 && std::isfinite(o.lr) && std::isfinite(o.momentum) &&
              std::isfinite(o.dampening) && std::isfinite(o.weight_decay)) ||
            (o.nesterov && !(o.momentum > 0 && o.dampening == 0)))
          corrupt(path, "sgd: hyperparameters out of range");
        allowed = {"momentum_buffer"};
      } else if (h.kind == "adamw") {
        h.adamw.lr = req_num(hp, "lr", "adamw", path);
        h.adamw.beta1 = req_num(hp, "beta1", "adamw", path);
        h.adamw.beta2 = req_num(hp, "beta2", "adamw", path);
        h.adamw.eps = req_num(hp, "eps", "adamw", path);
        h.adamw.weight_decay = req_num(hp, "weight_decay", "adamw", path);
        const AdamWOptions& o = h.adamw;
        if (!(o.lr >= 0 && o.eps >= 0 && o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1 &&
              std::isfinite(o.lr) && std::isfinite(o.eps) && std::isfinite(o.weight_decay)))
          corrupt(path, "adamw: hyperparameters out of range");
        allowed = {"exp_avg", "exp_avg_sq"};
      } else {
        corrupt(path, "optimizer: unknown kind '" + h.kind + "'");
      }
      const json& st = req(oj, "state", "optimizer", path);
      if (!st.is_array()) corrupt(path, "optimizer: 'state' is not an array");
      std::set<std::string> seen;
      for (const json& sj : st) {
        StateEntry e;
        e.param = req_str(sj, "param", "optimizer state", path);
        std::string ctx = "optimizer state of '" + e.param + "'";
        auto it = index.find(e.param);
        if (it == index.end()) corrupt(path, ctx + ": no such parameter in the checkpoint");
        if (!seen.insert(e.param).second) corrupt(path, ctx + " appears twice");
        const ParamEntry& p = h.params[it->second];
        const int64_t bytes = numel(p.shape) * static_cast<int64_t>(dtype_size(p.dtype));
        e.step = req_int(sj, "step", ctx, path);
        if (e.step < 0) corrupt(path, ctx + ": negative step");
        const json& slots = req(sj, "slots", ctx, path);
        if (!slots.is_array()) corrupt(path, ctx + ": 'slots' is not an array");
        for (const json& slj : slots) {
          SlotEntry s;
          s.name = req_str(slj, "name", ctx, path);
          if (!allowed.count(s.name)) corrupt(path, ctx + ": unknown slot '" + s.name + "' for " + h.kind);
          s.blob = parse_blob(slj, bytes, cursor, ctx + " " + s.name, path);
          e.slots.push_back(std::move(s));
        }
        if (h.kind == "adamw") {
          bool full = e.slots.size() == 2 && e.slots[0].name == "exp_avg" && e.slots[1].name == "exp_avg_sq";
          if (!(e.step > 0 ? full : e.slots.empty()))
            corrupt(path, ctx + ": AdamW state needs exp_avg and exp_avg_sq exactly when its step is > 0");
        } else if (e.slots.size() > 1) {
          corrupt(path, ctx + ": more than one momentum_buffer");
        }
        h.state.push_back(std::move(e));
      }
    }
    if (static_cast<uint64_t>(cursor) != h.data_bytes)
      corrupt(path, "the header describes " + std::to_string(cursor) + " data bytes, the file holds " +
                        std::to_string(h.data_bytes));
  } catch (const json::exception& e) {
    corrupt(path, std::string("malformed header: ") + e.what());
  }
}

// Pass 1: size, magic, version, CRC over the whole file, then the header.
Header read_and_verify(const std::string& path) {
  Header h;
  h.path = path;
  Fd f;
  open_regular(f, path);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_error(path, "cannot stat: " + errno_str());
  h.file_size = st.st_size;
  if (h.file_size < static_cast<int64_t>(kPreamble + kTrailer))
    corrupt(path, "truncated: " + std::to_string(h.file_size) + " bytes, shorter than the " +
                      std::to_string(kPreamble + kTrailer) + "-byte frame");
  unsigned char pre[kPreamble];
  read_exact(f.fd, pre, kPreamble, path);
  if (std::memcmp(pre, kMagic, 8) != 0) corrupt(path, "bad magic (expected 'GRAFTCKP')");
  uint32_t version, flags;
  std::memcpy(&version, pre + 8, 4);
  std::memcpy(&flags, pre + 12, 4);
  std::memcpy(&h.header_bytes, pre + 16, 8);
  std::memcpy(&h.data_bytes, pre + 24, 8);
  if (version != kCheckpointVersion)
    corrupt(path, "format version " + std::to_string(version) + " is not supported (this graft reads version " +
                      std::to_string(kCheckpointVersion) + ")");
  if (flags != 0) corrupt(path, "unknown flags " + std::to_string(flags));
  const uint64_t room = static_cast<uint64_t>(h.file_size) - kPreamble - kTrailer;
  if (h.header_bytes > room || h.data_bytes > room - h.header_bytes || h.header_bytes + h.data_bytes != room) {
    // A partial write shows up here: the preamble promises more than the file holds.
    const bool fits = h.header_bytes <= room && h.data_bytes <= room - h.header_bytes;
    const unsigned __int128 want = static_cast<unsigned __int128>(kPreamble) + kTrailer + h.header_bytes + h.data_bytes;
    std::string want_s = want > static_cast<unsigned __int128>(UINT64_MAX) ? "more than 2^64" : std::to_string(static_cast<uint64_t>(want));
    corrupt(path, std::string(fits ? "trailing garbage" : "truncated") + ": the file has " + std::to_string(h.file_size) +
                      " bytes, its preamble describes " + want_s);
  }
  uint32_t crc = crc32(pre, kPreamble);
  std::string header(h.header_bytes, '\0');
  read_exact(f.fd, header.data(), header.size(), path);
  crc = crc32(header.data(), header.size(), crc);
  std::vector<char> buf(std::min<uint64_t>(h.data_bytes, uint64_t{4} << 20));
  for (uint64_t left = h.data_bytes; left > 0;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
    read_exact(f.fd, buf.data(), n, path);
    crc = crc32(buf.data(), n, crc);
    left -= n;
  }
  unsigned char tr[kTrailer];
  read_exact(f.fd, tr, kTrailer, path);
  std::memcpy(&h.crc, tr, 4);
  if (std::memcmp(tr + 4, kEndMagic, 4) != 0) corrupt(path, "bad end marker (expected 'GEND')");
  if (crc != h.crc) {
    char msg[96];
    std::snprintf(msg, sizeof msg, "checksum mismatch (CRC-32 stored %08x, computed %08x)", h.crc, crc);
    corrupt(path, msg);
  }
  parse_header(header, h);
  return h;
}

std::string join_names(const std::vector<std::string>& v, size_t max = 5) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < max; ++i) s += (i ? ", " : "") + v[i];
  if (v.size() > max) s += ", ... (" + std::to_string(v.size()) + " in all)";
  return s;
}

// Checks that a verified header fits the session and optimizer, without modifying either.
void check_fits(const Header& h, const TrainSession& s, const Optimizer* opt) {
  const std::string pre = "checkpoint '" + h.path + "' does not fit this ";
  std::map<std::string, const ParamEntry*> by_name;
  for (const ParamEntry& p : h.params) by_name[p.name] = &p;
  std::vector<std::string> missing, extra;
  std::set<std::string> have;
  for (const Parameter& p : s.parameters()) {
    have.insert(p.name);
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      missing.push_back(p.name);
      continue;
    }
    const ParamEntry& e = *it->second;
    if (e.dtype != p.data.dtype() || e.shape != p.data.shape())
      fail(ErrorKind::ShapeMismatch, pre + "model: parameter '" + p.name + "' is " + dtype_name(e.dtype) + " " +
                                         shape_str(e.shape) + " in the checkpoint, " + dtype_name(p.data.dtype()) +
                                         " " + shape_str(p.data.shape()) + " in the model");
  }
  for (const ParamEntry& e : h.params)
    if (!have.count(e.name)) extra.push_back(e.name);
  if (!missing.empty())
    fail(ErrorKind::InvalidArgument, pre + "model: it lacks parameter(s) " + join_names(missing));
  if (!extra.empty())
    fail(ErrorKind::InvalidArgument, pre + "model: it holds parameter(s) the model lacks: " + join_names(extra));
  if (!opt) return;
  std::string kind = dynamic_cast<const SGD*>(opt) ? "sgd" : dynamic_cast<const AdamW*>(opt) ? "adamw" : "";
  GRAFT_CHECK(!kind.empty(), ErrorKind::InvalidArgument, "load_checkpoint: unsupported optimizer type");
  if (!h.has_opt) fail(ErrorKind::InvalidArgument, pre + "optimizer: it holds no optimizer state, the run uses " + kind);
  if (h.kind != kind)
    fail(ErrorKind::InvalidArgument, pre + "optimizer: it holds " + h.kind + " state, the run uses " + kind);
  const auto& ps = opt->params();
  if (ps.size() != h.state.size())
    fail(ErrorKind::InvalidArgument, pre + "optimizer: it updates " + std::to_string(h.state.size()) +
                                         " parameters, the run's optimizer " + std::to_string(ps.size()));
  for (size_t i = 0; i < ps.size(); ++i)
    if (ps[i]->name != h.state[i].param)
      fail(ErrorKind::InvalidArgument, pre + "optimizer: its parameter " + std::to_string(i) + " is '" + h.state[i].param +
                                           "', the run's optimizer has '" + ps[i]->name + "'");
}

struct Staged {
  std::vector<Tensor> data, grad;               // per header parameter (grad undefined if none)
  std::vector<std::vector<Tensor>> slots;       // per state entry, per slot
};

// Pass 2: reads every tensor into freshly allocated staging tensors, checking the CRC again.
Staged stage(const Header& h, TrainSession& s, Optimizer* opt) {
  const std::string& path = h.path;
  Allocator& sa = s.allocator();
  Allocator* oa = nullptr;
  if (auto* sgd = dynamic_cast<SGD*>(opt)) oa = &sgd->allocator();
  if (auto* adam = dynamic_cast<AdamW*>(opt)) oa = &adam->allocator();
  Fd f;
  open_regular(f, path);
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) io_error(path, "cannot stat: " + errno_str());
  if (st.st_size != h.file_size) io_error(path, "the file changed while being loaded");
  std::string prefix(kPreamble + h.header_bytes, '\0');
  read_exact(f.fd, prefix.data(), prefix.size(), path);
  uint32_t crc = crc32(prefix.data(), prefix.size());
  auto read_into = [&](Tensor& t) {
    read_exact(f.fd, t.raw(), t.nbytes(), path);
    crc = crc32(t.raw(), t.nbytes(), crc);
  };
  Staged out;
  for (const ParamEntry& p : h.params) {
    Tensor d = Tensor::empty(p.shape, p.dtype, sa, Category::Workspace, p.name + " (checkpoint)");
    read_into(d);
    out.data.push_back(d);
    Tensor g;
    if (p.has_grad) {
      g = Tensor::empty(p.shape, p.dtype, sa, Category::Gradient, p.name + ".grad");
      read_into(g);
    }
    out.grad.push_back(g);
  }
  std::map<std::string, const ParamEntry*> by_name;
  for (const ParamEntry& p : h.params) by_name[p.name] = &p;
  for (const StateEntry& e : h.state) {
    std::vector<Tensor> ts;
    const ParamEntry& p = *by_name.at(e.param);
    for (const SlotEntry& sl : e.slots) {
      Tensor t = Tensor::empty(p.shape, p.dtype, opt && oa ? *oa : sa, Category::OptimizerState, p.name + "." + sl.name);
      read_into(t);
      ts.push_back(t);
    }
    out.slots.push_back(std::move(ts));
  }
  unsigned char tr[kTrailer];
  read_exact(f.fd, tr, kTrailer, path);
  uint32_t stored;
  std::memcpy(&stored, tr, 4);
  if (stored != h.crc || crc != h.crc) io_error(path, "the file changed while being loaded (checksum differs from the first read)");
  return out;
}

void commit(const Header& h, Staged& st, TrainSession& s, Optimizer* opt) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < h.params.size(); ++i) index[h.params[i].name] = i;
  for (Parameter& p : s.parameters()) {
    size_t i = index.at(p.name);
    if (p.data.nbytes()) std::memcpy(p.data.raw(), st.data[i].raw(), p.data.nbytes());
    const Tensor& g = st.grad[i];
    if (!g.defined()) p.grad = Tensor();
    else if (p.grad.defined() && p.grad.dtype() == g.dtype() && p.grad.shape() == g.shape()) {
      if (g.nbytes()) std::memcpy(p.grad.raw(), g.raw(), g.nbytes());
    } else {
      p.grad = g;
    }
  }
  if (opt) {
    if (auto* sgd = dynamic_cast<SGD*>(opt)) {
      sgd->options = h.sgd;
      for (size_t i = 0; i < h.state.size(); ++i)
        sgd->momentum_buffer()[i] = st.slots[i].empty() ? Tensor() : st.slots[i][0];
    } else if (auto* adam = dynamic_cast<AdamW*>(opt)) {
      adam->options = h.adamw;
      for (size_t i = 0; i < h.state.size(); ++i) {
        adam->param_steps()[i] = h.state[i].step;
        adam->exp_avg()[i] = st.slots[i].empty() ? Tensor() : st.slots[i][0];
        adam->exp_avg_sq()[i] = st.slots[i].empty() ? Tensor() : st.slots[i][1];
      }
    }
    opt->set_steps(h.opt_steps);
  }
  set_dropout_rng_state(h.rng);
}

int64_t load_verified(const Header& h, TrainSession& s, Optimizer* opt) {
  GRAFT_CHECK(!s.in_run(), ErrorKind::InvalidArgument,
              "load_checkpoint: the session is inside a run (forward without backward); cancel() it first");
  check_fits(h, s, opt);
  Staged st = stage(h, s, opt);
  commit(h, st, s, opt);
  return h.step;
}

bool parse_step(const std::string& name, int64_t& step) {
  constexpr std::string_view pre = "ckpt-", suf = ".graft";
  if (name.size() <= pre.size() + suf.size() || !name.starts_with(pre) || !name.ends_with(suf)) return false;
  const char* b = name.data() + pre.size();
  const char* e = name.data() + name.size() - suf.size();
  if (!std::all_of(b, e, [](char c) { return c >= '0' && c <= '9'; })) return false;
  auto r = std::from_chars(b, e, step);
  return r.ec == std::errc() && r.ptr == e;
}
}  // namespace

// --- public API ----------------------------------------------------------------------------------
void save_checkpoint(const std::string& path, const TrainSession& s, const Optimizer* opt, int64_t step) {
  GRAFT_CHECK(step >= 0, ErrorKind::InvalidArgument, "save_checkpoint: negative step");
  GRAFT_CHECK(!s.in_run(), ErrorKind::InvalidArgument,
              "save_checkpoint: the session is inside a run (forward without backward); finish or cancel() it first");
  std::vector<const Tensor*> blobs;
  int64_t cursor = 0;
  json params = json::array();
  for (const Parameter& p : s.parameters()) {
    json pj = {{"name", p.name}, {"dtype", dtype_name(p.data.dtype())}, {"shape", p.data.shape()}, {"trainable", p.trainable}};
    pj["data"] = blob_json(cursor, static_cast<int64_t>(p.data.nbytes()));
    blobs.push_back(&p.data);
    if (p.grad.defined()) {
      GRAFT_CHECK(p.grad.shape() == p.data.shape() && p.grad.dtype() == p.data.dtype(), ErrorKind::Internal,
                  "save_checkpoint: gradient of '" + p.name + "' does not match its parameter");
      pj["grad"] = blob_json(cursor, static_cast<int64_t>(p.grad.nbytes()));
      blobs.push_back(&p.grad);
    } else {
      pj["grad"] = nullptr;
    }
    params.push_back(std::move(pj));
  }
  json oj = nullptr;
  if (opt) {
    const auto& ps = opt->params();
    json state = json::array();
    auto slot = [&](json& slots, const char* name, const Tensor& t, const Parameter& p) {
      GRAFT_CHECK(t.shape() == p.data.shape() && t.dtype() == p.data.dtype(), ErrorKind::Internal,
                  std::string("save_checkpoint: optimizer ") + name + " of '" + p.name + "' does not match its parameter");
      slots.push_back({{"name", name}, {"offset", cursor}, {"bytes", static_cast<int64_t>(t.nbytes())}});
      cursor += static_cast<int64_t>(t.nbytes());
      blobs.push_back(&t);
    };
    if (auto* sgd = dynamic_cast<const SGD*>(opt)) {
      const SGDOptions& o = sgd->options;
      oj = {{"kind", "sgd"},
            {"hyperparameters",
             {{"lr", o.lr}, {"momentum", o.momentum}, {"dampening", o.dampening}, {"weight_decay", o.weight_decay}, {"nesterov", o.nesterov}}}};
      for (size_t i = 0; i < ps.size(); ++i) {
        json slots = json::array();
        if (sgd->momentum_buffer()[i].defined()) slot(slots, "momentum_buffer", sgd->momentum_buffer()[i], *ps[i]);
        state.push_back({{"param", ps[i]->name}, {"step", 0}, {"slots", std::move(slots)}});
      }
    } else if (auto* adam = dynamic_cast<const AdamW*>(opt)) {
      const AdamWOptions& o = adam->options;
      oj = {{"kind", "adamw"},
            {"hyperparameters",
             {{"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}}}};
      for (size_t i = 0; i < ps.size(); ++i) {
        json slots = json::array();
        const int64_t st = adam->param_steps()[i];
        if (st > 0) {
          GRAFT_CHECK(adam->exp_avg()[i].defined() && adam->exp_avg_sq()[i].defined(), ErrorKind::Internal,
                      "save_checkpoint: AdamW state of '" + ps[i]->name + "' is missing");
          slot(slots, "exp_avg", adam->exp_avg()[i], *ps[i]);
          slot(slots, "exp_avg_sq", adam->exp_avg_sq()[i], *ps[i]);
        }
        state.push_back({{"param", ps[i]->name}, {"step", st}, {"slots", std::move(slots)}});
      }
    } else {
      fail(ErrorKind::InvalidArgument, "save_checkpoint: unsupported optimizer type");
    }
    oj["steps"] = opt->steps();
    oj["state"] = std::move(state);
  }
  json header = {{"format", "graft-checkpoint"},
                 {"version", kCheckpointVersion},
                 {"step", step},
                 {"rng", {{"dropout_counter", dropout_rng_state()}}},
                 {"parameters", std::move(params)},
                 {"optimizer", std::move(oj)}};
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // e.g. a parameter name that is not valid UTF-8
    fail(ErrorKind::InvalidArgument, "checkpoint '" + path + "': cannot encode the header: " + e.what());
  }
  unsigned char pre[kPreamble];
  std::memcpy(pre, kMagic, 8);
  const uint32_t version = kCheckpointVersion, flags = 0;
  const uint64_t hb = text.size(), db = static_cast<uint64_t>(cursor);
  std::memcpy(pre + 8, &version, 4);
  std::memcpy(pre + 12, &flags, 4);
  std::memcpy(pre + 16, &hb, 8);
  std::memcpy(pre + 24, &db, 8);

  write_atomically(path, [&](int fd) {
    uint32_t crc = crc32(pre, kPreamble);
    write_exact(fd, pre, kPreamble, path);
    crc = crc32(text.data(), text.size(), crc);
    write_exact(fd, text.data(), text.size(), path);
    for (const Tensor* t : blobs) {
      crc = crc32(t->raw(), t->nbytes(), crc);
      write_exact(fd, t->raw(), t->nbytes(), path);
    }
    unsigned char tr[kTrailer];
    std::memcpy(tr, &crc, 4);
    std::memcpy(tr + 4, kEndMagic, 4);
    write_exact(fd, tr, kTrailer, path);
  });
}

CheckpointInfo verify_checkpoint(const std::string& path) {
  Header h = read_and_verify(path);
  CheckpointInfo info;
  info.path = path;
  info.step = h.step;
  info.optimizer = h.has_opt ? h.kind : "";
  for (const ParamEntry& p : h.params) info.parameters.push_back(p.name);
  info.bytes = h.file_size;
  return info;
}

int64_t load_checkpoint(const std::string& path, TrainSession& s, Optimizer* opt) {
  return load_verified(read_and_verify(path), s, opt);
}

std::string checkpoint_file_name(int64_t step) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "ckpt-%08lld.graft", static_cast<long long>(step));
  return buf;
}

std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  fs::directory_iterator it(dir, ec), end;
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot list: " + ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot list: " + ec.message());
    int64_t step;
    if (!parse_step(it->path().filename().string(), step)) continue;
    std::error_code sec;  // stat, never open: a FIFO or device named like a checkpoint is no checkpoint
    if (!it->is_regular_file(sec)) continue;
    out.push_back({step, it->path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second > b.second; });
  return out;
}

std::string save_checkpoint_in_dir(const std::string& dir, const TrainSession& s, const Optimizer* opt, int64_t step,
                                   int keep) {
  GRAFT_CHECK(keep >= 2, ErrorKind::InvalidArgument, "checkpoints to keep must be >= 2 (the previous good one stays)");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot create: " + ec.message());
  const std::string name = checkpoint_file_name(step);
  const std::string path = (fs::path(dir) / name).string();
  save_checkpoint(path, s, opt, step);
  const std::string latest = (fs::path(dir) / "latest").string();
  write_atomically(latest, [&](int fd) {
    std::string line = name + "\n";
    write_exact(fd, line.data(), line.size(), latest);
  });
  // The new file is durable; drop older ones beyond the newest `keep`.
  int kept = 1;
  for (const auto& [st, p] : list_checkpoints(dir)) {
    if (st >= step) continue;
    if (kept < keep) {
      ++kept;
      continue;
    }
    fs::remove(p, ec);  // best effort: a leftover old checkpoint is harmless
  }
  return path;
}

ResumeResult resume_from_dir(const std::string& dir, TrainSession& s, Optimizer* opt) {
  ResumeResult r;
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    // Temporaries of an interrupted save (".NAME.tmp-PID") are never complete checkpoints.
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (n.starts_with(".") && n.find(".tmp-") != std::string::npos) {
        std::error_code ec2;
        fs::remove(it->path(), ec2);
      }
    }
  }
  if (fs::is_directory(dir, ec)) {
    // Entries named like checkpoints that are not regular files (a FIFO, a folder, a device, a
    // dangling link) are reported and left alone; list_checkpoints never lists them, so nothing
    // opens them and resume cannot block on them.
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      int64_t st;
      if (!parse_step(it->path().filename().string(), st)) continue;
      struct stat sb {};
      const bool exists = ::stat(it->path().c_str(), &sb) == 0;
      if (exists && S_ISREG(sb.st_mode)) continue;
      r.skipped.push_back("checkpoint '" + it->path().string() + "' is not a regular file (" +
                          (exists ? file_kind(sb.st_mode) : "a dangling link") + "); ignored");
    }
  }
  auto files = list_checkpoints(dir);
  std::vector<std::string> refused;
  for (const auto& [st, path] : files) {
    Header h;
    try {
      h = read_and_verify(path);
      if (h.step != st)
        corrupt(path, "its name says step " + std::to_string(st) + ", its header step " + std::to_string(h.step));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::InvalidModel) throw;
      r.skipped.push_back(e.what());
      refused.push_back(path);
      continue;
    }
    r.step = load_verified(h, s, opt);  // a checkpoint of another run stops here with its error
    r.found = true;
    r.path = path;
    // Training continues from here and rewrites the newer steps; keep the refused files aside for
    // inspection, out of the way of later resumes.
    for (const std::string& p : refused) fs::rename(p, p + ".corrupt", ec);
    return r;
  }
  if (!files.empty()) {
    std::string all;
    for (const std::string& m : r.skipped) all += (all.empty() ? " " : "; ") + m;
    fail(ErrorKind::InvalidModel, "no checkpoint in '" + dir + "' verifies (" + std::to_string(files.size()) +
                                      " refused):" + all);
  }
  return r;
}

// --- the folder lock -------------------------------------------------------------------------
CheckpointDirLock::CheckpointDirLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot create: " + ec.message());
  path_ = (fs::path(dir) / ".lock").string();
  for (int attempt = 0;; ++attempt) {
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
    if (fd < 0) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot open its lock file '" + path_ + "': " + errno_str());
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail(ErrorKind::Io, "checkpoint folder '" + dir + "': its lock file '" + path_ + "' is not a regular file");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[32] = {};
      ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
      ::close(fd);
      if (err != EWOULDBLOCK && err != EINTR)
        fail(ErrorKind::Io, "checkpoint folder '" + dir + "': cannot lock '" + path_ + "': " + std::strerror(err));
      long long pid = n > 0 ? std::atoll(buf) : 0;
      fail(ErrorKind::InvalidArgument,
           "checkpoint folder '" + dir + "' is in use by another graft run (" +
               (pid > 0 ? "pid " + std::to_string(pid) : std::string("pid unknown")) + ", holding '" + path_ +
               "'); wait for it to finish or use another folder");
    }
    // The holder before us may have removed the file after we opened it (it unlinks on exit); a
    // lock on a removed file guards nothing, so make sure the name still refers to our file.
    struct stat now {};
    if (::stat(path_.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      fd_ = fd;
      break;
    }
    ::close(fd);
    if (attempt > 100) fail(ErrorKind::Io, "checkpoint folder '" + dir + "': its lock file keeps being replaced");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // The lock holds regardless; only the pid shown to a refused run is missing.
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // still locked: a waiter that opened it re-checks the name and retries
  ::close(fd_);
}

}  // namespace graft
