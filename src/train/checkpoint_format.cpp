// The checkpoint format: a preamble, a JSON header, raw tensor bytes and a CRC-32 trailer
// (docs/checkpoints.md); saving one file, verifying one, loading one.
//
// Reading is two passes: read_and_verify streams the whole file through the CRC and validates the
// header without allocating tensors; load_verified then matches the header against the session,
// allocates staging tensors (sizes already validated), reads the data again (checking the CRC
// again, in case the file changed in between) and only then commits, so a failure at any point
// leaves the session and the optimizer as they were.
//
// Note [checkpoints of a state file]
// An optimizer whose state is in a file (Note [optimizer state on disk]) trains models whose
// moments do not fit in RAM, so neither saving nor loading may gather them there: a checkpoint
// copies the state one parameter at a time (RAM: the largest parameter's state), from the state
// file into the checkpoint (write_atomically: the last checkpoint stays whole until the new one
// is complete) and back. Loading such a checkpoint cannot stage a copy of the weights either, so
// it reads in place: pass 1 has checked the CRC of the whole file, check_fits and the optimizer
// the header; pass 2 reads into the parameters and the state file, checking the CRC again. Only a
// file that changes (or a disk that fails) between the passes can then stop it half-way, and the
// error says that the session and the optimizer are partly loaded: load a checkpoint again.
//
// Optimizers are written and read through their OptimizerState and OptimizerKind (graft/train.h):
// this file knows no optimizer class.
#include "checkpoint_format.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "durable_io.h"
#include "graft/ops.h"

static_assert(std::endian::native == std::endian::little, "graft checkpoints are little-endian");

namespace graft {
namespace ckpt {
using json = nlohmann::json;
using durable::Fd;
using durable::io_error;
using durable::read_exact;
using durable::write_exact;

namespace {
// --- layout --------------------------------------------------------------------------------------
constexpr char kMagic[8] = {'G', 'R', 'A', 'F', 'T', 'C', 'K', 'P'};
constexpr char kEndMagic[4] = {'G', 'E', 'N', 'D'};
constexpr size_t kPreamble = 32;  // magic, u32 version, u32 flags, u64 header bytes, u64 data bytes
constexpr size_t kTrailer = 8;    // u32 CRC-32 of everything before it, "GEND"

// --- the header schema ---------------------------------------------------------------------------
const json& req(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  if (!j.is_object() || !j.contains(key)) corrupt(path, ctx + ": missing '" + key + "'");
  return j.at(key);
}
int64_t req_int(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)))
    corrupt(path, ctx + ": '" + key + "' is not an integer");
  return v.get<int64_t>();
}
double req_num(const json& j, const char* key, const std::string& ctx, const std::string& path) {
  const json& v = req(j, key, ctx, path);
  if (!v.is_number()) corrupt(path, ctx + ": '" + key + "' is not a number");
  return v.get<double>();
}
std::string req_str(const json& j, const char* key, const std::string& ctx,
                    const std::string& path) {
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
Blob parse_blob(const json& j, int64_t want_bytes, int64_t& cursor, const std::string& ctx,
                const std::string& path) {
  Blob b;
  b.offset = req_int(j, "offset", ctx, path);
  b.bytes = req_int(j, "bytes", ctx, path);
  if (b.bytes != want_bytes)
    corrupt(path, ctx + ": holds " + std::to_string(b.bytes) + " bytes, its dtype and shape need " +
                      std::to_string(want_bytes));
  if (b.offset != cursor)
    corrupt(path, ctx + ": starts at data offset " + std::to_string(b.offset) + ", expected " +
                      std::to_string(cursor));
  cursor += b.bytes;
  return b;
}

json blob_json(int64_t& cursor, int64_t bytes) {
  json j = {{"offset", cursor}, {"bytes", bytes}};
  cursor += bytes;
  return j;
}

// The optimizer section: kind, steps, hyperparameters (as the kind lists them) and per-parameter
// state entries, whose slots continue the data section at `cursor`.
void parse_optimizer(const json& oj, const std::map<std::string, size_t>& index, int64_t& cursor,
                     Header& h) {
  const std::string& path = h.path;
  h.has_opt = true;
  h.kind = req_str(oj, "kind", "optimizer", path);
  h.opt_steps = req_int(oj, "steps", "optimizer", path);
  if (h.opt_steps < 0) corrupt(path, "optimizer: negative step count");
  const json& hp = req(oj, "hyperparameters", "optimizer", path);
  const OptimizerKind* kind = find_optimizer_kind(h.kind);
  if (!kind) corrupt(path, "optimizer: unknown kind '" + h.kind + "'");
  for (const auto& [name, flag] : kind->hyper)
    h.hyper[name] = flag ? (req_bool(hp, name.c_str(), h.kind, path) ? 1.0 : 0.0)
                         : req_num(hp, name.c_str(), h.kind, path);
  if (!kind->hyper_valid(h.hyper)) corrupt(path, h.kind + ": hyperparameters out of range");
  const std::set<std::string> allowed(kind->tensors.begin(), kind->tensors.end());

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
    std::vector<std::string> names;
    for (const json& slj : slots) {
      SlotEntry s;
      s.name = req_str(slj, "name", ctx, path);
      if (!allowed.count(s.name))
        corrupt(path, ctx + ": unknown slot '" + s.name + "' for " + h.kind);
      s.blob = parse_blob(slj, bytes, cursor, ctx + " " + s.name, path);
      names.push_back(s.name);
      e.slots.push_back(std::move(s));
    }
    if (std::string why = kind->check_tensors(names, e.step); !why.empty())
      corrupt(path, ctx + ": " + why);
    h.state.push_back(std::move(e));
  }
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
    if (req_str(j, "format", "header", path) != "graft-checkpoint")
      corrupt(path, "header: format is not 'graft-checkpoint'");
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
        if (!d.is_number_integer() || d.get<int64_t>() < 0)
          corrupt(path, ctx + ": bad dimension in 'shape'");
        p.shape.push_back(d.get<int64_t>());
      }
      int64_t n;
      try {
        n = numel(p.shape);
      } catch (const Error&) {
        corrupt(path, ctx + ": shape " + shape_str(p.shape) + " is too large");
      }
      const int64_t es = static_cast<int64_t>(dtype_size(p.dtype));
      if (n > INT64_MAX / es)
        corrupt(path, ctx + ": shape " + shape_str(p.shape) + " is too large");
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
    if (!oj.is_null()) parse_optimizer(oj, index, cursor, h);
    if (static_cast<uint64_t>(cursor) != h.data_bytes)
      corrupt(path, "the header describes " + std::to_string(cursor) +
                        " data bytes, the file holds " + std::to_string(h.data_bytes));
  } catch (const json::exception& e) {
    corrupt(path, std::string("malformed header: ") + e.what());
  }
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
      fail(ErrorKind::ShapeMismatch, pre + "model: parameter '" + p.name + "' is " +
                                         dtype_name(e.dtype) + " " + shape_str(e.shape) +
                                         " in the checkpoint, " + dtype_name(p.data.dtype()) + " " +
                                         shape_str(p.data.shape()) + " in the model");
  }
  for (const ParamEntry& e : h.params)
    if (!have.count(e.name)) extra.push_back(e.name);
  if (!missing.empty())
    fail(ErrorKind::InvalidArgument, pre + "model: it lacks parameter(s) " + join_names(missing));
  if (!extra.empty())
    fail(ErrorKind::InvalidArgument,
         pre + "model: it holds parameter(s) the model lacks: " + join_names(extra));
  if (!opt) return;
  GRAFT_CHECK(find_optimizer_kind(opt->kind()), ErrorKind::InvalidArgument,
              "load_checkpoint: unsupported optimizer type");
  const std::string kind = opt->kind();
  if (!h.has_opt)
    fail(ErrorKind::InvalidArgument,
         pre + "optimizer: it holds no optimizer state, the run uses " + kind);
  if (h.kind != kind)
    fail(ErrorKind::InvalidArgument,
         pre + "optimizer: it holds " + h.kind + " state, the run uses " + kind);
  const auto& ps = opt->params();
  if (ps.size() != h.state.size())
    fail(ErrorKind::InvalidArgument,
         pre + "optimizer: it updates " + std::to_string(h.state.size()) +
             " parameters, the run's optimizer " + std::to_string(ps.size()));
  for (size_t i = 0; i < ps.size(); ++i)
    if (ps[i]->name != h.state[i].param)
      fail(ErrorKind::InvalidArgument, pre + "optimizer: its parameter " + std::to_string(i) +
                                           " is '" + h.state[i].param +
                                           "', the run's optimizer has '" + ps[i]->name + "'");
}

struct Staged {
  std::vector<Tensor> data, grad;          // per header parameter (grad undefined if none)
  std::vector<std::vector<Tensor>> slots;  // per state entry, per slot
};

// Pass 2's start: opens the verified file again, checks that its size is still the header's, and
// reads past the preamble and header; returns their CRC, which the data then continues.
uint32_t reopen_at_data(const Header& h, Fd& f) {
  durable::open_regular(f, h.path);
  if (durable::file_size(f, h.path) != h.file_size)
    io_error(h.path, "the file changed between verifying and loading it; nothing was loaded");
  std::string prefix(kPreamble + h.header_bytes, '\0');
  read_exact(f.fd, prefix.data(), prefix.size(), h.path);
  return crc32(prefix.data(), prefix.size());
}

// Pass 2: reads every tensor into freshly allocated staging tensors, checking the CRC again.
Staged stage(const Header& h, TrainSession& s, Optimizer* opt) {
  const std::string& path = h.path;
  Allocator& sa = s.allocator();
  Fd f;
  uint32_t crc = reopen_at_data(h, f);
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
      Tensor t = Tensor::empty(p.shape, p.dtype, opt ? opt->allocator() : sa,
                               Category::OptimizerState, p.name + "." + sl.name);
      read_into(t);
      ts.push_back(t);
    }
    out.slots.push_back(std::move(ts));
  }
  unsigned char tr[kTrailer];
  read_exact(f.fd, tr, kTrailer, path);
  uint32_t stored;
  std::memcpy(&stored, tr, 4);
  if (stored != h.crc || crc != h.crc)
    io_error(path, "the file changed while being loaded (checksum differs from the first read)");
  return out;
}

void commit(const Header& h, Staged& st, TrainSession& s, Optimizer* opt) {
  OptimizerState os;
  if (opt) {
    os.hyper = h.hyper;
    os.steps = h.opt_steps;
    for (size_t i = 0; i < h.state.size(); ++i) {
      std::map<std::string, Tensor>& m = os.tensors.emplace_back();
      for (size_t k = 0; k < h.state[i].slots.size(); ++k)
        m[h.state[i].slots[k].name] = st.slots[i][k];
      os.counters.push_back(h.state[i].step);
    }
    opt->check_state(os);  // before anything changes: load_state below cannot fail
  }
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < h.params.size(); ++i) index[h.params[i].name] = i;
  for (Parameter& p : s.parameters()) {
    size_t i = index.at(p.name);
    if (p.data.nbytes()) std::memcpy(p.data.raw(), st.data[i].raw(), p.data.nbytes());
    const Tensor& g = st.grad[i];
    if (!g.defined())
      p.grad = Tensor();
    else if (p.grad.defined() && p.grad.dtype() == g.dtype() && p.grad.shape() == g.shape()) {
      if (g.nbytes()) std::memcpy(p.grad.raw(), g.raw(), g.nbytes());
    } else {
      p.grad = g;
    }
  }
  if (opt) opt->load_state(os);
  s.set_rng_state(h.rng);
}
}  // namespace

void corrupt(const std::string& path, const std::string& what) {
  fail(ErrorKind::InvalidModel, "checkpoint '" + path + "' is corrupt: " + what);
}

Header read_and_verify(const std::string& path) {
  Header h;
  h.path = path;
  Fd f;
  durable::open_regular(f, path);
  h.file_size = durable::file_size(f, path);
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
    corrupt(path, "format version " + std::to_string(version) +
                      " is not supported (this graft reads version " +
                      std::to_string(kCheckpointVersion) + ")");
  if (flags != 0) corrupt(path, "unknown flags " + std::to_string(flags));
  const uint64_t room = static_cast<uint64_t>(h.file_size) - kPreamble - kTrailer;
  if (h.header_bytes > room || h.data_bytes > room - h.header_bytes ||
      h.header_bytes + h.data_bytes != room) {
    // A partial write shows up here: the preamble promises more than the file holds.
    const bool fits = h.header_bytes <= room && h.data_bytes <= room - h.header_bytes;
    const unsigned __int128 want =
        static_cast<unsigned __int128>(kPreamble) + kTrailer + h.header_bytes + h.data_bytes;
    std::string want_s = want > static_cast<unsigned __int128>(UINT64_MAX)
                             ? "more than 2^64"
                             : std::to_string(static_cast<uint64_t>(want));
    corrupt(path, std::string(fits ? "trailing garbage" : "truncated") + ": the file has " +
                      std::to_string(h.file_size) + " bytes, its preamble describes " + want_s);
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
    std::snprintf(msg, sizeof msg, "checksum mismatch (CRC-32 stored %08x, computed %08x)", h.crc,
                  crc);
    corrupt(path, msg);
  }
  parse_header(header, h);
  return h;
}

namespace {
// The optimizer state the header describes, its tensors left in the file (tensors_in_file): what
// load_in_place checks before reading anything and loads after.
OptimizerState state_in_file(const Header& h) {
  OptimizerState os;
  os.hyper = h.hyper;
  os.steps = h.opt_steps;
  os.tensors_in_file = true;
  os.tensors.resize(h.state.size());
  for (const StateEntry& e : h.state) os.counters.push_back(e.step);
  return os;
}

// Pass 2 of Note [checkpoints of a state file]: straight into the parameters and the state file;
// `os` is state_in_file(h), which the caller loads after.
void load_in_place(const Header& h, const OptimizerState& os, TrainSession& s, Optimizer& opt) {
  const std::string& path = h.path;
  const OptimizerKind& kind = *find_optimizer_kind(opt.kind());
  for (size_t i = 0; i < h.state.size(); ++i) {  // all of the kind's tensors, or none
    const auto& sl = h.state[i].slots;
    GRAFT_CHECK(sl.empty() || sl.size() == kind.tensors.size(), ErrorKind::InvalidArgument,
                "checkpoint '" + path + "': the optimizer state of '" + h.state[i].param +
                    "' does not hold all of " + kind.name + "'s tensors");
    for (size_t k = 0; k < sl.size(); ++k)
      GRAFT_CHECK(sl[k].name == kind.tensors[k], ErrorKind::InvalidArgument,
                  "checkpoint '" + path + "': unexpected optimizer tensor '" + sl[k].name + "'");
  }
  opt.check_state(os);  // before anything changes
  std::map<std::string, Parameter*> by_name;
  for (Parameter& p : s.parameters()) by_name[p.name] = &p;

  Fd f;
  uint32_t crc = reopen_at_data(h, f);
  const std::string partly =
      "; the session's parameters and the optimizer's state are now partly loaded: load a "
      "checkpoint again before training";
  auto read_into = [&](void* dst, int64_t n) {
    try {
      read_exact(f.fd, dst, static_cast<size_t>(n), path);
    } catch (const Error& e) {
      fail(e.kind(), e.message() + partly);
    }
    crc = crc32(dst, static_cast<size_t>(n), crc);
  };
  for (const ParamEntry& e : h.params) {
    Parameter& p = *by_name.at(e.name);  // check_fits: same names, dtypes, shapes
    read_into(p.data.raw(), e.data.bytes);
    if (!e.has_grad) {
      p.grad = Tensor();
    } else {
      if (!p.grad.defined() || p.grad.dtype() != e.dtype || p.grad.shape() != e.shape)
        p.grad =
            Tensor::empty(e.shape, e.dtype, s.allocator(), Category::Gradient, e.name + ".grad");
      read_into(p.grad.raw(), e.grad.bytes);
    }
  }
  for (size_t i = 0; i < h.state.size(); ++i) {
    int64_t n = 0;
    for (const SlotEntry& sl : h.state[i].slots) n += sl.blob.bytes;
    if (n == 0) continue;
    Tensor buf = Tensor::empty({(n + 3) / 4}, DType::F32, opt.allocator(), Category::Workspace,
                               h.state[i].param + " (checkpoint's optimizer state)");
    read_into(buf.raw(), n);
    try {
      opt.write_file_state(i, buf.raw());
    } catch (const Error& e) {
      fail(e.kind(), e.message() + partly);
    }
  }
  unsigned char tr[kTrailer];
  try {
    read_exact(f.fd, tr, kTrailer, path);
  } catch (const Error& e) {
    fail(e.kind(), e.message() + partly);
  }
  uint32_t stored;
  std::memcpy(&stored, tr, 4);
  if (stored != h.crc || crc != h.crc)
    io_error(path,
             "the file changed while being loaded (checksum differs from the first read)" + partly);
}
}  // namespace

int64_t load_verified(const Header& h, TrainSession& s, Optimizer* opt) {
  GRAFT_CHECK(
      !s.in_run(), ErrorKind::InvalidArgument,
      "load_checkpoint: the session is inside a run (forward without backward); cancel() it first");
  check_fits(h, s, opt);
  if (opt && opt->state_in_file()) {
    const OptimizerState os = state_in_file(h);
    load_in_place(h, os, s, *opt);
    opt->load_state(os);
    s.set_rng_state(h.rng);
    return h.step;
  }
  Staged st = stage(h, s, opt);
  commit(h, st, s, opt);
  return h.step;
}

}  // namespace ckpt

// --- public API: one file ------------------------------------------------------------------------
void save_checkpoint(const std::string& path, const TrainSession& s, const Optimizer* opt,
                     int64_t step) {
  using namespace ckpt;
  GRAFT_CHECK(step >= 0, ErrorKind::InvalidArgument, "save_checkpoint: negative step");
  GRAFT_CHECK(!s.in_run(), ErrorKind::InvalidArgument,
              "save_checkpoint: the session is inside a run (forward without backward); finish or "
              "cancel() it first");
  // What the data section holds, in order: a tensor, or (file_param >= 0) that parameter's state
  // read from the optimizer's state file as it is written (Note [checkpoints of a state file]).
  struct Blob {
    const Tensor* t = nullptr;
    int64_t file_param = -1, bytes = 0;
  };
  std::vector<Blob> blobs;
  int64_t cursor = 0, largest_file_blob = 0;
  json params = json::array();
  for (const Parameter& p : s.parameters()) {
    json pj = {{"name", p.name},
               {"dtype", dtype_name(p.data.dtype())},
               {"shape", p.data.shape()},
               {"trainable", p.trainable}};
    pj["data"] = blob_json(cursor, static_cast<int64_t>(p.data.nbytes()));
    blobs.push_back({&p.data});
    if (p.grad.defined()) {
      GRAFT_CHECK(p.grad.shape() == p.data.shape() && p.grad.dtype() == p.data.dtype(),
                  ErrorKind::Internal,
                  "save_checkpoint: gradient of '" + p.name + "' does not match its parameter");
      pj["grad"] = blob_json(cursor, static_cast<int64_t>(p.grad.nbytes()));
      blobs.push_back({&p.grad});
    } else {
      pj["grad"] = nullptr;
    }
    params.push_back(std::move(pj));
  }
  json oj = nullptr;
  OptimizerState os;  // holds the state tensors `blobs` points into until the file is written
  if (opt) {
    const OptimizerKind* kind = find_optimizer_kind(opt->kind());
    if (!kind) fail(ErrorKind::InvalidArgument, "save_checkpoint: unsupported optimizer type");
    os = opt->state_in_ram();  // a state file's tensors are streamed below
    const auto& ps = opt->params();
    GRAFT_CHECK(os.tensors.size() == ps.size() && os.counters.size() == ps.size(),
                ErrorKind::Internal,
                "save_checkpoint: the optimizer's state does not cover its " +
                    std::to_string(ps.size()) + " parameters");
    json hyper = json::object();
    for (const auto& [name, flag] : kind->hyper) {
      auto it = os.hyper.find(name);
      GRAFT_CHECK(it != os.hyper.end(), ErrorKind::Internal,
                  "save_checkpoint: " + kind->name + " hyperparameter '" + name + "' is missing");
      if (flag)
        hyper[name] = it->second != 0;
      else
        hyper[name] = it->second;
    }
    oj = {{"kind", kind->name}, {"hyperparameters", std::move(hyper)}};
    json state = json::array();
    for (size_t i = 0; i < ps.size(); ++i) {
      const Parameter& p = *ps[i];
      json slots = json::array();
      std::vector<std::string> names;
      if (os.tensors_in_file && os.tensors[i].empty() && os.counters[i] > 0) {
        const int64_t b = static_cast<int64_t>(p.data.nbytes());
        blobs.push_back(
            {nullptr, static_cast<int64_t>(i), b * static_cast<int64_t>(kind->tensors.size())});
        largest_file_blob = std::max(largest_file_blob, blobs.back().bytes);
        for (const std::string& name : kind->tensors) {
          slots.push_back({{"name", name}, {"offset", cursor}, {"bytes", b}});
          cursor += b;
          names.push_back(name);
        }
      }
      for (const std::string& name : kind->tensors) {  // the kind's order, the file's order
        auto it = os.tensors[i].find(name);
        if (it == os.tensors[i].end() || !it->second.defined()) continue;
        const Tensor& t = it->second;
        GRAFT_CHECK(t.shape() == p.data.shape() && t.dtype() == p.data.dtype(), ErrorKind::Internal,
                    "save_checkpoint: optimizer " + name + " of '" + p.name +
                        "' does not match its parameter");
        slots.push_back(
            {{"name", name}, {"offset", cursor}, {"bytes", static_cast<int64_t>(t.nbytes())}});
        cursor += static_cast<int64_t>(t.nbytes());
        blobs.push_back({&t});
        names.push_back(name);
      }
      const std::string why = kind->check_tensors(names, os.counters[i]);
      GRAFT_CHECK(why.empty(), ErrorKind::Internal,
                  "save_checkpoint: optimizer state of '" + p.name + "': " + why);
      state.push_back({{"param", p.name}, {"step", os.counters[i]}, {"slots", std::move(slots)}});
    }
    oj["steps"] = os.steps;
    oj["state"] = std::move(state);
  }
  json header = {{"format", "graft-checkpoint"},
                 {"version", kCheckpointVersion},
                 {"step", step},
                 {"rng", {{"dropout_counter", s.rng_state()}}},
                 {"parameters", std::move(params)},
                 {"optimizer", std::move(oj)}};
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {  // e.g. a parameter name that is not valid UTF-8
    fail(ErrorKind::InvalidArgument,
         "checkpoint '" + path + "': cannot encode the header: " + e.what());
  }
  unsigned char pre[kPreamble];
  std::memcpy(pre, kMagic, 8);
  const uint32_t version = kCheckpointVersion, flags = 0;
  const uint64_t hb = text.size(), db = static_cast<uint64_t>(cursor);
  std::memcpy(pre + 8, &version, 4);
  std::memcpy(pre + 12, &flags, 4);
  std::memcpy(pre + 16, &hb, 8);
  std::memcpy(pre + 24, &db, 8);

  durable::write_atomically(path, [&](int fd) {
    uint32_t crc = crc32(pre, kPreamble);
    write_exact(fd, pre, kPreamble, path);
    crc = crc32(text.data(), text.size(), crc);
    write_exact(fd, text.data(), text.size(), path);
    Tensor staged;  // one parameter's state from the state file
    if (largest_file_blob > 0)
      staged = Tensor::empty({(largest_file_blob + 3) / 4}, DType::F32, opt->allocator(),
                             Category::Workspace, "checkpoint: one parameter's optimizer state");
    for (const Blob& b : blobs) {
      const void* bytes = b.t ? b.t->raw() : staged.raw();
      const size_t n = b.t ? b.t->nbytes() : static_cast<size_t>(b.bytes);
      if (!b.t) opt->read_file_state(static_cast<size_t>(b.file_param), staged.raw());
      crc = crc32(bytes, n, crc);
      write_exact(fd, bytes, n, path);
    }
    unsigned char tr[kTrailer];
    std::memcpy(tr, &crc, 4);
    std::memcpy(tr + 4, kEndMagic, 4);
    write_exact(fd, tr, kTrailer, path);
  });
}

CheckpointInfo verify_checkpoint(const std::string& path) {
  ckpt::Header h = ckpt::read_and_verify(path);
  CheckpointInfo info;
  info.path = path;
  info.step = h.step;
  info.optimizer = h.has_opt ? h.kind : "";
  for (const ckpt::ParamEntry& p : h.params) info.parameters.push_back(p.name);
  info.bytes = h.file_size;
  return info;
}

int64_t load_checkpoint(const std::string& path, TrainSession& s, Optimizer* opt) {
  return ckpt::load_verified(ckpt::read_and_verify(path), s, opt);
}

}  // namespace graft
