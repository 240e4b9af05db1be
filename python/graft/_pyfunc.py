"""Custom torch.autograd.Function inside GraftModule: one opaque graft node (Note [PythonOp]).

Note [PythonOp]
~~~~~~~~~~~~~~~
A custom autograd.Function has a backward of its own (a straight-through estimator, a
memory-saving recompute, BLOOM's GeLU, reentrant torch.utils.checkpoint), so differentiating the
ops of its forward would not give eager's gradients. As ORTModule does with its PythonOp, graft
keeps the Function whole: PyTorch runs its forward and its own backward, graft plans around it.

* Capture: while the forward is traced (_aten.trace), Function.apply of every Function class is
  redirected on the capturing thread (intercept()): the call becomes graft::py_function(tensors,
  key), an op of graft's own whose record (the class, the non-tensor arguments, which tensors
  require grad, the outputs' dtypes and shapes) is kept under `key`. The Function's forward runs
  once outside the trace for those shapes (its value reads and branches are fine: it runs in Python
  every call). The class attribute is restored when the capture ends.
* Graph: the rule for py_function emits graft.PythonOp (src/ops/python_op.cpp); its gradient is
  graft.PythonOpGrad. Neither is folded nor recomputed.
* Run: graft calls runner() for both. In a training call, the forward gets copies of its inputs
  (the Function may save them; graft reuses its buffers) and runs under autograd; its inputs and
  outputs are kept with the call (calls()) until the backward node hands the output gradients to
  torch.autograd.grad, which runs the Function's own backward. PyTorch holds what the Function
  saves; the capture measures it once (_probe: the bytes packed by ctx.save_for_backward) and
  graft's planner counts it from the PythonOp to its PythonOpGrad (attribute saved_bytes).

Note [backward hooks]
~~~~~~~~~~~~~~~~~~~~~
A full backward hook (register_full_backward_hook) or backward pre-hook of a submodule runs in
graft's backward with eager's arguments, as PyTorch's own BackwardHook does it: while the capture
traces (_aten._hook_boundaries), the submodule's positional tensors go in through an identity
PythonOp (side "in", made only when one of them requires grad) and its output tensors come out
through another ("out"); PyTorch's hook dicts are emptied meanwhile, so its own machinery stays out
of the trace. In backward, the "out" node runs the pre-hooks on grad_output (what they return
replaces it) and keeps it in the call's state; the "in" node runs the hooks with grad_input and
that grad_output (what they return replaces grad_input). Where no input requires grad the hooks
run at the "out" node with grad_input all None, as in eager. Gradients reach the hooks as copies (a
hook may keep them). Each boundary costs a copy of the tensors it passes, in the plan like any
other value. The hooks are read from the module at every backward; adding or removing one is a new
capture (their keys are in the cache key). register_backward_hook (deprecated; the gradients of the
module's last op) is refused.
"""
import contextlib
import itertools
import threading

import numpy as np
import torch


_APPLY = torch._C._FunctionBase.__dict__["apply"]  # what Function.apply is, unpatched
_tls = threading.local()
_keys = itertools.count()
_records = {}  # key -> _Record; a capture's records live as long as the process (a few per model)
_lock = threading.Lock()
TRAIN = "__train__"  # in a call's state: does this call keep the Function's graph for backward


def _apply(cls, args):
    return _APPLY.__get__(None, cls)(*args)


class _Record:
    def __init__(self, cls, args, needs):
        self.cls, self.name = cls, f"{cls.__module__}.{cls.__qualname__}"
        self.template = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        self.needs = needs
        self.outputs = []  # (dtype, shape) per output
        self.single = True
        self.saved = 0  # bytes the Function saves for its backward (_probe)

    def rebuild(self, tensors):
        it = iter(tensors)
        return [next(it) if t else a for a, t in zip(self.template, self.is_tensor)]


class _Boundary:
    """Note [backward hooks]: one side of a hooked module call in the graph, an identity PythonOp
    whose backward calls the module's backward hooks. side "in": over the call's positional tensors
    (made only when one of them requires grad); "out": over its output tensors, `pair` naming the
    call's "in" boundary (None when there is none)."""

    def __init__(self, module, path, side, index, n, outputs, pair=None, n_inputs=0):
        import weakref
        self.module = weakref.ref(module)
        self.where = repr(path) if path else "the module itself"
        self.name = f"backward hooks of {self.where} ({side}puts)"
        self.side, self.index, self.n, self.pair, self.n_inputs = side, index, n, pair, n_inputs
        self.outputs = outputs  # (dtype, shape) per tensor passed: the PythonOp's outputs
        self.key = None  # its own key (an "in" boundary's pairs with its "out")

    def packed(self, grads):
        """The hook's tuple: a gradient (or None) per positional argument / output, None where it is
        not a tensor, as eager's BackwardHook packs them."""
        full = [None] * self.n
        for i, g in zip(self.index, grads):
            full[i] = g
        return tuple(full)

    def unpacked(self, got, what, hook):
        """What a hook returned (a tuple, or one gradient) as the tensors' gradients."""
        got = got if isinstance(got, tuple) else (got,)
        if len(got) != self.n:
            raise RuntimeError(f"the backward hook {getattr(hook, '__qualname__', hook)} on {self.where} returned "
                               f"{len(got)} {what} gradients where the module has {self.n}")
        return [got[i] for i in self.index]

    def backward(self, state, grads):
        m = self.module()
        if m is None:
            return grads
        if self.side == "out":
            grad_output = self.packed(grads)
            for hook in list(getattr(m, "_backward_pre_hooks", {}).values()):
                got = hook(m, grad_output)
                if got is not None:
                    grad_output = self.packed(self.unpacked(got, "output", hook))
            if self.pair is None:  # no input requires grad: the hooks run now, grad_input all None
                for hook in list(m._backward_hooks.values()):
                    if hook(m, (None,) * self.n_inputs, grad_output) is not None:
                        raise RuntimeError(f"the backward hook {getattr(hook, '__qualname__', hook)} returned "
                                           "gradients for inputs that require none")
            else:
                state[("hooks", self.pair)] = grad_output
            return [grad_output[i] for i in self.index]
        grad_output = state.pop(("hooks", self.key), None)
        grad_input = self.packed(grads)
        for hook in list(m._backward_hooks.values()):
            got = hook(m, grad_input, grad_output)
            if got is not None:
                grad_input = self.packed(self.unpacked(got, "input", hook))
        return [grad_input[i] for i in self.index]


def boundary(module, path, side, args, pair=None, n_inputs=0):
    """Note [backward hooks]: the positional arguments (side "in") or outputs ("out", a tensor or a
    tuple / list) of a hooked module's call through an identity graft::py_function whose backward
    runs the module's hooks; returns (key, the arguments or outputs with those tensors replaced)."""
    single = isinstance(args, torch.Tensor)
    items = [args] if single else list(args)
    index = [i for i, a in enumerate(items) if isinstance(a, torch.Tensor)]
    tensors = [items[i] for i in index]
    rec = _Boundary(module, path, side, index, len(items), [(t.dtype, tuple(t.shape)) for t in tensors],
                    pair, n_inputs)
    key, outs = _traced(rec, tensors, [t.requires_grad and t.is_floating_point() for t in tensors])
    rec.key = key
    for i, o in zip(index, outs):
        items[i] = o
    return key, (items[0] if single else type(args)(items) if isinstance(args, tuple) else items)


def _outputs(rec, out):
    """The Function's output as a list of tensors (a tensor, or a tuple / list of them)."""
    rec.single = isinstance(out, torch.Tensor)
    flat = [out] if rec.single else list(out) if isinstance(out, (tuple, list)) else None
    if flat is None or not flat or not all(isinstance(o, torch.Tensor) for o in flat):
        from .errors import GraftUnsupportedError
        raise GraftUnsupportedError(
            f"the custom autograd.Function {rec.name} returns {type(out).__name__}; graft runs a Function "
            "that returns tensors (one, or a tuple of them). Keep the submodule that calls it in eager mode.",
            "unsupported")
    return flat


def _no_function_modes():
    """No TorchFunctionMode (the capture's watch) in effect: torch 2.x's DisableTorchFunction turns
    modes off too; torch 1.13's only subclasses, its modes have a switch of their own."""
    off = getattr(torch.overrides, "_no_torch_function_mode", None)
    return off() if torch.__version__.startswith("1.") and off is not None else torch._C.DisableTorchFunction()


@contextlib.contextmanager
def _untraced():
    """Outside the trace: no proxy recording, no TorchFunctionMode, and nn.Module calls as they are
    (torch 1.13's tracer replaces Module.__call__ while it traces, keeping the original in
    torch.fx._symbolic_trace._orig_module_call)."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
    orig = getattr(torch.fx._symbolic_trace, "_orig_module_call", None)
    patched = torch.nn.Module.__call__
    swap = torch.__version__.startswith("1.") and orig is not None and patched is not orig
    if swap:
        torch.nn.Module.__call__ = orig
    try:
        with disable_proxy_modes_tracing(), _no_function_modes():
            yield
    finally:
        if swap:
            torch.nn.Module.__call__ = patched


def _real(xs, key):
    """Inside torch 1.13's trace (which computes on real tensors): zeros of the outputs' shapes
    (the graph only needs the shapes; a value read of them is refused as of any graph value).
    Outside a trace (the capture folding a call on constants only): the Function's forward."""
    rec = _records[key]
    if isinstance(rec, _Boundary):
        return [x.clone() for x in xs]
    if getattr(_tls, "capturing", 0) > 0:
        return [torch.zeros(shape, dtype=dt) for dt, shape in rec.outputs]
    with torch.no_grad():
        return [o.clone() for o in _outputs(rec, _apply(rec.cls, rec.rebuild(list(xs))))]


def _meta(xs, key):
    return [torch.empty(shape, dtype=dt, device="meta") for dt, shape in _records[key].outputs]


def _op():
    """graft::py_function(Tensor[] xs, int key) -> Tensor[]: a Function call in the traced graph."""
    from ._aten import graft_op
    return graft_op("py_function", "py_function(Tensor[] xs, int key) -> Tensor[]",
                    {"CompositeExplicitAutograd": _real, "Meta": _meta})


def _holds_tensor(v):
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return isinstance(v, dict) and any(_holds_tensor(x) for x in v.values())


def _redirected(cls, *args, **kwargs):
    """Function.apply while a capture runs on this thread: the call becomes graft::py_function."""
    if getattr(_tls, "capturing", 0) <= 0 or kwargs:
        return _APPLY.__get__(None, cls)(*args, **kwargs)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    rec = _Record(cls, args, [t.requires_grad and t.is_floating_point() for t in tensors])
    if any(_holds_tensor(a) for a in args if not isinstance(a, torch.Tensor)):
        # kept as a constant of the record, such a tensor would be this trace's at every call
        from .errors import GraftUnsupportedError
        raise GraftUnsupportedError(
            f"the custom autograd.Function {rec.name} is given a tensor inside a list, tuple or dict; graft "
            "passes it tensors as arguments of their own. Pass each tensor as an argument, or keep the submodule "
            "that calls it in eager mode.", "unsupported")
    rec.outputs = _probe(rec, args)
    # as eager's Function outputs: every float output requires grad where an input does
    _, outs = _traced(rec, tensors, [any(rec.needs) and dt.is_floating_point for dt, _ in rec.outputs])
    return outs[0] if rec.single else tuple(outs)


def _traced(rec, tensors, grads):
    """A graft::py_function node in the trace for `rec` (kept under a new key) over `tensors`:
    (key, its outputs), output i requiring grad where grads[i]."""
    with _lock:
        key = next(_keys)
        _records[key] = rec
    # Traced, but not seen by the capture's TorchFunctionMode, which would take outputs that do not
    # require grad (py_function has no autograd kernel) for a stop-gradient; told instead that the
    # outputs come from the graph's values (a value read of one is then refused, as of any other).
    with _no_function_modes():
        outs = _op()(tensors, key)
        for o, grad in zip(outs, grads):
            if grad:
                o.requires_grad_(True)
    watch = getattr(_tls, "watch", None)
    if watch is not None:
        watch._follow(list(outs), tensors, None)
    return key, outs


class FunctionRaised(Exception):
    """The Function's own forward raised during the capture; the capture re-raises `original`."""

    def __init__(self, original):
        super().__init__(str(original))
        self.original = original


@contextlib.contextmanager
def _real_tensors():
    """Plain tensors: outside torch 2.x's fake mode, and torch 1.13's functionalization off."""
    if torch.__version__.startswith("1."):
        torch._disable_functionalization()
        try:
            yield
        finally:
            torch._enable_functionalization(reapply_views=True)
    else:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            yield


def _probe(rec, args):
    """The outputs' (dtype, shape): the Function's forward on real stand-ins of the trace's tensors
    (ones; zeros for integers, valid indices), with the module's real state, outside the trace. A
    Function may read values (fine: it runs in Python every call), which torch 2.x's fake tensors
    turn into unbacked symbols the trace refuses; torch 1.13's trace has no plain tensors.

    Where an input requires grad it runs under autograd, as a training call does, and rec.saved is
    the bytes of what it saves for its backward (every storage packed by ctx.save_for_backward,
    counted once): PyTorch holds them from the forward to the backward, and graft's planner counts
    them there (src/plan/planner.cpp)."""
    saved = {}

    def pack(t):
        try:
            st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            saved.setdefault(st.data_ptr(), st.nbytes())
        except Exception:  # noqa: BLE001: a tensor without storage (sparse, nested) counts none
            pass
        return t

    train = any(rec.needs)
    with _real_tensors(), _untraced(), _real_state(), torch.set_grad_enabled(train):
        real = [(torch.ones if a.is_floating_point() else torch.zeros)(tuple(a.shape), dtype=a.dtype)
                if isinstance(a, torch.Tensor) else a for a in args]
        it = iter(rec.needs)
        real = [r.requires_grad_(next(it)) if isinstance(r, torch.Tensor) else r for r in real]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                flat = _outputs(rec, _apply(rec.cls, real))
        except Exception as ex:  # noqa: BLE001: the Function's own error
            raise FunctionRaised(ex) from ex
        # (read here: the outputs carry the Function's backward node, which the capture's watch,
        # outside, would take for a Function called in the traced forward)
        metas = [(o.dtype, tuple(o.shape)) for o in flat]
        del flat
    rec.saved = sum(saved.values()) if train else 0
    return metas


def _function_classes():
    seen, todo = [], [torch.autograd.Function]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s not in seen:
                seen.append(s)
                todo.append(s)
    return seen


_patch_lock = threading.Lock()
_patched = {}  # class -> how many captures redirect it now


@contextlib.contextmanager
def intercept():
    """Redirects Function.apply (every subclass of torch.autograd.Function) to graft::py_function
    on this thread while a capture traces; other threads see the original."""
    from ._function import GraftFunction
    mine = []
    with _patch_lock:
        for c in _function_classes():
            if c.__module__.startswith("graft.") or issubclass(c, GraftFunction):
                continue
            if c in _patched:
                _patched[c] += 1
            elif "apply" not in c.__dict__:
                c.apply = classmethod(_redirected)
                _patched[c] = 1
            else:
                continue
            mine.append(c)
    _tls.capturing = getattr(_tls, "capturing", 0) + 1
    try:
        yield
    finally:
        _tls.capturing -= 1
        with _patch_lock:
            for c in mine:
                _patched[c] -= 1
                if not _patched[c]:
                    del _patched[c]
                    del c.apply


@contextlib.contextmanager
def watched(watch, module, state):
    """The capture's TorchFunctionMode (_aten._Watch), and the module with its real parameters and
    buffers (`state`: name -> tensor), for the calls redirected while the capture runs."""
    prev = getattr(_tls, "watch", None), getattr(_tls, "module", None)
    _tls.watch, _tls.module = watch, (module, state)
    try:
        yield
    finally:
        _tls.watch, _tls.module = prev


@contextlib.contextmanager
def _real_state():
    """The module's own parameters and buffers in place of the trace's: a Function that uses the
    module (a reentrant torch.utils.checkpoint's block) runs outside the trace on real tensors."""
    got = getattr(_tls, "module", None)
    if got is None:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module
    with _reparametrize_module(got[0], got[1]):
        yield


def record(key):
    return _records[key]


@contextlib.contextmanager
def calls(state):
    """The Function graphs of one GraftModule call live in `state` while graft runs its forward or
    backward on this thread (the runner reads it)."""
    prev = getattr(_tls, "state", None)
    _tls.state = state
    try:
        yield state
    finally:
        _tls.state = prev


def _array(t):
    return np.ascontiguousarray(t.detach().numpy())


def runner(key, backward, node, arrays):
    """graft's PythonOp kernel (src/python/bindings.cpp): the forward, or the backward through the
    graph the forward of this call kept."""
    rec = _records[key]
    state = getattr(_tls, "state", None)
    if isinstance(rec, _Boundary):  # Note [backward hooks]: identity forward; the hooks in backward
        if not backward:
            return list(arrays)
        # copies: a hook may keep what it is given (graft reuses its buffers after this node)
        grads = [None if g is None else torch.from_numpy(g).clone() for g in arrays]
        got = rec.backward({} if state is None else state, grads)
        return [None if g is None else _array(g.to(dt)) for g, (dt, _) in zip(got, rec.outputs)]
    if not backward:
        train = bool(state is not None and state.get(TRAIN))
        ins = [torch.from_numpy(a) for a in arrays]
        if train:  # the Function may save its inputs; graft reuses their buffers after this node
            ins = [t.clone().requires_grad_(need) for t, need in zip(ins, rec.needs)]
        with torch.enable_grad() if train else torch.no_grad():
            flat = _outputs(rec, _apply(rec.cls, rec.rebuild(ins)))
        if len(flat) != len(rec.outputs):
            raise RuntimeError(f"{rec.name} returned {len(flat)} tensors; at capture it returned {len(rec.outputs)}")
        if train:
            state[key] = (ins, flat)
        return [_array(o.to(dt)) for o, (dt, _) in zip(flat, rec.outputs)]  # the dtype the graph planned
    kept = state.pop(key, None) if state is not None else None
    if kept is None:
        raise RuntimeError(f"graft: the backward of {rec.name} ran without its forward's graph (node {node})")
    ins, flat = kept
    pairs = [(o, torch.from_numpy(g)) for o, g in zip(flat, arrays) if g is not None and o.requires_grad]
    if not pairs or not any(t.requires_grad for t in ins):
        return [None] * len(ins)
    # backward, not autograd.grad: a reentrant torch.utils.checkpoint refuses .grad(), and it adds
    # the gradients of the parameters its block uses into their .grad, as in eager. The inputs are
    # this call's own leaves: their .grad is the Function's input gradient.
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return [None if t.grad is None else _array(t.grad) for t in ins]


def install():
    from . import _graft
    _graft.set_python_op_runner(runner)
