// ONNX import: ModelProto -> Graph, using Debian's libonnx protobuf classes.
//
// Everything read from the file is untrusted: sizes are validated before anything is allocated
// from them, names are checked for duplicates, and the node list is re-sorted topologically (a
// cycle or a read of an undefined value is an error naming the node).
#include <fcntl.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <onnx/onnx_pb.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "graft/ir.h"

namespace graft {
namespace {

namespace fs = std::filesystem;

DType convert_dtype(int t, const std::string& what) {
  DType dt;
  if (dtype_of_onnx_elem(t, dt)) return dt;
  std::string n = onnx::TensorProto_DataType_IsValid(t)
                      ? onnx::TensorProto_DataType_Name(static_cast<onnx::TensorProto_DataType>(t))
                      : "code " + std::to_string(t);
  fail(ErrorKind::Unsupported, what + " has element type " + n +
                                   "; graft supports float32, float64, int64, int32 and bool");
}

// A non-negative decimal integer, the whole string (the file says it: no exceptions, no overflow).
int64_t parse_count(const std::string& text, const std::string& key, const std::string& what) {
  int64_t v = -1;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  GRAFT_CHECK(ec == std::errc() && end == text.data() + text.size() && !text.empty() && v >= 0,
              ErrorKind::InvalidModel,
              what + ": external data " + key + " '" + text + "' is not a byte count");
  return v;
}

// Where a tensor's external data lies: the file (checked to be inside the model's folder) and the
// byte range, validated against the file's size and the shape before anything is allocated.
struct ExternalRange {
  fs::path file;
  std::string location;
  int64_t offset = 0;
};

ExternalRange locate_external(const onnx::TensorProto& tp, const std::string& model_dir,
                              size_t want, const std::string& what) {
  ExternalRange r;
  int64_t length = -1;
  for (const auto& kv : tp.external_data()) {
    if (kv.key() == "location")
      r.location = kv.value();
    else if (kv.key() == "offset")
      r.offset = parse_count(kv.value(), "offset", what);
    else if (kv.key() == "length")
      length = parse_count(kv.value(), "length", what);
  }
  const std::string& location = r.location;
  GRAFT_CHECK(!location.empty(), ErrorKind::InvalidModel,
              what + ": external data without a location");
  fs::path rel(location);
  GRAFT_CHECK(!rel.is_absolute(), ErrorKind::InvalidModel,
              what + ": external data location '" + location + "' is an absolute path; refused");
  for (const auto& part : rel)
    GRAFT_CHECK(part != "..", ErrorKind::InvalidModel,
                what + ": external data location '" + location +
                    "' points outside the model's folder; refused");
  GRAFT_CHECK(!model_dir.empty(), ErrorKind::InvalidModel,
              what + ": external data needs the model to be loaded from a file");
  r.file = fs::path(model_dir) / rel;
  std::error_code ec;
  fs::path canon = fs::weakly_canonical(r.file, ec);
  fs::path base = fs::weakly_canonical(fs::path(model_dir), ec);
  auto [a, b] = std::mismatch(base.begin(), base.end(), canon.begin(), canon.end());
  GRAFT_CHECK(
      a == base.end(), ErrorKind::InvalidModel,
      what + ": external data location '" + location + "' resolves outside the model's folder");
  struct stat st {};
  GRAFT_CHECK(::stat(r.file.c_str(), &st) == 0 && S_ISREG(st.st_mode), ErrorKind::Io,
              what + ": cannot open external data file " + r.file.string());
  const int64_t size = st.st_size;
  GRAFT_CHECK(r.offset <= size, ErrorKind::InvalidModel,
              what + ": external data offset " + std::to_string(r.offset) + " is past the end of " +
                  location);
  if (length < 0) length = size - r.offset;
  GRAFT_CHECK(length <= size - r.offset && static_cast<size_t>(length) == want,
              ErrorKind::InvalidModel,
              what + ": external data in " + location + " has " + std::to_string(length) +
                  " bytes at offset " + std::to_string(r.offset) + " but the shape needs " +
                  std::to_string(want));
  return r;
}

// Reads the range straight into the tensor's memory: a model over 2 GB (weights in external data)
// is loaded with one copy of each weight in RAM, not two.
void read_external(const ExternalRange& r, void* dst, size_t want, const std::string& what) {
  int fd = ::open(r.file.c_str(), O_RDONLY | O_CLOEXEC);
  GRAFT_CHECK(
      fd >= 0, ErrorKind::Io,
      what + ": cannot open external data file " + r.file.string() + ": " + std::strerror(errno));
  char* p = static_cast<char*>(dst);
  size_t done = 0;
  while (done < want) {
    const size_t chunk = std::min<size_t>(want - done, size_t(1) << 30);
    ssize_t got = ::pread(fd, p + done, chunk, static_cast<off_t>(r.offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      fail(ErrorKind::Io,
           what + ": reading " + std::to_string(want) + " bytes of external data at offset " +
               std::to_string(r.offset) + " of " + r.file.string() +
               " failed: " + (got < 0 ? std::strerror(err) : "the file ended early"));
    }
    done += static_cast<size_t>(got);
  }
  ::close(fd);
}

Tensor convert_tensor(const onnx::TensorProto& tp, Allocator& alloc, Category cat,
                      const std::string& model_dir, const std::string& what) {
  DType dt = convert_dtype(tp.data_type(), what);
  Shape shape(tp.dims().begin(), tp.dims().end());
  for (int64_t d : shape)
    GRAFT_CHECK(d >= 0, ErrorKind::InvalidModel,
                what + " has a negative dimension " + shape_str(shape));
  int64_t n = numel(shape);  // throws on overflow
  const size_t es = dtype_size(dt);
  GRAFT_CHECK(n <= (int64_t(1) << 40), ErrorKind::InvalidModel,
              what + " declares " + std::to_string(n) + " elements; refusing absurd sizes");
  size_t want = static_cast<size_t>(n) * es;

  // Validate the data length before allocating anything of the declared size.
  const std::string* raw = nullptr;
  const bool external = tp.data_location() == onnx::TensorProto::EXTERNAL;
  ExternalRange range;
  if (external) {
    range = locate_external(tp, model_dir, want, what);
  } else if (tp.has_raw_data()) {
    raw = &tp.raw_data();
    GRAFT_CHECK(raw->size() == want, ErrorKind::InvalidModel,
                what + " has " + std::to_string(raw->size()) + " bytes of data but its shape " +
                    shape_str(shape) + " needs " + std::to_string(want));
  } else {
    int64_t have = 0;
    switch (dt) {
      case DType::F32:
        have = tp.float_data_size();
        break;
      case DType::F64:
        have = tp.double_data_size();
        break;
      case DType::I64:
        have = tp.int64_data_size();
        break;
      case DType::Bool:
      case DType::I32:
        have = tp.int32_data_size();
        break;
      case DType::BF16:  // dtype_of_onnx_elem never maps a file's type to it
        fail(ErrorKind::Internal, what + ": bfloat16 data");
    }
    GRAFT_CHECK(have == n, ErrorKind::InvalidModel,
                what + " has " + std::to_string(have) + " elements of data but its shape " +
                    shape_str(shape) + " needs " + std::to_string(n));
  }
  Tensor t = Tensor::empty(shape, dt, alloc, cat, what);
  if (external) {
    if (want) read_external(range, t.raw(), want, what);
    if (dt == DType::Bool) {  // normalized in place: any nonzero byte is true
      auto* b = static_cast<unsigned char*>(t.raw());
      for (int64_t i = 0; i < n; ++i) b[i] = b[i] != 0;
    }
    return t;
  }
  if (raw) {
    if (dt == DType::Bool) {  // one byte each; any nonzero byte is true (a bool must hold 0 or 1)
      for (int64_t i = 0; i < n; ++i) t.data<bool>()[i] = (*raw)[static_cast<size_t>(i)] != 0;
    } else if (want) {
      std::memcpy(t.raw(), raw->data(), want);
    }
    return t;
  }
  switch (dt) {
    case DType::F32:
      std::copy(tp.float_data().begin(), tp.float_data().end(), t.data<float>());
      break;
    case DType::F64:
      std::copy(tp.double_data().begin(), tp.double_data().end(), t.data<double>());
      break;
    case DType::I64:
      std::copy(tp.int64_data().begin(), tp.int64_data().end(), t.data<int64_t>());
      break;
    case DType::Bool:
      for (int64_t i = 0; i < n; ++i) t.data<bool>()[i] = tp.int32_data(static_cast<int>(i)) != 0;
      break;
    case DType::I32:
      std::copy(tp.int32_data().begin(), tp.int32_data().end(), t.data<int32_t>());
      break;
    case DType::BF16:
      fail(ErrorKind::Internal, what + ": bfloat16 data");
  }
  return t;
}

Attr convert_attr(const onnx::AttributeProto& ap, Allocator& alloc, const std::string& model_dir,
                  const std::string& where) {
  Attr a;
  switch (ap.type()) {
    case onnx::AttributeProto::INT:
      a.kind = Attr::Int;
      a.i = ap.i();
      break;
    case onnx::AttributeProto::FLOAT:
      a.kind = Attr::Float;
      a.f = ap.f();
      break;
    case onnx::AttributeProto::STRING:
      a.kind = Attr::String;
      a.s = ap.s();
      break;
    case onnx::AttributeProto::INTS:
      a.kind = Attr::Ints;
      a.ints.assign(ap.ints().begin(), ap.ints().end());
      break;
    case onnx::AttributeProto::FLOATS:
      a.kind = Attr::Floats;
      a.floats.assign(ap.floats().begin(), ap.floats().end());
      break;
    case onnx::AttributeProto::TENSOR:
      a.kind = Attr::TensorV;
      a.t = convert_tensor(ap.t(), alloc, Category::Workspace, model_dir,
                           where + " attribute '" + ap.name() + "'");
      break;
    default:
      fail(ErrorKind::Unsupported, where + ": attribute '" + ap.name() + "' has type " +
                                       onnx::AttributeProto_AttributeType_Name(ap.type()) +
                                       ", which graft does not support");
  }
  return a;
}

// Note [Import memory]: the parsed protobuf holds every initializer's bytes; each one is released
// as soon as it is converted into graft's allocator, so importing needs the parameters once plus
// the largest tensor, not twice (the model file is parsed from the stream, not read into a string).
Graph convert_model(onnx::ModelProto& mp, const std::string& model_dir, Allocator& alloc,
                    std::vector<std::string>* unsupported) {
  Graph g;
  auto lenient = [&](const std::function<void()>& f) {
    return collect_unsupported(unsupported, f);
  };
  // Opset of the default domain.
  int64_t opset = -1;
  for (const auto& os : mp.opset_import())
    if (os.domain().empty() || os.domain() == "ai.onnx") opset = os.version();
  GRAFT_CHECK(opset >= 0, ErrorKind::InvalidModel,
              "the model imports no opset of the default ONNX domain");
  check_opset(opset);
  g.opset = opset;
  const auto& gp = mp.graph();
  g.name = gp.name();

  // Initializers: float -> parameter, others -> constant.
  for (auto& tp : *mp.mutable_graph()->mutable_initializer()) {
    GRAFT_CHECK(!tp.name().empty(), ErrorKind::InvalidModel, "an initializer has no name");
    std::string what = "initializer '" + tp.name() + "'";
    DType dt = DType::F32;
    if (!lenient([&] { dt = convert_dtype(tp.data_type(), what); })) {
      g.add_value(tp.name(), ValueKind::Constant, false);  // recorded: no data
      continue;
    }
    ValueKind kind = is_float(dt) ? ValueKind::Param : ValueKind::Constant;
    GRAFT_CHECK(g.find(tp.name()) < 0, ErrorKind::InvalidModel,
                "initializer '" + tp.name() + "' is defined more than once");
    Tensor t = convert_tensor(tp, alloc,
                              kind == ValueKind::Param ? Category::Parameter : Category::Workspace,
                              model_dir, what);
    if (kind == ValueKind::Param)
      g.add_param(tp.name(), std::move(t));
    else
      g.add_constant(tp.name(), std::move(t), false);
    std::string().swap(*tp.mutable_raw_data());  // released now, not when the whole model is
    tp.clear_float_data();
    tp.clear_double_data();
    tp.clear_int64_data();
    tp.clear_int32_data();
  }
  // Graph inputs (skipping those that are also initializers, as older exporters list them).
  for (const auto& vi : gp.input()) {
    if (g.find(vi.name()) >= 0) continue;
    GRAFT_CHECK(!vi.name().empty(), ErrorKind::InvalidModel, "a graph input has no name");
    const std::string what = "graph input '" + vi.name() + "'";
    GRAFT_CHECK(vi.type().has_tensor_type(), ErrorKind::Unsupported,
                what + " is not a tensor; graft supports tensor inputs only");
    const auto& tt = vi.type().tensor_type();
    int v = g.add_value(vi.name(), ValueKind::Input, false);
    Value& val = g.values[v];
    lenient([&] { val.dtype = convert_dtype(tt.elem_type(), what); });
    if (tt.has_shape()) {
      bool known = true;
      for (const auto& d : tt.shape().dim()) {
        if (d.has_dim_value()) {
          GRAFT_CHECK(d.dim_value() >= 0, ErrorKind::InvalidModel,
                      what + " has a negative dimension");
          val.shape.push_back(d.dim_value());
          val.dim_params.push_back("");
        } else {
          val.shape.push_back(-1);
          val.dim_params.push_back(d.has_dim_param() ? d.dim_param() : "?");
          known = false;
        }
      }
      val.shape_known = known;
    }
    g.inputs.push_back(v);
  }

  // Nodes: checked and re-sorted topologically by add_nodes (ONNX requires the order, but a
  // hostile file may not obey).
  std::vector<NodeSpec> nodes;
  nodes.reserve(gp.node_size());
  for (int i = 0; i < gp.node_size(); ++i) {
    const auto& np = gp.node(i);
    NodeSpec n;
    n.op = np.op_type();
    n.domain = np.domain();
    n.name = np.name();
    n.inputs.assign(np.input().begin(), np.input().end());
    n.outputs.assign(np.output().begin(), np.output().end());
    const std::string label =
        "node '" + (n.name.empty() ? "#" + std::to_string(i) : n.name) + "' (" + n.op + ")";
    for (const auto& ap : np.attribute()) {
      GRAFT_CHECK(!n.attrs.has(ap.name()), ErrorKind::InvalidModel,
                  label + " has attribute '" + ap.name() + "' twice");
      n.complete &= lenient([&] {
        try {
          n.attrs.set(ap.name(), convert_attr(ap, alloc, model_dir, label));
        } catch (const Error& e) {
          if (!e.node().empty()) throw;
          throw Error(e.kind(), e.message(), n.name);  // the node at fault, as a field
        }
      });
    }
    nodes.push_back(std::move(n));
  }
  add_nodes(g, std::move(nodes), alloc, unsupported);
  std::vector<std::string> outputs;
  for (const auto& vi : gp.output()) outputs.push_back(vi.name());
  set_outputs(g, outputs);
  return g;
}

}  // namespace

Graph load_onnx_bytes(const std::string& bytes, const std::string& model_dir,
                      const ImportOptions& opt) {
  onnx::ModelProto mp;
  GRAFT_CHECK(mp.ParseFromString(bytes), ErrorKind::InvalidModel,
              "the model is not a valid ONNX protobuf (truncated or corrupt file?)");
  return convert_model(mp, model_dir, opt.alloc ? *opt.alloc : Allocator::global(),
                       opt.unsupported);
}

namespace {

// Parses an ONNX file into `mp`, bounded: a regular file of at most max_bytes (opened
// non-blocking, so a FIFO cannot hang us).
void parse_model_file(const std::string& path, int64_t max_bytes, onnx::ModelProto& mp) {
  std::error_code ec;
  GRAFT_CHECK(fs::is_regular_file(path, ec), ErrorKind::Io,
              "cannot open model file '" + path + "'");
  auto size = static_cast<int64_t>(fs::file_size(path, ec));
  GRAFT_CHECK(!ec && size <= max_bytes, ErrorKind::InvalidModel,
              "model file '" + path + "' is " + std::to_string(size) +
                  " bytes, over the limit of " + std::to_string(max_bytes));
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  GRAFT_CHECK(fd >= 0, ErrorKind::Io,
              "cannot open model file '" + path + "': " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  google::protobuf::io::FileInputStream in(fd);
  google::protobuf::io::CodedInputStream coded(&in);
  coded.SetTotalBytesLimit(std::numeric_limits<int>::max());
  GRAFT_CHECK(mp.ParseFromCodedStream(&coded) && coded.ConsumedEntireMessage(),
              ErrorKind::InvalidModel,
              "the model is not a valid ONNX protobuf (truncated or corrupt file?)");
}

OnnxValueInfo value_info(const onnx::ValueInfoProto& vi) {
  OnnxValueInfo r;
  r.name = vi.name();
  if (vi.type().has_tensor_type()) {
    const auto& tt = vi.type().tensor_type();
    r.elem_type = tt.elem_type();
    for (const auto& d : tt.shape().dim()) r.dims.push_back(d.has_dim_value() ? d.dim_value() : 0);
  }
  return r;
}

}  // namespace

Graph load_onnx(const std::string& path, const ImportOptions& opt) {
  try {
    onnx::ModelProto mp;
    parse_model_file(path, opt.max_file_bytes, mp);
    return convert_model(mp, fs::path(path).parent_path().string(),
                         opt.alloc ? *opt.alloc : Allocator::global(), opt.unsupported);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::InvalidModel || e.kind() == ErrorKind::Unsupported)
      throw Error(e.kind(), path + ": " + e.message(), e.node());
    throw;
  }
}

OnnxGraphInfo read_onnx_graph(const std::string& path) {
  onnx::ModelProto mp;
  parse_model_file(path, ImportOptions{}.max_file_bytes, mp);
  OnnxGraphInfo r;
  const auto& g = mp.graph();
  for (const auto& vi : g.input()) r.inputs.push_back(value_info(vi));
  for (const auto& vi : g.output()) r.outputs.push_back(value_info(vi));
  for (const auto& n : g.node()) {
    OnnxNodeInfo ni;
    ni.op_type = n.op_type();
    ni.name = n.name();
    ni.inputs.assign(n.input().begin(), n.input().end());
    ni.outputs.assign(n.output().begin(), n.output().end());
    for (const auto& a : n.attribute())
      if (a.type() == onnx::AttributeProto::INT) ni.ints.emplace_back(a.name(), a.i());
    r.nodes.push_back(std::move(ni));
  }
  return r;
}

namespace {
void set_value_info(onnx::ValueInfoProto* vi, const OnnxValueInfo& v) {
  vi->set_name(v.name);
  auto* tt = vi->mutable_type()->mutable_tensor_type();
  tt->set_elem_type(v.elem_type);
  auto* shape = tt->mutable_shape();
  for (int64_t d : v.dims) shape->add_dim()->set_dim_value(d);
}
}  // namespace

void edit_onnx_graph(const std::string& path,
                     const std::vector<std::tuple<int64_t, std::string, int64_t>>& int_attrs,
                     const std::vector<OnnxValueInfo>& extra_outputs) {
  onnx::ModelProto mp;
  parse_model_file(path, ImportOptions{}.max_file_bytes, mp);
  auto* g = mp.mutable_graph();
  for (const auto& [index, name, value] : int_attrs) {
    GRAFT_CHECK(index >= 0 && index < g->node_size(), ErrorKind::InvalidArgument,
                "edit_onnx_graph: node index " + std::to_string(index) + " out of range");
    auto* a = g->mutable_node(static_cast<int>(index))->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(value);
  }
  for (const auto& o : extra_outputs) set_value_info(g->add_output(), o);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  GRAFT_CHECK(f.good() && mp.SerializeToOstream(&f), ErrorKind::Io, "cannot write '" + path + "'");
}

Tensor load_tensor_pb(const std::string& path, std::string* name) {
  // Read with a bound: a regular file only (opened non-blocking, so a FIFO cannot hang us, and
  // checked before reading, so /dev/zero cannot be read without end), at most protobuf's 2 GiB
  // message limit, and exactly the size fstat reported.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  GRAFT_CHECK(fd >= 0, ErrorKind::Io,
              "cannot open tensor file '" + path + "': " + std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  GRAFT_CHECK(::fstat(fd, &st) == 0, ErrorKind::Io,
              "cannot stat tensor file '" + path + "': " + std::strerror(errno));
  GRAFT_CHECK(S_ISREG(st.st_mode), ErrorKind::Io,
              "tensor file '" + path + "' is not a regular file");
  constexpr int64_t kMaxTensorFile = (int64_t{2} << 30) - 1;
  GRAFT_CHECK(st.st_size <= kMaxTensorFile, ErrorKind::InvalidModel,
              "tensor file '" + path + "' is " + std::to_string(st.st_size) +
                  " bytes, over protobuf's 2 GiB message limit");
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  for (size_t done = 0; done < bytes.size();) {
    ssize_t r = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    GRAFT_CHECK(r >= 0, ErrorKind::Io,
                "cannot read tensor file '" + path + "': " + std::strerror(errno));
    GRAFT_CHECK(r > 0, ErrorKind::Io, "tensor file '" + path + "' shrank while being read");
    done += static_cast<size_t>(r);
  }
  onnx::TensorProto tp;
  GRAFT_CHECK(tp.ParseFromString(bytes), ErrorKind::InvalidModel,
              "'" + path + "' is not a valid ONNX TensorProto");
  if (name) *name = tp.name();
  return convert_tensor(tp, Allocator::global(), Category::Workspace,
                        fs::path(path).parent_path().string(), "tensor file '" + path + "'");
}

void save_tensor_pb(const std::string& path, const Tensor& t, const std::string& name) {
  onnx::TensorProto tp;
  tp.set_name(name);
  for (int64_t d : t.shape()) tp.add_dims(d);
  tp.set_data_type(onnx_elem_type(t.dtype()));
  tp.set_raw_data(std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  std::ofstream f(path, std::ios::binary);
  GRAFT_CHECK(f.good() && tp.SerializeToOstream(&f), ErrorKind::Io, "cannot write '" + path + "'");
}

}  // namespace graft
