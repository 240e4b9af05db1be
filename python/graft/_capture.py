"""graft's own capture of a module's forward: the aten ops it runs, recorded (in the training
process by default) and written as an ONNX graph for graft's importer (Note [graft's own capture]).

Only what this module knows is captured; everything else (an aten op without a rule here, a
branch on a tensor's value, random numbers feeding the graph, in-place writes to the module's state
or through views, forward hooks, training-mode BatchNorm, Dropout) raises NotCaptured, and
GraftModule exports with torch.onnx.export instead (python/graft/_export.py). A forward that stops
a gradient graft would compute raises StopsGradient: GraftModule refuses it.
"""
import weakref
from typing import Any, Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _export, _flatten

# Note [graft's own capture]
# torch.onnx.export costs the process that runs it 15-28 MiB on the zoo's tiny models (the
# TorchScript tracer's and the ONNX passes' code pages of libtorch, the exporter's heap), which is
# why GraftModule runs it in a forked child (Note [export in a child process]); but the child's
# pages still count while it runs, and on those models that moment was 1.17-1.71x eager's whole
# peak. So GraftModule first captures the forward itself, the way torch.export does: a
# TorchDispatchMode sees every aten op the forward runs (below autograd, PyTorch's composite ops
# already decomposed) on the real tensors. Each op on a graph value (an input, a parameter, a
# buffer, or what was computed from them) becomes ONNX nodes by a rule in _RULES; an op on
# constants only (a causal mask, position ids from arange) just runs, and its result becomes a
# Constant node when a graph op reads it. The forward runs with autograd recording but saving
# nothing (saved_tensors_hooks), so each value is freed at its last use, as in a no_grad forward.
# nn.LSTM / nn.GRU are captured whole, as graft's fused ops (_rnn_forward).
#
# Where it runs. In a forked child (as the exporter: Note [export in a child process]) the child's
# own pages count while it runs: copies of the parent's pages that Python's reference counts write
# to (5-7 MiB), the code of the forward's kernels and of PyTorch's dispatcher, and the scratch
# memory the kernels' libraries keep (7 MiB of anonymous memory after ViT-B/16's forward in a fresh
# process, part of it OpenBLAS's per-thread packing buffers). On the zoo's tiny models
# (tools/zoo-report --memory; README, "Memory against eager") that moment was 1.11-1.44x eager's
# whole peak. In the training process there is no such moment, the code pages go once the forward
# has run (Note [code pages read once], _proc.py), and what stays is that scratch: it put ViT-B/16
# at 1.002x eager's peak (0.996x captured in a child), where graft's own products run on oneDNN
# and never use OpenBLAS's buffers. So
# GRAFT_EXPORT=capture (the default) captures here when the module's parameters and buffers are
# under CHILD_FROM_BYTES (64 MiB: a child's 15-30 MiB hide under a training step's peak of at least
# twice the parameters from there on) and the graph is not known to fail before the forward runs
# (training-mode BatchNorm or Dropout, forward hooks: the audit alone runs then, in a child, as the
# exporter after it); capture-inprocess / capture-fork choose. Here, the module's state is left as
# it was: a write to an input, parameter or buffer lands in a copy (_redirected), buffers written
# without a version bump (BatchNorm's statistics) are put back, the RNG state is restored. Its
# convolutions run PyTorch's native kernels, not oneDNN's (fewer code pages to map and give back).

# Safety. Anything the rules cannot take (an op without a rule, an output a rule does not name, a
# value read after an in-place write through another view of it, `.item()` or a branch on a graph
# value, random numbers feeding the graph, training-mode BatchNorm, forward hooks) stops the graph;
# the module then goes through torch.onnx.export. An in-place write to an input, parameter or
# buffer is refused before it runs. What is captured is checked once: the forward's real outputs
# (every element of small ones, a strided sample of 4096 of larger ones, read with ctypes so that
# no PyTorch kernel runs for it) are compared with what graft's first forward returns
# (GraftModule.forward); a mismatch drops the capture for good, warns, and runs that call again
# through torch.onnx.export, so a wrong rule costs time, not a wrong result, unless it is wrong only
# on elements the sample skips.
#
# The audit. graft's backward differentiates every op of the forward graph; it has no stop-gradient.
# So where the forward stops a gradient that would flow (an op under torch.no_grad, detach(),
# `.data`, memory of a differentiated value reached without an op) or replaces one (a custom
# torch.autograd.Function), and that value reaches a float output, no graph gives eager's .grad:
# torch.onnx.export records those ops as plain ones, and graft used to train such modules with
# gradients eager does not have. The recorder tracks which values carry a gradient (from a
# trainable parameter or an input that requires grad) and which were stopped, through the whole
# forward (also after the graph stopped), and GraftModule refuses such a module with the reason,
# whatever GRAFT_EXPORT says (StopsGradient).


class NotCaptured(Exception):
    """The capture cannot take this module (the reason in the message); export it instead.
    input_writes: ((input index, operator), ...) the forward wrote in place into, which the
    exporter's graph does not write back either (GraftModule warns)."""

    def __init__(self, why, input_writes=()):
        super().__init__(why, tuple(input_writes))

    @property
    def input_writes(self):
        return self.args[1]

    def __str__(self):
        return str(self.args[0])


class StopsGradient(Exception):
    """The forward stops or replaces a gradient graft's backward would compute (the reason in the
    message): neither the capture nor torch.onnx.export gives eager's gradients; refuse."""


_ELEM = {torch.float32: 1, torch.int64: 7, torch.int32: 6, torch.bool: 9, torch.float64: 11}
_SAMPLE = 1 << 12  # elements of each output the first call's check compares (all of a smaller one)
_RANDOM = {"rand", "randn", "randint", "randperm", "bernoulli", "bernoulli_", "normal", "normal_",
           "uniform_", "native_dropout", "dropout", "rand_like", "randn_like", "randint_like",
           "multinomial", "exponential_", "random_", "cauchy_", "geometric_", "log_normal_"}
# Ops whose result depends only on shapes / dtypes of their tensor arguments, never on values.
_SHAPE_ONLY = {"zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full",
               "new_empty", "empty_strided", "new_empty_strided"}


def _op_name(func):
    return func._schema.name.split("::")[-1]


def _elem(t: torch.Tensor, what: str) -> int:
    return _elem_of(t.dtype, what)


def _elem_of(dtype, what="a value") -> int:
    """The ONNX element type of a PyTorch dtype graft has."""
    e = _ELEM.get(dtype)
    if e is None:
        raise NotCaptured(f"{what} has dtype {dtype}")
    return e


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().numpy().tobytes()


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: Dict[int, Any] = {}      # id(tensor) -> (weakref, value name)
        self.poison: Dict[int, Any] = {}     # id -> (weakref, why): tensors that must not be read
        self.random: Dict[int, Any] = {}     # id -> weakref: constants computed from random numbers
        self.consts: Dict[Any, str] = {}     # (id, version, dtype) -> the Constant's name
        self.const_refs: List[Any] = []      # keeps a constant alive while its name is cached
        self.nodes: List[tuple] = []         # (op, domain, name, inputs, outputs, attrs)
        self.state_names = set()             # names of inputs, parameters and buffers
        self.state_storages = set()          # and their storages
        self.named_refs: Dict[int, list] = {}  # storage -> weakrefs of the tensors bound to graph values
        # The audit: values that carry a gradient (from a trainable parameter or an input that
        # requires grad), by name and by storage; values whose gradient the forward stopped
        # (name -> why), and constants computed from such memory (id -> (weakref, why)).
        self.carry = set()
        self.carry_refs: Dict[int, list] = {}
        self.tainted: Dict[str, str] = {}
        self.input_storages: Dict[int, int] = {}  # storage of a call tensor -> its index
        self.input_writes: Dict[int, str] = {}  # call tensor index -> the first operator writing into it
        self.stopped: Dict[int, Any] = {}
        self.warnings: List[tuple] = []      # (message, None, None, None), as _export.Exported.warnings
        self.shapes: Dict[str, list] = {}    # value -> shape, of the values bound and constants
        self.producer: Dict[str, tuple] = {}  # value -> (op, inputs, attrs) of the node that made it
        # Storages a graph op wrote into in place, each held by the tensor written (so that the
        # address is not reused for a new tensor while the capture runs).
        self.written: Dict[int, torch.Tensor] = {}
        self.suppress = 0
        self._branches = set()
        self.module_name = ""
        self.n = 0
        self.failed = None

    # --- values ---
    def _lookup(self, table, t):
        hit = table.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return None

    def name_of(self, t):
        return self._lookup(self.names, t)

    def bind(self, t, name):
        self.shapes[name] = list(t.shape)
        self.named_refs.setdefault(_storage_key(t), []).append(weakref.ref(t))
        tid = id(t)
        self.names[tid] = (weakref.ref(t, lambda _r, tid=tid, table=self.names: table.pop(tid, None)), name)
        self.poison.pop(tid, None)

    def fresh(self, hint="v"):
        self.n += 1
        return f"{hint}{self.n}"

    def add_input(self, t, name):
        self.state_names.add(name)
        self.state_storages.add(_storage_key(t))
        self.bind(t, name)
        if t.requires_grad and t.is_floating_point():
            self.carry.add(name)
            self._remember_carrying(t)

    def v(self, x, dtype=None):
        """The graph value for an op's argument: a named tensor, or a constant (a Constant node),
        cast to dtype where given."""
        if isinstance(x, torch.Tensor):
            self.check_readable(x)
            name = self.name_of(x)
            if name is not None:
                if dtype is not None and x.dtype != dtype:
                    return self.emit("Cast", [name], attrs=[("to", "i", _elem_of(dtype, "a cast"))])
                return name
            if self._lookup(self.random, x) is not None:
                raise NotCaptured("random numbers (torch.rand and the like) feed the graph")
            if _storage_key(x) in self.written:
                raise NotCaptured("a constant read after a graph op wrote into its storage (a view)")
            if self._lookup(self.stopped, x) is not None or self._aliases_carrying(x) \
                    or any(w() is not None and w() is not x for w in self.named_refs.get(_storage_key(x), ())):
                # Memory of a graph value reached without an op graft saw (`.data`, a view made
                # outside the dispatcher): as a constant it would lose its gradient.
                raise NotCaptured("a tensor sharing memory with a graph value, made without an op the capture saw")
            t = x if dtype is None else x.to(dtype)
            key = (id(x), x._version, None if dtype is None else str(dtype))
            hit = self.consts.get(key)
            if hit is not None:
                return hit
            name = self.fresh("c")
            self.shapes[name] = list(t.shape)
            # A Constant node, not an initializer: graft takes an initializer for a weight of the
            # graph, to differentiate (and keep its operands for that).
            self.nodes.append(("Constant", "", f"{name}_Constant", [], [name],
                               [("value", "t", (_elem(t, "a constant"), list(t.shape), _raw(t)))]))
            self.consts[key] = name
            self.const_refs.append(x)
            return name
        if isinstance(x, (bool, int, float)):
            if dtype is None:
                dtype = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float32
            return self.v(torch.tensor(x, dtype=dtype))
        raise NotCaptured(f"an argument of type {type(x).__name__}")

    def ints(self, xs):
        return self.v(torch.tensor(list(xs), dtype=torch.int64))

    def check_readable(self, t):
        why = self._lookup(self.poison, t)
        if why is not None:
            raise NotCaptured(why)

    def emit(self, op, inputs, outputs=None, attrs=(), nout=1):
        """Appends a node; returns its output name (or names when nout > 1 / outputs given)."""
        names = outputs if outputs is not None else [self.fresh() for _ in range(nout)]
        self.nodes.append((op, "", f"n{len(self.nodes)}_{op}", list(inputs), list(names), list(attrs)))
        for o in names:
            if o:
                self.producer[o] = (op, list(inputs), list(attrs))
        return names[0] if outputs is None and nout == 1 else names

    # --- the dispatch ---
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            if func._schema.name in ("aten::convolution", "aten::_convolution"):
                # PyTorch's native convolution, not oneDNN's (as Note [a lean export]): oneDNN's
                # code pages (2.5 MiB) would be mapped for the capture alone, raising its moment;
                # the values are the same.
                with torch.backends.mkldnn.flags(enabled=False):
                    return self._dispatch(func, args, kwargs)
            return self._dispatch(func, args, kwargs)
        except NotCaptured as ex:  # only what must not run at all (an in-place write to state)
            if self.failed is None:
                self.failed = f"{func._schema.name}: {ex}"
            raise

    def _fail(self, func, why):
        """The graph cannot be built any further; the forward runs on (the audit, below)."""
        if self.failed is None:
            self.failed = f"{func._schema.name}: {why}"

    def _dispatch(self, func, args, kwargs):
        if self.suppress:  # inside a module captured whole (_rnn_forward): just compute
            return func(*args, **kwargs)
        op = _op_name(func)
        flat = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        named = [a for a in flat if self.name_of(a) is not None]
        # The audit (Note [graft's own capture]): where the forward stops a gradient that would
        # flow in graft's backward. It runs to the end of the forward even when the graph cannot
        # be built, so that torch.onnx.export (which records these ops as plain ones) is not used
        # on such a module either.
        taint = next((self.tainted[self.name_of(a)] for a in named if self.name_of(a) in self.tainted), None)
        carrying = any(self.name_of(a) in self.carry for a in named)
        if carrying and taint is None:
            if not torch.is_grad_enabled():
                taint = "a part of the forward runs with gradients off (torch.no_grad, or inside a custom " \
                        "autograd.Function)"
            elif op == "detach":
                taint = "the forward detaches a value graft differentiates (detach())"
        if taint is None:
            for a in flat:
                t = self._lookup(self.stopped, a) if self.name_of(a) is None else None
                if t is None and self.name_of(a) is None and self._aliases_carrying(a):
                    t = "the forward reads a differentiated value's memory without an op (.data, or a view made " \
                        "outside PyTorch's operators)"
                if t is not None:
                    taint = t
                    break
        for a in flat:
            if self._lookup(self.poison, a) is not None:
                self._fail(func, self._lookup(self.poison, a))
        if not named:  # constants only: run it; its result is a constant
            for a in flat:
                if _storage_key(a) in self.written:
                    self._fail(func, "a constant read after a graph op wrote into its storage (a view)")
            out = func(*args, **kwargs)
            rand = op in _RANDOM or any(self._lookup(self.random, a) is not None for a in flat)
            if rand and op in ("_local_scalar_dense", "is_nonzero", "equal"):
                self._warn_branch()
            for o in _leaves(out):
                if isinstance(o, torch.Tensor):
                    if rand:
                        self.random[id(o)] = (weakref.ref(o), True)
                    if taint is not None and o.is_floating_point():
                        self.stopped[id(o)] = (weakref.ref(o), taint)
            return out
        mutable = func._schema.is_mutable
        written = _written(func, args, kwargs) if mutable else []
        if any(_storage_key(t) in self.state_storages for t in written):
            # An in-place write to an input, parameter or buffer (BatchNorm's counter): no graph.
            # The audit goes on: in a forked child the write lands in the child's copy; in this
            # process it must not change the module or the inputs, so it lands in a copy of what it
            # writes (checked before it runs), and the forward goes on with that copy.
            self._fail(func, "an in-place write to an input, parameter or buffer (or a view of one)")
            for t in written:
                i = self.input_storages.get(_storage_key(t))
                if i is not None:
                    self.input_writes.setdefault(i, func._schema.name)
            if not _export._IN_CHILD:
                args, kwargs = _redirected(func, args, kwargs, self.state_storages)
        made = None
        if self.failed is None:
            made, out = self._build(func, op, args, kwargs)
        else:
            out = func(*args, **kwargs)
            if op in _SHAPE_ONLY:
                return out  # a constant (zeros_like...): it carries nothing
        if made is None:  # no graph value for it: keep auditing with placeholder names
            made = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
            if mutable and isinstance(args[0], torch.Tensor) and all(o is not args[0] for o in made):
                self._invalidate_aliases(args[0])
                made.append(args[0])
            for o in made:
                self.bind(o, self.fresh("audit"))
        for t in made:
            name = self.name_of(t)
            if t.is_floating_point() and carrying:
                self.carry.add(name)
                self._remember_carrying(t)
            if taint is not None and t.is_floating_point():  # no gradient flows through the others
                self.tainted[name] = taint
        return out

    def _remember_carrying(self, t):
        self.carry_refs.setdefault(_storage_key(t), []).append(weakref.ref(t))

    def _aliases_carrying(self, t):
        """Whether t (not a graph value) shares memory with a live tensor that carries a gradient."""
        refs = self.carry_refs.get(_storage_key(t))
        return bool(refs) and any(r() is not None and r() is not t for r in refs)

    def _build(self, func, op, args, kwargs):
        """Runs the op and records it by its rule: (the names bound, out). On anything the rule
        cannot take, the capture fails (its reason kept) and (None, out) returns."""
        out = None
        try:
            if not func._schema.name.startswith("aten::"):
                raise NotCaptured(f"the operator {func._schema.name} (not PyTorch's own)")
            if op == "_local_scalar_dense" or op == "equal" or op == "is_nonzero":
                raise NotCaptured("the forward reads a tensor value into Python (.item(), a branch on a tensor)")
            if op in _SHAPE_ONLY:
                return [], func(*args, **kwargs)  # a constant: it depends only on the shape
            rule = _RULES.get(op)
            if rule is None or func._overloadname.startswith("out"):
                raise NotCaptured(f"no capture rule for aten::{op}.{func._overloadname}")
            out = func(*args, **kwargs)
            made = rule(self, out, *args, **kwargs)
        except NotCaptured as ex:
            self._fail(func, ex)
            return None, (out if out is not None else func(*args, **kwargs))
        if isinstance(made, _ViewWrite):  # a write through a view: its base has a new value too
            self._invalidate_aliases(args[0], keep=made.base)
            self.bind(made.base, made.base_name)
            self.bind(args[0], made.name)
            return [args[0], made.base], out
        if func._schema.is_mutable:  # the written tensor holds a new value; other views are stale
            self._invalidate_aliases(args[0])
            self.bind(args[0], made if isinstance(made, str) else made[0])
            return [args[0]], out
        outs = out if isinstance(out, (tuple, list)) else [out]
        if isinstance(made, str):
            made = [made]
        bound = []
        for o, name in zip(outs, made):
            if isinstance(o, torch.Tensor) and name:
                self.bind(o, name)
                bound.append(o)
        for o in outs[len(made):]:
            if isinstance(o, torch.Tensor):
                self.poison[id(o)] = (weakref.ref(o), f"aten::{op} output not captured")
        return bound, out

    def _warn_branch(self):
        """A Python branch on a random number (LayerDrop's `torch.rand([]) < p`): graft replays the
        branch this call took, as the exporter's trace does; said once per place, as _export says it."""
        import os
        import traceback
        skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
        for fr in reversed(traceback.extract_stack()):
            if not os.path.abspath(fr.filename).startswith(skip):
                where = (fr.filename, fr.lineno)
                if where not in self._branches:
                    self._branches.add(where)
                    self.warnings.append((
                        f"{self.module_name}: the forward branches on a random number ({fr.filename}:{fr.lineno}); "
                        "graft replays the branch this call took on every call with these input shapes (eager "
                        "draws it anew each call). If the branch matters (LayerDrop with p > 0), keep this "
                        "module in eager mode.", None, None, None))
                return

    def _invalidate_aliases(self, t, keep=None):
        key = _storage_key(t)
        self.written[key] = t
        for tid, (ref, name) in list(self.names.items()):
            o = ref()
            if o is None or o is t or o is keep:
                continue
            if _storage_key(o) == key and _overlap(t, o):
                if name in self.state_names:
                    raise NotCaptured("an in-place write through a view of an input, parameter or buffer")
                self.names.pop(tid, None)
                self.poison[tid] = (ref, "a value read after an in-place write through another view of it")
        for o in self.const_refs:
            if o is not t and o is not keep and _storage_key(o) == key and _overlap(t, o):
                raise NotCaptured("an in-place write into a constant another op read")


def _overlap(a, b):
    """Whether two views of one storage share an element (chunks of one tensor do not)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    n = max(a.storage_offset() + sum((s - 1) * st for s, st in zip(a.shape, a.stride())),
            b.storage_offset() + sum((s - 1) * st for s, st in zip(b.shape, b.stride()))) + 1
    mask = torch.zeros(n, dtype=torch.bool)
    mask.as_strided(a.shape, a.stride(), a.storage_offset()).fill_(True)
    return bool(mask.as_strided(b.shape, b.stride(), b.storage_offset()).any())


def _write_slots(func):
    """(position, name) of each argument an op writes in place (its schema's `a!` arguments)."""
    return [(i, spec.name) for i, spec in enumerate(func._schema.arguments)
            if spec.alias_info is not None and spec.alias_info.is_write]


def _written(func, args, kwargs):
    """The tensors an op writes in place."""
    out = []
    for i, name in _write_slots(func):
        v = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in _leaves(v) if isinstance(t, torch.Tensor))
    return out


def _redirected(func, args, kwargs, storages):
    """args and kwargs with each tensor the op writes in place that lies in one of `storages`
    replaced by a copy of it."""
    def swap(v):
        if isinstance(v, torch.Tensor):
            return v.clone() if _storage_key(v) in storages else v
        if isinstance(v, (list, tuple)):
            return type(v)(swap(x) for x in v)
        return v
    args, kwargs = list(args), dict(kwargs)
    for i, name in _write_slots(func):
        if i < len(args):
            args[i] = swap(args[i])
        elif name in kwargs:
            kwargs[name] = swap(kwargs[name])
    return tuple(args), kwargs


def _storage_key(t):
    try:
        return t.untyped_storage().data_ptr()
    except AttributeError:
        return t.storage().data_ptr()


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    else:
        yield x


# --- the rules: (recorder, out, *aten args) -> output name(s) ---------------------------------
_RULES = {}


def rule(*names):
    def reg(fn):
        for n in names:
            _RULES[n] = fn
        return fn
    return reg


def _axis(d, rank):
    return d + rank if d < 0 else d


def _binary(onnx_op):
    def fn(r, out, a, b, alpha=1):
        dt = out.dtype
        x, y = _operands(r, out, a, b, dtype=dt)
        if alpha != 1:
            y = r.emit("Mul", [y, r.v(alpha, dt)])
        return r.emit(onnx_op, [x, y])
    return fn


for _n, _o in (("add", "Add"), ("add_", "Add"), ("sub", "Sub"), ("sub_", "Sub"), ("mul", "Mul"), ("mul_", "Mul"),
               ("minimum", "Min"), ("maximum", "Max")):
    _RULES[_n] = _binary(_o)


@rule("div", "div_")
def _div(r, out, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise NotCaptured("div with a rounding mode")
    return r.emit("Div", _operands(r, out, a, b, dtype=out.dtype))


@rule("rsub")
def _rsub(r, out, a, b, alpha=1):
    dt = out.dtype
    x = r.v(a, dt)
    if alpha != 1:
        x = r.emit("Mul", [x, r.v(alpha, dt)])
    return r.emit("Sub", [r.v(b, dt), x])


def _unary(onnx_op):
    def fn(r, out, a):
        return r.emit(onnx_op, [r.v(a)])
    return fn


for _n, _o in (("neg", "Neg"), ("tanh", "Tanh"), ("tanh_", "Tanh"), ("sigmoid", "Sigmoid"),
               ("sigmoid_", "Sigmoid"), ("relu", "Relu"), ("relu_", "Relu"), ("abs", "Abs"), ("log", "Log"),
               ("exp", "Exp"), ("sqrt", "Sqrt"), ("reciprocal", "Reciprocal"), ("erf", "Erf")):
    _RULES[_n] = _unary(_o)


@rule("silu", "silu_")
def _silu(r, out, a):  # x * sigmoid(x): graft's importer makes it one Silu (autodiff/rewrite.cpp)
    x = r.v(a)
    return r.emit("Mul", [x, r.emit("Sigmoid", [x])])


@rule("rsqrt")
def _rsqrt(r, out, a):
    return r.emit("Reciprocal", [r.emit("Sqrt", [r.v(a)])])


@rule("gelu", "gelu_")
def _gelu(r, out, a, approximate="none"):
    return r.emit("Gelu", [r.v(a)], attrs=[("approximate", "s", approximate)])


@rule("pow")
def _pow(r, out, a, b):
    if not isinstance(a, torch.Tensor):
        raise NotCaptured("pow of a number by a tensor")
    return r.emit("Pow", [r.v(a), r.v(b, out.dtype) if isinstance(b, torch.Tensor) else r.v(float(b), out.dtype)])


@rule("clone", "alias", "lift_fresh", "detach", "contiguous")  # detach: of integers only (above)
def _same(r, out, a, **kw):
    return r.v(a)


@rule("_to_copy")
def _to_copy(r, out, a, dtype=None, **kw):
    if dtype is None or dtype == a.dtype:
        return r.v(a)
    return r.v(a, dtype)


@rule("where")
def _where(r, out, c, a, b):
    c = r.v(c, torch.bool)
    x, y = _operands(r, out, a, b, dtype=out.dtype)
    return r.emit("Where", [c, x, y])


@rule("masked_fill", "masked_fill_")
def _masked_fill(r, out, a, mask, value):
    if mask.dtype != torch.bool:
        raise NotCaptured("masked_fill with a mask that is not bool")
    x, m = _operands(r, out, a, mask)
    return r.emit("Where", [m, r.v(value, out.dtype), x])


def _compare(onnx_op, negate=False):
    def fn(r, out, a, b):
        dt = torch.result_type(a, b)
        y = r.emit(onnx_op, [r.v(a, dt), r.v(b, dt)])
        return r.emit("Not", [y]) if negate else y
    return fn


for _n, _o, _neg in (("eq", "Equal", False), ("ne", "Equal", True), ("lt", "Less", False),
                     ("le", "LessOrEqual", False), ("gt", "Greater", False), ("ge", "GreaterOrEqual", False)):
    _RULES[_n] = _compare(_o, _neg)


# shapes
@rule("view", "_unsafe_view", "_reshape_alias", "reshape", "flatten")
def _reshape(r, out, a, *rest, **kw):
    return r.emit("Reshape", [r.v(a), r.ints(out.shape)])


@rule("t", "transpose", "transpose_")
def _transpose(r, out, a, d0=0, d1=1):
    rank = a.dim()
    if rank < 2:
        return r.v(a)
    perm = list(range(rank))
    d0, d1 = _axis(d0, rank), _axis(d1, rank)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return r.emit("Transpose", [r.v(a)], attrs=[("perm", "I", perm)])


@rule("permute")
def _permute(r, out, a, dims):
    return r.emit("Transpose", [r.v(a)], attrs=[("perm", "I", [_axis(d, a.dim()) for d in dims])])


@rule("unsqueeze", "unsqueeze_")
def _unsqueeze(r, out, a, d):
    return r.emit("Unsqueeze", [r.v(a), r.ints([_axis(d, a.dim() + 1)])])


@rule("squeeze", "squeeze_")
def _squeeze(r, out, a, d=None):
    if d is None:
        axes = [i for i, s in enumerate(a.shape) if s == 1]
    else:
        ds = d if isinstance(d, (list, tuple)) else [d]
        axes = [_axis(x, a.dim()) for x in ds if a.shape[_axis(x, a.dim())] == 1]
    if not axes:
        return r.v(a)
    return r.emit("Squeeze", [r.v(a), r.ints(axes)])


@rule("expand")
def _expand(r, out, a, size, implicit=False):
    if tuple(out.shape) == tuple(a.shape):
        return r.v(a)  # a view of the same shape: the same value
    return r.emit("Expand", [r.v(a), r.ints(out.shape)])


def _operands(r, out, *xs, dtype=None):
    """The graph values of an elementwise op's operands; an operand that is an Expand (eager: a
    broadcast view, no memory) is read unexpanded where broadcasting gives the output its shape
    anyway, so that graft does not materialize (and keep) the expanded copy."""
    names = [r.v(x, dtype) for x in xs]
    shapes = [list(x.shape) if isinstance(x, torch.Tensor) else [] for x in xs]
    for i, n in enumerate(names):
        prod = r.producer.get(n)
        if prod is None or prod[0] != "Expand":
            continue
        src = r.shapes.get(prod[1][0])
        if src is None:
            continue
        trial = shapes[:i] + [src] + shapes[i + 1:]
        try:
            if list(torch.broadcast_shapes(*[torch.Size(t) for t in trial])) == list(out.shape):
                names[i], shapes[i] = prod[1][0], src
        except RuntimeError:
            pass
    return names


@rule("slice")
def _slice(r, out, a, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, a.dim())
    n = a.shape[dim]
    start = 0 if start is None else start
    end = n if end is None else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if start == 0 and end == n and step == 1:
        return r.v(a)
    return r.emit("Slice", [r.v(a), r.ints([start]), r.ints([end]), r.ints([dim]), r.ints([step])])


@rule("select")
def _select(r, out, a, dim, index):
    dim = _axis(dim, a.dim())
    index = index + a.shape[dim] if index < 0 else index
    return r.emit("Gather", [r.v(a), r.v(torch.tensor(index, dtype=torch.int64))], attrs=[("axis", "i", dim)])


@rule("unbind")
def _unbind(r, out, a, dim=0):
    return [_select(r, None, a, dim, i) for i in range(a.shape[_axis(dim, a.dim())])]


@rule("split", "unsafe_split", "split_with_sizes", "unsafe_split_with_sizes")
def _split(r, out, a, sizes, dim=0):
    dim = _axis(dim, a.dim())
    sizes = [o.shape[dim] for o in out]
    return r.emit("Split", [r.v(a), r.ints(sizes)], attrs=[("axis", "i", dim)], nout=len(sizes))


@rule("cat")
def _cat(r, out, ts, dim=0):
    ts = [t for t in ts if not (t.dim() == 1 and t.shape[0] == 0)]
    return r.emit("Concat", [r.v(t, out.dtype) for t in ts], attrs=[("axis", "i", _axis(dim, out.dim()))])


@rule("stack")
def _stack(r, out, ts, dim=0):
    d = _axis(dim, out.dim())
    parts = [r.emit("Unsqueeze", [r.v(t, out.dtype), r.ints([d])]) for t in ts]
    return r.emit("Concat", parts, attrs=[("axis", "i", d)])


@rule("repeat")
def _repeat(r, out, a, reps):
    x = r.v(a)
    extra = len(reps) - a.dim()
    if extra > 0:
        x = r.emit("Reshape", [x, r.ints([1] * extra + list(a.shape))])
    return r.emit("Tile", [x, r.ints(reps)])


def _trilu_rule(upper):
    def fn(r, out, a, diagonal=0):
        return r.emit("Trilu", [r.v(a), r.v(torch.tensor(diagonal, dtype=torch.int64))],
                      attrs=[("upper", "i", upper)])
    return fn


_RULES["triu"], _RULES["tril"] = _trilu_rule(1), _trilu_rule(0)


class _ViewWrite:
    """What a rule that writes through a view returns: the view's new value and its base's."""
    def __init__(self, name, base, base_name):
        self.name, self.base, self.base_name = name, base, base_name


def _write(r, dst, src_name):
    """dst (a tensor or a view of one) := src_name (already dst's shape and dtype). A whole tensor
    takes the new value; a view that is a block of its base along one axis (a slice with step 1, or
    a select) makes the base's new value a Concat of the base's parts around it."""
    base = dst._base
    if base is None:
        return src_name
    if base._base is not None or dst.storage_offset() < base.storage_offset():
        raise NotCaptured("an in-place write through a view of a view")
    bs, bst = list(base.shape), list(base.stride())
    ds, dst_st = list(dst.shape), list(dst.stride())
    off = dst.storage_offset() - base.storage_offset()
    block = None
    if len(ds) == len(bs) and dst_st == bst:
        diff = [i for i in range(len(bs)) if ds[i] != bs[i]]
        if len(diff) <= 1:
            d = diff[0] if diff else 0
            if bst[d] and off % bst[d] == 0 and off // bst[d] + ds[d] <= bs[d]:
                block, value = (d, off // bst[d], off // bst[d] + ds[d]), src_name
            elif off == 0 and not diff:
                return _ViewWrite(src_name, base, src_name)
    elif len(ds) == len(bs) - 1:
        for d in range(len(bs)):  # a select: base.select(d, i)
            if bs[:d] + bs[d + 1:] == ds and bst[:d] + bst[d + 1:] == dst_st and bst[d] and off % bst[d] == 0:
                i = off // bst[d]
                if i < bs[d]:
                    block, value = (d, i, i + 1), r.emit("Unsqueeze", [src_name, r.ints([d])])
                break
    if block is None or not base.is_contiguous():
        raise NotCaptured("an in-place write through a view other than a block of one axis")
    d, start, end = block
    parts = []
    bname = r.v(base)
    if start > 0:
        parts.append(r.emit("Slice", [bname, r.ints([0]), r.ints([start]), r.ints([d]), r.ints([1])]))
    parts.append(value)
    if end < bs[d]:
        parts.append(r.emit("Slice", [bname, r.ints([end]), r.ints([bs[d]]), r.ints([d]), r.ints([1])]))
    new_base = r.emit("Concat", parts, attrs=[("axis", "i", d)]) if len(parts) > 1 else parts[0]
    return _ViewWrite(src_name, base, new_base)


@rule("copy_")
def _copy(r, out, dst, src, non_blocking=False):
    x = r.v(src, dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        x = r.emit("Expand", [x, r.ints(dst.shape)])
    return _write(r, dst, x)


@rule("fill_")
def _fill(r, out, dst, value):
    x = r.v(value, dst.dtype)
    return _write(r, dst, r.emit("Expand", [x, r.ints(dst.shape)]))


# linear algebra
@rule("mm", "bmm", "matmul")
def _mm(r, out, a, b):
    return r.emit("MatMul", [r.v(a), r.v(b)])


@rule("addmm")
def _addmm(r, out, bias, a, b, beta=1, alpha=1):
    attrs = [("alpha", "f", float(alpha)), ("beta", "f", float(beta))]
    bn = r.v(b)
    prod = r.producer.get(bn)
    if prod is not None and prod[0] == "Transpose" and b.dim() == 2:  # x @ W.t(): Gemm(transB)
        attrs.append(("transB", "i", 1))
        bn = prod[1][0]
    return r.emit("Gemm", [r.v(a), bn, r.v(bias)], attrs=attrs)


@rule("baddbmm")
def _baddbmm(r, out, c, a, b, beta=1, alpha=1):
    y = r.emit("MatMul", [r.v(a), r.v(b)])
    if alpha != 1:
        y = r.emit("Mul", [y, r.v(float(alpha), out.dtype)])
    if beta == 0:
        return y
    cc = r.v(c)
    if beta != 1:
        cc = r.emit("Mul", [cc, r.v(float(beta), out.dtype)])
    return r.emit("Add", [y, cc])


# reductions
@rule("mean")
def _mean(r, out, a, dims=None, keepdim=False, dtype=None):
    if dtype is not None:
        raise NotCaptured("mean with a dtype")
    axes = list(range(a.dim())) if not dims else [_axis(d, a.dim()) for d in dims]
    return r.emit("ReduceMean", [r.v(a)], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])


@rule("sum")
def _sum(r, out, a, dims=None, keepdim=False, dtype=None):
    if dtype is not None and dtype != a.dtype:
        raise NotCaptured("sum with a dtype")
    axes = list(range(a.dim())) if not dims else [_axis(d, a.dim()) for d in dims]
    return r.emit("ReduceSum", [r.v(a), r.ints(axes)], attrs=[("keepdims", "i", int(keepdim))])


@rule("amax")
def _amax(r, out, a, dims=(), keepdim=False):
    axes = list(range(a.dim())) if not dims else [_axis(d, a.dim()) for d in dims]
    return r.emit("ReduceMax", [r.v(a)], attrs=[("axes", "I", axes), ("keepdims", "i", int(keepdim))])


def _arg_rule(onnx_op):
    def fn(r, out, a, dim=None, keepdim=False):
        x = r.v(a)
        if dim is None:
            return r.emit(onnx_op, [r.emit("Reshape", [x, r.ints([-1])])], attrs=[("axis", "i", 0), ("keepdims", "i", 0)])
        return r.emit(onnx_op, [x], attrs=[("axis", "i", _axis(dim, a.dim())), ("keepdims", "i", int(keepdim))])
    return fn


_RULES["argmax"], _RULES["argmin"] = _arg_rule("ArgMax"), _arg_rule("ArgMin")


@rule("cumsum")
def _cumsum(r, out, a, dim, dtype=None):
    x = r.v(a, out.dtype)
    return r.emit("CumSum", [x, r.v(torch.tensor(_axis(dim, a.dim()), dtype=torch.int64))])


# nn
@rule("_softmax")
def _softmax(r, out, a, dim, half_to_float=False):
    return r.emit("Softmax", [r.v(a)], attrs=[("axis", "i", _axis(dim, a.dim()))])


@rule("_log_softmax")
def _log_softmax(r, out, a, dim, half_to_float=False):
    return r.emit("LogSoftmax", [r.v(a)], attrs=[("axis", "i", _axis(dim, a.dim()))])


@rule("native_layer_norm")
def _layer_norm(r, out, x, shape, w, b, eps):
    if w is None or b is None:
        raise NotCaptured("layer_norm without an affine weight and bias")
    return r.emit("LayerNormalization", [r.v(x), r.v(w), r.v(b)],
                  attrs=[("axis", "i", x.dim() - len(shape)), ("epsilon", "f", float(eps))])


@rule("embedding")
def _embedding(r, out, w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        raise NotCaptured("embedding with scale_grad_by_freq or sparse")
    attrs = [("axis", "i", 0)]
    if padding_idx is not None and padding_idx >= 0:
        attrs.append(("padding_idx", "i", int(padding_idx)))
    return r.emit("Gather", [r.v(w), r.v(idx)], attrs=attrs)


@rule("index")
def _index(r, out, a, indices):
    if len(indices) != 1 or indices[0] is None or indices[0].dtype != torch.int64:
        raise NotCaptured("advanced indexing other than one int64 index tensor on the first axis")
    return r.emit("Gather", [r.v(a), r.v(indices[0])], attrs=[("axis", "i", 0)])


@rule("convolution")
def _convolution(r, out, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise NotCaptured("transposed convolution")
    ins = [r.v(x), r.v(w)] + ([r.v(b)] if b is not None else [])
    k = w.dim() - 2
    return r.emit("Conv", ins, attrs=[("strides", "I", list(stride)), ("pads", "I", list(padding) * 2),
                                      ("dilations", "I", list(dilation)), ("group", "i", int(groups)),
                                      ("kernel_shape", "I", list(w.shape[2:2 + k]))])


@rule("nll_loss_forward")
def _nll_loss(r, out, logp, target, weight, reduction, ignore_index):
    if weight is not None:
        raise NotCaptured("nll_loss with class weights")
    name = r.v(logp)
    prod = r.producer.get(name)
    if prod is None or prod[0] != "LogSoftmax" or dict((a[0], a[2]) for a in prod[2]).get("axis") != 1:
        raise NotCaptured("nll_loss of something other than log_softmax over axis 1")
    red = {0: "none", 1: "mean", 2: "sum"}[reduction]
    loss = r.emit("SoftmaxCrossEntropyLoss", [prod[1][0], r.v(target)],
                  attrs=[("reduction", "s", red), ("ignore_index", "i", int(ignore_index))])
    return [loss]  # total_weight (output 1) is not captured: reading it is refused


# --- nn.LSTM / nn.GRU, captured whole ----------------------------------------------------------
# Below autograd PyTorch runs an RNN as its cell's ops, step by step; graft has fused LSTM and GRU
# ops (their ONNX definitions) whose backward keeps only what eager's keeps per step. So an
# nn.LSTM / nn.GRU is captured as one ONNX LSTM / GRU node per layer, as torch.onnx.export writes
# it: the gate blocks reordered (PyTorch i f g o -> ONNX i o f c; r z n -> z r h), the biases
# concatenated, GRU with linear_before_reset (PyTorch's formula). The module's own forward computes
# the values, unrecorded.
_GATES = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2)}  # ONNX's gate order, as indices of PyTorch's blocks


def _rnn_forward(r, mod, orig):
    kind = mod.mode
    dirs = 2 if mod.bidirectional else 1
    H = mod.hidden_size

    def reorder(w):
        name = r.v(w)
        blocks = [r.emit("Slice", [name, r.ints([g * H]), r.ints([(g + 1) * H]), r.ints([0]), r.ints([1])])
                  for g in _GATES[kind]]
        return r.emit("Concat", blocks, attrs=[("axis", "i", 0)])

    def per_dir(names):
        parts = [r.emit("Unsqueeze", [n, r.ints([0])]) for n in names]
        return r.emit("Concat", parts, attrs=[("axis", "i", 0)]) if len(parts) > 1 else parts[0]

    def forward(input, hx=None):
        states = [] if hx is None else list(hx) if isinstance(hx, tuple) else [hx]
        if (not isinstance(input, torch.Tensor) or input.dim() != 3 or r.name_of(input) is None
                or any(not isinstance(h, torch.Tensor) or r.name_of(h) is None for h in states)):
            return orig(input, hx)  # packed, unbatched or constant input: the step-by-step rules
        r.suppress += 1
        try:
            out = orig(input, hx)
        finally:
            r.suppress -= 1
        T, B = (input.shape[1], input.shape[0]) if mod.batch_first else (input.shape[0], input.shape[1])
        x = r.v(input)
        if mod.batch_first:
            x = r.emit("Transpose", [x], attrs=[("perm", "I", [1, 0, 2])])
        zeros = None
        finals = [[] for _ in range(2 if kind == "LSTM" else 1)]
        for layer in range(mod.num_layers):
            ws, rs, bs = [], [], []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                ws.append(reorder(getattr(mod, "weight_ih" + sfx)))
                rs.append(reorder(getattr(mod, "weight_hh" + sfx)))
                if mod.bias:
                    bs.append(r.emit("Concat", [reorder(getattr(mod, "bias_ih" + sfx)),
                                                reorder(getattr(mod, "bias_hh" + sfx))], attrs=[("axis", "i", 0)]))
            ins = [x, per_dir(ws), per_dir(rs), per_dir(bs) if bs else "", ""]
            for k in range(len(finals)):
                if states:
                    lo = layer * dirs
                    ins.append(r.emit("Slice", [r.v(states[k]), r.ints([lo]), r.ints([lo + dirs]), r.ints([0]),
                                                r.ints([1])]))
                else:
                    if zeros is None:
                        zeros = r.v(torch.zeros(dirs, B, H, dtype=input.dtype))
                    ins.append(zeros)
            attrs = [("hidden_size", "i", H), ("direction", "s", "bidirectional" if dirs == 2 else "forward")]
            if kind == "GRU":
                attrs.append(("linear_before_reset", "i", 1))
            y, *hs = r.emit(kind, ins, attrs=attrs, nout=1 + len(finals))
            for k, h in enumerate(hs):
                finals[k].append(h)
            y = r.emit("Transpose", [y], attrs=[("perm", "I", [0, 2, 1, 3])])  # [T, dirs, B, H] -> [T, B, dirs, H]
            x = r.emit("Reshape", [y, r.ints([T, B, dirs * H])])
        if mod.batch_first:
            x = r.emit("Transpose", [x], attrs=[("perm", "I", [1, 0, 2])])
        cat = [r.emit("Concat", f, attrs=[("axis", "i", 0)]) if len(f) > 1 else f[0] for f in finals]
        output, state = out
        r.bind(output, x)
        if kind == "LSTM":
            r.bind(state[0], cat[0])
            r.bind(state[1], cat[1])
        else:
            r.bind(state, cat[0])
        return out

    return forward


def _patch_rnns(r, module):
    """Patches every nn.LSTM / nn.GRU the capture takes whole (above); returns them (undo: del
    m.forward)."""
    patched = []
    for m in module.modules():
        if (type(m) in (torch.nn.LSTM, torch.nn.GRU) and getattr(m, "proj_size", 0) == 0
                and "forward" not in m.__dict__ and (m.num_layers == 1 or m.dropout == 0 or not m.training)):
            m.forward = _rnn_forward(r, m, m.forward)
            patched.append(m)
    return patched


# --- the driver -------------------------------------------------------------------------------

def _refuse_early(module):
    """What the capture never takes, checked before the forward runs (no side effects yet)."""
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        raise NotCaptured("global forward hooks")
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None):
            raise NotCaptured(f"forward hooks on {type(m).__name__}")
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training:
            raise NotCaptured("training-mode BatchNorm")
        if isinstance(m, (torch.nn.RNNBase,)) and m.training and m.dropout > 0:
            raise NotCaptured("RNN dropout")
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise NotCaptured("training-mode Dropout")


# The module state (parameters and buffers) from which the default capture runs in a forked child
# rather than here (Note [graft's own capture], "Where it runs").
CHILD_FROM_BYTES = 64 << 20


def runs_here(module) -> bool:
    """Where GRAFT_EXPORT=capture runs the capture: here, unless the graph is known to fail before
    the forward runs (_refuse_early: only the audit would run, and the exporter after it, in a
    child anyway) or the module's state is CHILD_FROM_BYTES or more."""
    try:
        _refuse_early(module)
    except NotCaptured:
        return False
    return sum(t.numel() * t.element_size() for _, t in _state(module)) < CHILD_FROM_BYTES


def _state(module):
    """(name, tensor) of each of the module's parameters and buffers, each tensor once."""
    seen, out = set(), []
    for n, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((n, t))
    return out


def _reference(outs):
    """What the first call's check keeps of each output: its shape, dtype and a strided sample of
    at most _SAMPLE elements (the whole output when it is that small), as an array of Python's
    array module: the parent compares them in Python, without running kernels of PyTorch's that
    eager never runs (their code pages would stay in the training process)."""
    ref = []
    for t in outs:
        stride = max(1, -(-t.numel() // _SAMPLE))
        ref.append((tuple(t.shape), str(t.dtype), stride, _sample(t, stride)))
    return ref


# dtype: (ctypes type, array typecode)
_CTYPES = {"torch.float32": ("c_float", "f"), "torch.float64": ("c_double", "d"), "torch.int64": ("c_int64", "q"),
           "torch.int32": ("c_int32", "i"), "torch.bool": ("c_bool", "B")}


def _sample(t, stride):
    """Every stride-th element of t (in row-major order), in an array.array, read from its memory
    with ctypes: no PyTorch kernel runs (slicing, tolist and the like map code pages that eager
    never maps into the training process; measured on the B=64 H=256 L=12 stack: 0.6 MiB), and
    4 or 8 bytes an element rather than a Python number's 32."""
    import array
    import ctypes
    if not t.is_contiguous():
        t = t.contiguous()
    kind, code = _CTYPES[str(t.dtype)]
    kind = getattr(ctypes, kind)
    base, size = t.data_ptr(), ctypes.sizeof(kind)
    return array.array(code, (kind.from_address(base + i * size).value for i in range(0, t.numel(), stride)))


def matches(ref, outs, loose=False):
    """Whether graft's outputs agree with the capture's reference: integers and bools exactly,
    floats to 1e-3 (5e-2 with loose: bfloat16 matrix products) of the sample's largest magnitude,
    NaN where it was NaN."""
    tol = 5e-2 if loose else 1e-3
    if len(ref) != len(outs):
        return False
    for (shape, dtype, stride, want), t in zip(ref, outs):
        if tuple(t.shape) != shape or str(t.dtype) != dtype:
            return False
        got = _sample(t, stride)
        if len(got) != len(want):
            return False
        if not dtype.startswith("torch.float"):
            if got != want:
                return False
            continue
        finite = [abs(w) for w in want if w == w and abs(w) != float("inf")]
        bound = tol * (max(finite) if finite else 0.0) + 1e-6
        for g, w in zip(got, want):
            if w != w or abs(w) == float("inf"):
                if not (g != g if w != w else g == w):
                    return False
            elif not abs(g - w) <= bound + tol * abs(w):
                return False
    return True


def capture(module, args, kwargs, tensors, path, opset, name):
    """Captures module(*args, **kwargs) and writes the graph to `path`. Returns (Exported with
    its Graph, reference for the first call's check). Raises StopsGradient (the audit: the forward
    stops a gradient) or NotCaptured (anything else it cannot take)."""
    r = _Recorder()
    r.module_name = name
    try:
        _refuse_early(module)
    except NotCaptured as why:
        r.failed = str(why)  # no graph; the forward still runs for the audit
    input_names = [f"input_{i}" for i in range(len(tensors))]
    for i, (t, n) in enumerate(zip(tensors, input_names)):
        r.add_input(t, n)
        r.input_storages.setdefault(_storage_key(t), i)
    state = []
    for n, p in _state(module):
        if r.name_of(p) is not None:
            raise NotCaptured("a call tensor that is also a parameter or buffer")
        r.add_input(p, _export.PREFIX + n)
        state.append((p, _export.PREFIX + n, n))
    rng = torch.get_rng_state()
    versions = [(p, p._version) for p, _, _ in state]
    # In this process, a buffer the forward updates in place without saying so in its schema
    # (BatchNorm's running statistics) is put back afterwards, as the exporter does.
    buffers = [] if _export._IN_CHILD else [(b, b.detach().clone(), b._version) for b in module.buffers()]
    patched = _patch_rnns(r, module) if r.failed is None else []
    try:
        # Gradients on (so that a torch.no_grad block or a custom autograd.Function in the forward
        # is seen, below), but nothing saved for a backward that never runs: memory as no_grad's.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _drop), \
                torch.autocast("cpu", enabled=False), r:
            a, kw = _flatten.rebuild((args, kwargs), iter(tensors))
            out = module(*a, **kw)
    except NotCaptured:
        raise
    except Exception as ex:  # noqa: BLE001
        if r.failed is not None:
            raise NotCaptured(r.failed, r.input_writes.items()) from None
        raise NotCaptured(f"the forward raised {type(ex).__name__} under the capture: {ex}",
                          r.input_writes.items()) from ex
    finally:
        for m in patched:
            del m.forward
        torch.set_rng_state(rng)
        with torch.no_grad():
            for b, before, version in buffers:
                if b._version != version:
                    b.copy_(before)
                elif not torch.equal(b, before):  # written without a version bump (BatchNorm's statistics)
                    b.data.copy_(before)
        del buffers
    # The forward has run: its code pages go (Note [code pages read once]) before the graph is written.
    _export.release_code_pages()
    leaves = _flatten.flatten_outputs(out)
    custom = _custom_function(leaves)
    if custom:
        raise StopsGradient(f"the forward calls a custom torch.autograd.Function ({custom}): graft would "
                            "differentiate the ops of its forward instead of running its backward")
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and r.name_of(t) in r.tainted:
            raise StopsGradient(r.tainted[r.name_of(t)] + ", and graft's backward differentiates every op (the "
                                "gradient would flow where eager's stops)")
    if r.failed is not None:
        raise NotCaptured(r.failed, r.input_writes.items())
    if any(p._version != v for p, v in versions):
        raise NotCaptured("the forward wrote to a parameter or buffer")
    outputs, out_names, used = [], [], set()
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor):
            raise NotCaptured("a non-tensor output")
        r.check_readable(t)
        nm = r.name_of(t)
        if nm is None:
            raise NotCaptured("an output that does not depend on the inputs or parameters")
        if nm in used or nm in r.state_names:
            nm = r.emit("Identity", [nm])
        used.add(nm)
        oname = f"output_{i}"
        r.nodes.append(("Identity", "", f"out_{i}", [nm], [oname], []))
        outputs.append((oname, _elem(t, f"output {i}"), list(t.shape)))
        out_names.append(oname)
    nodes = _live_nodes(r.nodes, set(out_names))
    read = {i for n in nodes for i in n[3]}
    ins = []
    e = _export.Exported(path=path, input_names=[], input_index=[])
    for i, (t, n) in enumerate(zip(tensors, input_names)):
        if n in read:
            ins.append((n, _elem(t, f"input {i}"), list(t.shape)))
            e.input_names.append(n)
            e.input_index.append(i)
    for p, g, sname in state:
        if g in read:
            ins.append((g, _elem(p, f"parameter '{sname}'"), list(p.shape)))
            e.params.append((g, sname))
    from . import _graft
    _graft.write_onnx_graph(path, opset, ins, outputs,
                            [(op, dom, nm, i, o, attrs) for op, dom, nm, i, o, attrs in nodes])
    e.output_names = out_names
    e.output_template = _flatten.rebuild(out, iter([torch.empty(0) for _ in leaves]))
    e.has_dropout = False
    e.warnings = list(r.warnings)
    # The graph as read_onnx_graph would give it back (nodes with their integer attributes), from
    # what was just written rather than by parsing the file again.
    e.model = _export.Graph(ins, outputs, [(op, nm, list(i), list(o), {a: v for a, k, v in attrs if k == "i"})
                                           for op, _, nm, i, o, attrs in nodes])
    ref = _reference(leaves)
    del out, leaves, r
    return e, ref


def _drop(_):
    return None


def _custom_function(outs):
    """The name of a custom torch.autograd.Function in the outputs' autograd graph, or None:
    graft would differentiate its forward's ops instead of running its backward."""
    seen, stack = set(), [t.grad_fn for t in outs if isinstance(t, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            return type(node).__name__
        stack.extend(f for f, _ in node.next_functions)
    return None


def _live_nodes(nodes, outputs):
    """The nodes the outputs depend on, in order (dead rules' nodes, like a Transpose Gemm took
    over, are dropped)."""
    need = set(outputs)
    keep = []
    for n in reversed(nodes):
        if any(o in need for o in n[4]):
            keep.append(n)
            need.update(n[3])
    keep.reverse()
    return keep
