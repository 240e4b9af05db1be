// graft._graft: the thin pybind11 layer under graft.GraftModule.
//
// Tensors cross the boundary without copies: PyTorch memory comes in as (data pointer, shape,
// dtype) and is wrapped as graft external storage (the Python side keeps those tensors alive for
// as long as graft may read them); graft memory goes out as numpy arrays whose base is a capsule
// owning a reference to the graft Storage, which torch.from_numpy shares. C++ never keeps a
// Python object: the gradient hook is called during backward and released when the run ends.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "graft/ops.h"
#include "graft/train.h"

namespace py = pybind11;
using namespace graft;

namespace {

DType parse_dtype(const std::string& s) {
  if (s == "float32") return DType::F32;
  if (s == "float64") return DType::F64;
  if (s == "int64") return DType::I64;
  if (s == "int32") return DType::I32;
  if (s == "bool") return DType::Bool;
  fail(ErrorKind::Unsupported,
       "dtype " + s + " is not supported by graft (float32, float64, int64, int32, bool)");
}

Tensor wrap(uintptr_t ptr, const std::vector<int64_t>& shape, const std::string& dtype,
            std::shared_ptr<void> keepalive = nullptr) {
  return Tensor::external(reinterpret_cast<void*>(ptr), shape, parse_dtype(dtype),
                          std::move(keepalive));
}

// What a numpy array of graft memory keeps alive: the block, and the allocator it returns to
// (which may outlive the session: a .grad adopted by PyTorch lives as long as PyTorch wants).
struct Keep {
  std::shared_ptr<Allocator> alloc;  // destroyed last
  std::shared_ptr<Storage> storage;
};

// A numpy array viewing graft memory; the capsule keeps the Storage (and its allocator) alive.
py::array to_numpy(const Tensor& t, const std::shared_ptr<Allocator>& alloc) {
  if (!t.defined()) return py::array();
  auto* keep = new Keep{alloc, t.storage()};
  py::capsule base(keep, [](void* p) { delete static_cast<Keep*>(p); });
  py::dtype dt;
  switch (t.dtype()) {
    case DType::F32:
      dt = py::dtype::of<float>();
      break;
    case DType::F64:
      dt = py::dtype::of<double>();
      break;
    case DType::I64:
      dt = py::dtype::of<int64_t>();
      break;
    case DType::I32:
      dt = py::dtype::of<int32_t>();
      break;
    case DType::Bool:
      dt = py::dtype::of<bool>();
      break;
    case DType::BF16:  // Note [bf16 operands]: graft-internal, never a model's value
      fail(ErrorKind::Internal, "a bfloat16 operand was handed to Python");
  }
  std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end()), strides(t.shape().size());
  py::ssize_t s = static_cast<py::ssize_t>(dtype_size(t.dtype()));
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return py::array(dt, shape, strides, t.raw(), base);
}

py::dict memory_stats(const Allocator& a) {
  py::dict d;
  d["current"] = a.current();
  d["peak"] = a.peak();
  py::dict cur, at_peak;
  for (int c = 0; c < kNumCategories; ++c) {
    cur[category_name(static_cast<Category>(c))] = a.current(static_cast<Category>(c));
    at_peak[category_name(static_cast<Category>(c))] = a.at_peak()[c];
  }
  d["by_category"] = cur;
  d["at_peak"] = at_peak;
  return d;
}

// One step in flight (a PyTorch forward whose backward has not run): the StepState and the
// allocator its memory returns to.
struct PyStep {
  std::shared_ptr<Allocator> alloc;
  std::shared_ptr<StepState> st;
};

// Owns the session and its allocator.
// An ONNX value as Python sees it (read_onnx_graph, edit_onnx_graph, build_graph):
// (name, elem_type, dims).
using ValueTuple = std::tuple<std::string, int, std::vector<int64_t>>;

// graft's own capture (python/graft/_aten.py) as graft's IR: (opset, inputs, outputs, nodes) with
// values as (name, ONNX element type, dims) and nodes as (op_type, domain, name, inputs, outputs,
// [(attribute name, kind, value)]), kind one of i f s I F t (a tensor: (element type, dims, raw
// little-endian bytes)). Checked as a file is (add_nodes); constants live in `alloc`.
Graph build_graph(const py::tuple& model, Allocator& alloc) {
  GRAFT_CHECK(py::len(model) == 4, ErrorKind::InvalidArgument,
              "a captured graph is (opset, inputs, outputs, nodes)");
  Graph g;
  g.name = "graft_capture";
  g.opset = model[0].cast<int64_t>();
  check_opset(g.opset);
  auto dtype = [](int elem, const std::string& what) {
    DType dt;
    GRAFT_CHECK(
        dtype_of_onnx_elem(elem, dt), ErrorKind::Unsupported,
        what + " has ONNX element type " + std::to_string(elem) + ", which graft does not support");
    return dt;
  };
  for (const auto& [name, elem, dims] : model[1].cast<std::vector<ValueTuple>>()) {
    GRAFT_CHECK(g.find(name) < 0, ErrorKind::InvalidModel,
                "graph input '" + name + "' is listed twice");
    g.add_input(name, dtype(elem, "graph input '" + name + "'"), dims);
  }
  std::vector<std::string> outputs;
  for (const auto& v : model[2].cast<std::vector<ValueTuple>>()) outputs.push_back(std::get<0>(v));
  std::vector<NodeSpec> nodes;
  for (const auto& t : model[3].cast<py::list>()) {
    auto [op, domain, name, ins, outs, attrs] =
        t.cast<std::tuple<std::string, std::string, std::string, std::vector<std::string>,
                          std::vector<std::string>, std::vector<py::tuple>>>();
    NodeSpec n{op, domain, name, ins, outs, {}};
    for (const auto& at : attrs) {
      Attr a;
      const auto key = at[0].cast<std::string>();
      const char kind = at[1].cast<std::string>().at(0);
      if (kind == 'i') {
        a.kind = Attr::Int, a.i = at[2].cast<int64_t>();
      } else if (kind == 'f') {
        a.kind = Attr::Float, a.f = at[2].cast<double>();
      } else if (kind == 's') {
        a.kind = Attr::String, a.s = at[2].cast<std::string>();
      } else if (kind == 'I') {
        a.kind = Attr::Ints, a.ints = at[2].cast<std::vector<int64_t>>();
      } else if (kind == 'F') {
        a.kind = Attr::Floats, a.floats = at[2].cast<std::vector<double>>();
      } else if (kind == 't') {
        auto v = at[2].cast<py::tuple>();
        const std::string what = "node '" + name + "' attribute '" + key + "'";
        const DType dt = dtype(v[0].cast<int>(), what);
        const Shape dims = v[1].cast<std::vector<int64_t>>();
        const std::string bytes = v[2].cast<std::string>();
        a.kind = Attr::TensorV;
        a.t = Tensor::empty(dims, dt, alloc, Category::Workspace, name);
        GRAFT_CHECK(bytes.size() == a.t.nbytes(), ErrorKind::InvalidModel,
                    what + " has " + std::to_string(bytes.size()) + " bytes for a tensor of " +
                        std::to_string(a.t.nbytes()));
        if (!bytes.empty()) std::memcpy(a.t.raw(), bytes.data(), bytes.size());
      } else {
        fail(ErrorKind::InvalidArgument, "node '" + name + "': attribute '" + key +
                                             "' has unknown kind '" + std::string(1, kind) + "'");
      }
      n.attrs.set(key, std::move(a));
    }
    nodes.push_back(std::move(n));
  }
  add_nodes(g, std::move(nodes), alloc);
  set_outputs(g, outputs);
  return g;
}

struct PySession {
  std::shared_ptr<Allocator> alloc = std::make_shared<Allocator>();
  std::unique_ptr<TrainSession> s;
  py::object hook;  // set only for the duration of backward()

  // `model`: an ONNX file's path (torch.onnx.export's, the fallback), or graft's own capture as
  // (opset, inputs, outputs, nodes) (python/graft/_aten.py): built into graft's IR here, no file
  // between (build_graph).
  PySession(const py::object& model, const std::map<std::string, std::vector<int64_t>>& shapes,
            const std::vector<std::string>& output_grads, const std::vector<std::string>& freeze,
            const std::vector<std::string>& input_grads,
            const std::vector<std::string>& param_inputs, const std::string& mode,
            bool check_finite, int64_t max_memory, int64_t activation_budget, bool bf16) {
    SessionOptions o;
    o.bf16 = bf16;  // precision="bf16": every step in bf16 (and Note [bf16 operands])
    o.output_grads = output_grads;
    o.freeze = freeze;
    o.input_grads = input_grads;
    o.param_inputs = param_inputs;
    o.mode = parse_grad_mode(mode);
    o.check_finite = check_finite;
    o.max_memory = max_memory;
    o.activation_budget = activation_budget;
    // GRAFT_BLOCKED=0: every activation plain (Note [channel-blocked values]; the A/B switch).
    const char* blk = std::getenv("GRAFT_BLOCKED");
    o.blocked_layouts = !(blk && std::strcmp(blk, "0") == 0);
    // GRAFT_PROFILE=1: per-op wall times of the last forward and backward (op_times below).
    const char* prof = std::getenv("GRAFT_PROFILE");
    o.profile = prof && *prof && std::strcmp(prof, "0") != 0;
    o.alloc = alloc.get();
    std::map<std::string, Shape> sh(shapes.begin(), shapes.end());
    if (py::isinstance<py::str>(model))
      s = TrainSession::open(model.cast<std::string>(), o, sh);
    else
      s = std::make_unique<TrainSession>(build_graph(model.cast<py::tuple>(), *alloc), o, sh);
    s->set_hook([this](Parameter& p, const Tensor& g) {
      // exclusive: graft's own block with no other reference, so the callee may keep it (no copy).
      bool exclusive = g.storage().use_count() == 1 && g.storage()->owner == alloc.get();
      if (!hook.is_none()) hook(p.name, to_numpy(g, alloc), exclusive);
    });
  }
};

using TensorSpec = std::tuple<uintptr_t, std::vector<int64_t>, std::string>;

// Python objects (PyTorch tensors) whose graft handles died on a thread without the GIL: released
// by the next binding call that holds it (graft's kernels never hold a handle, so in practice
// every release happens in the thread running backward, with the GIL).
std::mutex g_orphans_mu;
std::vector<PyObject*> g_orphans;

void release_orphans() {
  std::vector<PyObject*> v;
  {
    std::lock_guard<std::mutex> lk(g_orphans_mu);
    v.swap(g_orphans);
  }
  for (PyObject* o : v) Py_DECREF(o);
}

// A keepalive for graft memory that is a PyTorch tensor's: holds a reference to the tensor and
// drops it when graft's last handle goes (an output gradient graft owns for its backward, released
// after its last read: Note [output gradients handed over] in python/graft/_function.py).
std::shared_ptr<void> hold_python(py::object o) {
  return std::shared_ptr<void>(o.release().ptr(), [](void* p) {
    auto* obj = static_cast<PyObject*>(p);
    if (PyGILState_Check()) {
      Py_DECREF(obj);
    } else {
      std::lock_guard<std::mutex> lk(g_orphans_mu);
      g_orphans.push_back(obj);
    }
  });
}

std::vector<OnnxValueInfo> value_infos(const std::vector<ValueTuple>& v) {
  std::vector<OnnxValueInfo> r;
  for (const auto& [name, type, dims] : v) r.push_back({name, type, dims});
  return r;
}

}  // namespace

// graft.optim.AdamW's engine (python/graft/optim.py): graft's AdamW over parameters whose memory
// is PyTorch's (rebound at every update: a caller may replace p.data), with its state in a file
// (Note [optimizer state on disk]). Updates run without the GIL.
struct PyAdamWFile {
  std::shared_ptr<Allocator> alloc = std::make_shared<Allocator>();
  std::vector<Parameter> params;
  std::vector<std::string> dtypes;
  std::unique_ptr<AdamW> opt;
  PyAdamWFile(const std::vector<std::vector<int64_t>>& shapes,
              const std::vector<std::string>& dtype_names, const std::string& path, int64_t window,
              bool direct)
      : params(shapes.size()), dtypes(dtype_names) {
    GRAFT_CHECK(shapes.size() == dtype_names.size(), ErrorKind::InvalidArgument,
                "AdamWFile: one dtype per shape");
    std::vector<Parameter*> ps;
    for (size_t i = 0; i < shapes.size(); ++i) {
      params[i].name = "param " + std::to_string(i);
      params[i].data = Tensor::external(nullptr, shapes[i], parse_dtype(dtype_names[i]), nullptr);
      ps.push_back(&params[i]);
    }
    opt = std::make_unique<AdamW>(ps, AdamWOptions{}, alloc.get());
    opt->set_state_file({path, window, direct});
  }
  void update(size_t i, uintptr_t w, uintptr_t g, double lr, double beta1, double beta2, double eps,
              double weight_decay) {
    GRAFT_CHECK(i < params.size(), ErrorKind::InvalidArgument,
                "AdamWFile: no parameter " + std::to_string(i));
    const Shape shape = params[i].data.shape();
    params[i].data = wrap(w, shape, dtypes[i]);
    Tensor grad = wrap(g, shape, dtypes[i]);
    opt->options = {lr, beta1, beta2, eps, weight_decay};
    py::gil_scoped_release nogil;
    opt->update(i, grad);
  }
};

PYBIND11_MODULE(_graft, m) {
  m.doc() = "graft's C++ runtime (internal; use graft.GraftModule)";
  // Every graft::Error surfaces as the graft.errors class for its kind, with kind, node and
  // message as fields (graft.errors is pure Python, importable without this module).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      static py::handle make =
          py::object(py::module_::import("graft.errors").attr("from_runtime")).release();
      py::object exc = make(e.message(), error_kind_name(e.kind()), e.node());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
  m.def("set_num_threads", &set_num_threads);
  // The graph of an ONNX file as plain tuples: (inputs, outputs, nodes), a value as
  // (name, elem_type, dims), a node as (op_type, name, inputs, outputs, {int attribute: value}).
  m.def("read_onnx_graph", [](const std::string& path) {
    OnnxGraphInfo g = read_onnx_graph(path);
    auto vis = [](const std::vector<OnnxValueInfo>& v) {
      std::vector<ValueTuple> r;
      for (const auto& x : v) r.emplace_back(x.name, x.elem_type, x.dims);
      return r;
    };
    std::vector<std::tuple<std::string, std::string, std::vector<std::string>,
                           std::vector<std::string>, std::map<std::string, int64_t>>>
        nodes;
    for (const auto& n : g.nodes)
      nodes.emplace_back(n.op_type, n.name, n.inputs, n.outputs,
                         std::map<std::string, int64_t>(n.ints.begin(), n.ints.end()));
    return std::make_tuple(vis(g.inputs), vis(g.outputs), nodes);
  });
  m.def("edit_onnx_graph",
        [](const std::string& path,
           const std::vector<std::tuple<int64_t, std::string, int64_t>>& int_attrs,
           const std::vector<ValueTuple>& outputs) {
          edit_onnx_graph(path, int_attrs, value_infos(outputs));
        });
  m.def("num_threads", &num_threads);
  // Whether bf16 matrix products run natively here (AVX512-BF16 or AMX; precision="bf16" needs it).
  m.def("bf16_matmul_native", &bf16_matmul_native);
  // Note [mapped block cache] (core.cpp): graft.empty_cache() and graft.memory_cache_stats().
  m.def("empty_cache", [] { BlockCache::global().trim(); });
  m.def("block_cache_stats", [] {
    const BlockCache::Stats s = BlockCache::global().stats();
    py::dict d;
    d["in_use"] = s.in_use;
    d["kept"] = s.kept;
    d["high"] = s.high;
    d["hits"] = s.hits;
    d["splits"] = s.splits;
    d["maps"] = s.maps;
    d["unmaps"] = s.unmaps;
    d["resizes"] = s.resizes;
    return d;
  });
  // Note [graft's update in step mode] (python/graft/_function.py): torch.optim.AdamW's update of
  // one parameter on its own state tensors (addresses: weights, gradient, exp_avg, exp_avg_sq, n
  // elements of `dtype`; `step`, the state's one-element step count of `step_dtype`, is advanced by
  // one first, as the optimizer does), with graft's kernel on graft's threads, without the GIL.
  m.def("adamw_update", [](uintptr_t w, uintptr_t g, uintptr_t mo, uintptr_t v, int64_t n,
                           const std::string& dtype, uintptr_t step, const std::string& step_dtype,
                           double lr, double beta1, double beta2, double eps, double weight_decay) {
    const DType dt = parse_dtype(dtype), sdt = parse_dtype(step_dtype);
    GRAFT_CHECK(sdt == DType::F32 || sdt == DType::F64, ErrorKind::InvalidArgument,
                "adamw_update: the step count must be float32 or float64, not " + step_dtype);
    double count = 0;
    if (sdt == DType::F32) {
      float* s = reinterpret_cast<float*>(step);
      count = *s += 1.f;
    } else {
      double* s = reinterpret_cast<double*>(step);
      count = *s += 1.0;
    }
    const AdamWOptions o{lr, beta1, beta2, eps, weight_decay};
    py::gil_scoped_release nogil;
    adamw_apply(dt, reinterpret_cast<void*>(w), reinterpret_cast<const void*>(g),
                reinterpret_cast<void*>(mo), reinterpret_cast<void*>(v), n,
                static_cast<int64_t>(count), o);
  });
  py::class_<PyAdamWFile>(m, "AdamWFile")
      .def(py::init<const std::vector<std::vector<int64_t>>&, const std::vector<std::string>&,
                    const std::string&, int64_t, bool>(),
           py::arg("shapes"), py::arg("dtypes"), py::arg("path"), py::arg("window") = 0,
           py::arg("direct_io") = true)
      .def("update", &PyAdamWFile::update)
      .def("steps", [](PyAdamWFile& a) { return a.opt->param_steps(); })
      .def("stats",
           [](PyAdamWFile& a) {
             const StateFileStats st = a.opt->state_file_stats();
             py::dict d;
             d["path"] = st.path;
             d["direct_io"] = st.direct_io;
             d["file_bytes"] = st.file_bytes;
             d["window_bytes"] = st.window_bytes;
             d["bytes_read"] = st.bytes_read;
             d["bytes_written"] = st.bytes_written;
             d["prefetch_hits"] = st.prefetch_hits;
             d["ram_bytes"] = a.alloc->current();
             return d;
           })
      // Every parameter's exp_avg and exp_avg_sq, copied from the file to (m pointer, v pointer)
      // of the parameter's shape and dtype (untouched where it has no state yet); returns the
      // step counts. For state_dict().
      .def("read_states",
           [](PyAdamWFile& a, const std::vector<std::pair<uintptr_t, uintptr_t>>& to) {
             const OptimizerState st = a.opt->state();
             GRAFT_CHECK(to.size() == st.tensors.size(), ErrorKind::InvalidArgument,
                         "AdamWFile.read_states: one entry per parameter");
             for (size_t i = 0; i < to.size(); ++i) {
               if (!st.tensors[i].count("exp_avg")) continue;
               const Tensor &em = st.tensors[i].at("exp_avg"), &ev = st.tensors[i].at("exp_avg_sq");
               std::memcpy(reinterpret_cast<void*>(to[i].first), em.raw(), em.nbytes());
               std::memcpy(reinterpret_cast<void*>(to[i].second), ev.raw(), ev.nbytes());
             }
             return st.counters;
           })
      // Each parameter's (offset, stride) in the file: exp_avg at offset, exp_avg_sq at offset +
      // stride; after every write in flight is done. For state_dict()'s views of the file.
      .def("offsets",
           [](PyAdamWFile& a) {
             a.opt->state_file_stats();  // flushes
             std::vector<std::pair<int64_t, int64_t>> off;
             for (size_t i = 0; i < a.params.size(); ++i)
               off.push_back(a.opt->file_state_offset(i));
             return off;
           })
      // Replaces every parameter's state: per parameter (m pointer, v pointer, step), 0 pointers
      // and step 0 for none yet; written into the file one parameter at a time (RAM: one
      // parameter's state). For load_state_dict().
      .def("load_state", [](PyAdamWFile& a,
                            const std::vector<std::tuple<uintptr_t, uintptr_t, int64_t>>& per) {
        OptimizerState st = a.opt->state_in_ram();  // (no read of the file's moments)
        GRAFT_CHECK(per.size() == a.params.size(), ErrorKind::InvalidArgument,
                    "AdamWFile.load_state: one entry per parameter");
        for (size_t i = 0; i < per.size(); ++i) {
          const auto& [m, v, step] = per[i];
          GRAFT_CHECK(step >= 0 && (step > 0) == (m != 0 && v != 0), ErrorKind::InvalidArgument,
                      "AdamWFile.load_state: parameter " + std::to_string(i) +
                          " needs exp_avg and exp_avg_sq exactly when its step is > 0");
        }
        for (size_t i = 0; i < per.size(); ++i) {
          const auto& [m, v, step] = per[i];
          st.tensors[i].clear();
          st.counters[i] = step;
          if (!m) continue;
          const size_t b = a.params[i].data.nbytes();
          Tensor both = Tensor::empty({static_cast<int64_t>((2 * b + 3) / 4)}, DType::F32, *a.alloc,
                                      Category::Workspace, "optimizer state copy");
          std::memcpy(both.raw(), reinterpret_cast<void*>(m), b);
          std::memcpy(static_cast<char*>(both.raw()) + b, reinterpret_cast<void*>(v), b);
          a.opt->write_file_state(i, both.raw());
        }
        a.opt->load_state(st);  // tensors_in_file: hyperparameters and counters only
      });
  // Installs fn(key, backward, node, inputs) -> outputs as the runner of graft.PythonOp nodes
  // (python/graft/_pyfunc.py; None uninstalls). inputs: a numpy array over graft memory per
  // input, None where absent; outputs: per output, an array of its dtype and shape (copied into
  // graft's buffer) or None (zeros). An exception fn raises propagates to the caller unchanged.
  m.def("set_python_op_runner", [](py::object fn) {
    if (fn.is_none()) {
      set_python_op_runner(nullptr);
      return;
    }
    // Kept for the process: the runner may be called until the last session is gone.
    auto* f = new py::object(std::move(fn));
    set_python_op_runner([f](KernelCtx& c, int64_t key, bool backward) {
      py::gil_scoped_acquire gil;
      py::list ins;
      for (const Tensor* t : c.ins)
        ins.append(t ? py::object(to_numpy(*t, nullptr)) : py::object(py::none()));
      py::object got = (*f)(key, backward, c.node.name, ins);
      py::sequence outs = py::reinterpret_borrow<py::sequence>(got);
      if (static_cast<size_t>(py::len(outs)) != c.outs.size())
        c.error(ErrorKind::InvalidArgument, "the runner returned " + std::to_string(py::len(outs)) +
                                                " values for " + std::to_string(c.outs.size()) +
                                                " outputs");
      for (size_t i = 0; i < c.outs.size(); ++i) {
        Tensor* o = c.outs[i];
        if (!o) continue;
        py::object v = outs[i];
        if (v.is_none()) {
          std::memset(o->raw(), 0, o->nbytes());
          continue;
        }
        // Through the buffer protocol, not numpy's structs (whose layout numpy 2 changed).
        py::buffer_info info = py::reinterpret_borrow<py::buffer>(v).request();
        std::vector<int64_t> shape(info.shape.begin(), info.shape.end());
        bool packed = true;
        for (int64_t d = info.ndim - 1, step = info.itemsize; d >= 0; step *= info.shape[d], --d)
          packed = packed && (info.shape[d] <= 1 || info.strides[d] == step);
        if (shape != o->shape() || static_cast<size_t>(info.itemsize) != dtype_size(o->dtype()) ||
            !packed)
          c.error(ErrorKind::ShapeMismatch,
                  "value " + std::to_string(i) + " has shape " + shape_str(shape) + " (" +
                      std::to_string(info.itemsize) + "-byte elements" +
                      (packed ? "" : ", not contiguous") + ") where the capture recorded " +
                      shape_str(o->shape()) + " (" + dtype_name(o->dtype()) + ")");
        std::memcpy(o->raw(), info.ptr, o->nbytes());
      }
    });
  });

  py::class_<PyStep>(m, "Step")
      .def("input_grads",
           [](PyStep& s) {
             std::vector<py::object> r;
             for (const Tensor& t : s.st->input_grads)
               r.push_back(t.defined() ? py::object(to_numpy(t, s.alloc)) : py::none());
             return r;
           })
      .def("pending", [](PyStep& s) { return s.st->forward_done && !s.st->backward_done; })
      .def("seed", [](PyStep& s) { return s.st->seed; });

  py::class_<PySession>(m, "Session")
      .def(py::init<const py::object&, const std::map<std::string, std::vector<int64_t>>&,
                    const std::vector<std::string>&, const std::vector<std::string>&,
                    const std::vector<std::string>&, const std::vector<std::string>&,
                    const std::string&, bool, int64_t, int64_t, bool>(),
           py::arg("model"), py::arg("input_shapes"), py::arg("output_grads"), py::arg("freeze"),
           py::arg("input_grads"), py::arg("param_inputs"), py::arg("mode"),
           py::arg("check_finite") = false, py::arg("max_memory") = 0,
           py::arg("activation_budget") = 0, py::arg("bf16") = false)
      .def("parameters",
           [](PySession& p) {
             std::vector<std::tuple<std::string, bool>> r;
             for (const auto& q : p.s->parameters()) r.emplace_back(q.name, q.trainable);
             return r;
           })
      .def("outputs_info",
           [](PySession& p) {
             std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>> r;
             const Graph& g = p.s->graph();
             for (int o : g.outputs)
               r.emplace_back(g.values[o].name, dtype_name(g.values[o].dtype), g.values[o].shape);
             return r;
           })
      .def("inputs_info",
           [](PySession& p) {
             std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>> r;
             const Graph& g = p.s->graph();
             for (int v : g.inputs)
               r.emplace_back(g.values[v].name, dtype_name(g.values[v].dtype), g.values[v].shape);
             return r;
           })
      .def("bind_param",
           [](PySession& p, const std::string& name, uintptr_t ptr,
              const std::vector<int64_t>& shape,
              const std::string& dtype) { p.s->bind_parameter(name, wrap(ptr, shape, dtype)); })
      // Binds an existing gradient buffer (accumulated into in place), or None (set_to_none).
      .def("bind_grad",
           [](PySession& p, const std::string& name, std::optional<uintptr_t> ptr,
              const std::vector<int64_t>& shape, const std::string& dtype) {
             Parameter& q = p.s->parameter(name);
             q.grad = ptr ? wrap(*ptr, shape, dtype) : Tensor();
           })
      // The gradient graft adopted for `name` (a new buffer, when it was None), or None.
      .def("take_grad",
           [](PySession& p, const std::string& name) -> py::object {
             Parameter& q = p.s->parameter(name);
             if (!q.grad.defined() || !q.grad.storage()->owner) {
               q.grad = Tensor();
               return py::none();
             }
             py::array a = to_numpy(q.grad, p.alloc);
             q.grad = Tensor();
             return std::move(a);
           })
      // Runs a forward over `inputs` (name -> (pointer, shape, dtype), PyTorch memory the caller
      // keeps alive). Returns the step and its outputs as numpy arrays over graft memory.
      .def(
          "forward",
          [](PySession& p, const std::map<std::string, TensorSpec>& inputs, uint64_t seed,
             bool keep_for_backward, bool bf16) {
            std::map<std::string, Tensor> in;
            for (const auto& [n, t] : inputs)
              in[n] = wrap(std::get<0>(t), std::get<1>(t), std::get<2>(t));
            std::shared_ptr<StepState> st;
            {
              py::gil_scoped_release nogil;
              st = p.s->forward(in, seed, keep_for_backward, bf16);
            }
            std::vector<py::array> r;
            for (const Tensor& t : st->outputs) r.push_back(to_numpy(t, p.alloc));
            st->outputs.clear();  // PyTorch owns the outputs now (through the arrays' capsules)
            st->loss = Tensor();
            st->inputs.clear();  // the caller keeps its tensors alive while the step is pending
            return py::make_tuple(PyStep{p.alloc, st}, r);
          },
          py::arg("inputs"), py::arg("seed"), py::arg("keep_for_backward") = true,
          py::arg("bf16") = false)
      .def(
          "backward",
          // owned: {name: tensor} for output gradients graft takes over: each is held by graft's
          // handle alone (the dict is emptied) and released after its last read.
          [](PySession& p, PyStep& step, const std::map<std::string, TensorSpec>& grads,
             py::object hook, py::object owned) {
            std::map<std::string, Tensor> og;
            py::dict own = owned.is_none() ? py::dict() : py::reinterpret_borrow<py::dict>(owned);
            for (const auto& [n, g] : grads) {
              std::shared_ptr<void> keep;
              if (own.contains(n)) keep = hold_python(own[py::str(n)]);
              og[n] = wrap(std::get<0>(g), std::get<1>(g), std::get<2>(g), std::move(keep));
            }
            if (!owned.is_none()) own.clear();
            p.hook = hook;
            try {
              p.s->backward(*step.st, std::move(og));
            } catch (...) {
              p.hook = py::none();
              release_orphans();
              throw;
            }
            p.hook = py::none();
            release_orphans();
          },
          py::arg("step"), py::arg("grads"), py::arg("hook") = py::none(),
          py::arg("owned") = py::none())
      .def("release",
           [](PySession& p, PyStep& step) {
             if (step.st && step.st->run && step.st->run->active()) step.st->run.reset();
             step.st->backward_done = true;
           })
      .def("memory", [](PySession& p) { return memory_stats(*p.alloc); })
      .def("reset_peak", [](PySession& p) { p.alloc->reset_peak(); })
      .def("planned_peak", [](PySession& p) { return p.s->plan().planned_peak; })
      .def("recomputed_nodes", [](PySession& p) { return p.s->recomputed_nodes(); })
      // [(value, op, node, bytes)]: what the forward keeps for the backward (saved_for_backward).
      .def("saved_for_backward",
           [](PySession& p) {
             std::vector<std::tuple<std::string, std::string, std::string, int64_t>> r;
             for (const auto& s : p.s->saved_for_backward())
               r.emplace_back(s.value, s.op, s.node, s.bytes);
             return r;
           })
      // [(node, op, seconds)] of the last forward or backward run, with GRAFT_PROFILE=1 set
      // when the session was made (empty otherwise).
      .def("op_times",
           [](PySession& p) {
             std::vector<std::tuple<std::string, std::string, double>> r;
             const Graph& g = p.s->graph();
             for (const OpTime& t : p.s->op_times())
               if (t.node >= 0 && t.node < static_cast<int>(g.nodes.size()))
                 r.emplace_back(g.nodes[t.node].name, g.nodes[t.node].op, t.seconds);
             return r;
           })
      // [(node, flops)]: each node's arithmetic FLOPs per run (node_flops; 0 for elementwise),
      // for rates beside op_times.
      .def("node_flops",
           [](PySession& p) {
             std::vector<std::pair<std::string, double>> r;
             const Graph& g = p.s->graph();
             for (const Node& n : g.nodes)
               if (!n.dead) r.emplace_back(n.name, node_flops(g, n));
             return r;
           })
      // [(value, op, node, bytes)]: the buffers alive at the planned activation peak.
      .def("live_at_peak", [](PySession& p) {
        std::vector<std::tuple<std::string, std::string, std::string, int64_t>> r;
        for (const auto& s : p.s->live_at_peak()) r.emplace_back(s.value, s.op, s.node, s.bytes);
        return r;
      });
}
